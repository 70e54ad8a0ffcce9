//! [`ProbeQueue`]: remote existence checks on a thread of their own, polled by the
//! scheduler without blocking.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;

use super::blocks::RemoteTier;

/// What identifies a chain: its length and its last hash (which covers every block before
/// it), and its first hash (where it starts).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Chain {
    len: usize,
    first: Vec<u8>,
    last: Vec<u8>,
}

impl Chain {
    fn of<H: AsRef<[u8]>>(hashes: &[H]) -> Self {
        let get = |h: Option<&H>| h.map(|h| h.as_ref().to_vec()).unwrap_or_default();
        Self {
            len: hashes.len(),
            first: get(hashes.first()),
            last: get(hashes.last()),
        }
    }
}

#[derive(Debug)]
enum State {
    Pending(Chain),
    Done(Chain, usize),
}

struct Probe {
    req: String,
    chain: Chain,
    hashes: Vec<Vec<u8>>,
}

type Results = Arc<Mutex<HashMap<String, State>>>;

/// Existence checks of the scheduler: one per request and chain, answered on the queue's
/// thread, one round trip each.
///
/// # Examples
/// ```no_run
/// # fn demo(tier: offload_core::tier::RemoteTier, rest: Vec<[u8; 32]>) -> std::io::Result<()> {
/// use offload_core::tier::ProbeQueue;
///
/// let probes = ProbeQueue::spawn(tier)?;
/// // Every engine step, until the answer is in: `None` means "ask again next step".
/// match probes.poll("req-1", &rest) {
///     None => { /* the scheduler keeps the request waiting this step */ }
///     Some(blocks) => { /* the first `blocks` of `rest` can be fetched */ }
/// }
/// probes.forget("req-1");
/// # Ok(()) }
/// ```
pub struct ProbeQueue {
    tx: Option<Sender<Probe>>,
    results: Results,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ProbeQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self
            .results
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        f.debug_struct("ProbeQueue").field("requests", &n).finish()
    }
}

impl ProbeQueue {
    /// Starts the probing thread.
    pub fn spawn(tier: RemoteTier) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Probe>();
        let results: Results = Arc::default();
        let thread = std::thread::Builder::new()
            .name("kvoffload-remote-probe".into())
            .spawn({
                let results = Arc::clone(&results);
                let mut tier = tier;
                move || {
                    while let Ok(p) = rx.recv() {
                        let current = |results: &Results| {
                            matches!(
                                results.lock().unwrap_or_else(PoisonError::into_inner).get(&p.req),
                                Some(State::Pending(c)) if *c == p.chain
                            )
                        };
                        // A request forgotten or asked about another chain meanwhile
                        // needs no answer for this one.
                        if !current(&results) {
                            continue;
                        }
                        let found = tier.probe_chain(&p.hashes).unwrap_or_else(|e| {
                            log::warn!("kvoffload: remote probe for {}: {e}", p.req);
                            0
                        });
                        let mut r = results.lock().unwrap_or_else(PoisonError::into_inner);
                        if matches!(r.get(&p.req), Some(State::Pending(c)) if *c == p.chain) {
                            r.insert(p.req, State::Done(p.chain, found));
                        }
                    }
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            results,
            thread: Some(thread),
        })
    }

    /// How many leading blocks of `hashes` the store holds, once known for this request
    /// and chain; `None` while the check is in flight. The first call for a chain starts
    /// its check; a request that asks about another chain (its prompt changed, its local
    /// hit grew) starts a new one. An empty chain is `Some(0)` at once.
    pub fn poll<H: AsRef<[u8]>>(&self, req: &str, hashes: &[H]) -> Option<usize> {
        if hashes.is_empty() {
            return Some(0);
        }
        let chain = Chain::of(hashes);
        let mut results = self.results.lock().unwrap_or_else(PoisonError::into_inner);
        match results.get(req) {
            Some(State::Done(c, n)) if *c == chain => return Some(*n),
            Some(State::Pending(c)) if *c == chain => return None,
            _ => {}
        }
        let probe = Probe {
            req: req.to_string(),
            chain: chain.clone(),
            hashes: hashes.iter().map(|h| h.as_ref().to_vec()).collect(),
        };
        match &self.tx {
            Some(tx) if tx.send(probe).is_ok() => {
                results.insert(req.to_string(), State::Pending(chain));
                None
            }
            // No thread to ask: the store is as good as absent.
            _ => Some(0),
        }
    }

    /// Drops what is known about `req` (it was scheduled or finished).
    pub fn forget(&self, req: &str) {
        self.results
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(req);
    }

    /// Stops the thread after the check in flight, if any (its store's deadline bounds it).
    pub fn shutdown(&mut self) {
        self.tx = None;
        self.results
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("kvoffload: the remote probe thread panicked");
            }
        }
    }
}

impl Drop for ProbeQueue {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::tier::{KeySpace, LayoutFingerprint, MemoryStore};

    fn hashes(n: u8) -> Vec<[u8; 32]> {
        (1..=n).map(|i| [i; 32]).collect()
    }

    /// Polls until an answer comes; the store answers as soon as it is resumed.
    fn answer(q: &ProbeQueue, req: &str, h: &[[u8; 32]]) -> usize {
        let start = Instant::now();
        loop {
            if let Some(n) = q.poll(req, h) {
                return n;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "no answer");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn polls_answer_none_while_in_flight_and_ask_once_per_chain() {
        let store = MemoryStore::default();
        let keys = KeySpace::new("p", LayoutFingerprint(5)).unwrap();
        let mut writer = RemoteTier::new(Box::new(store.clone()), keys.clone(), Arc::default());
        writer
            .store(&[
                ([1u8; 32], vec![vec![0u8; 4]]),
                ([2u8; 32], vec![vec![0u8; 4]]),
            ])
            .unwrap();
        let before = store.calls();
        let q = ProbeQueue::spawn(RemoteTier::new(
            Box::new(store.clone()),
            keys,
            Arc::default(),
        ))
        .unwrap();
        store.pause();
        let h = hashes(4);
        assert_eq!(q.poll("a", &h), None);
        assert_eq!(q.poll("a", &h), None, "still in flight");
        store.resume();
        assert_eq!(answer(&q, "a", &h), 2);
        assert_eq!(q.poll("a", &h), Some(2), "answered from the result");
        assert_eq!(
            store.calls() - before,
            1,
            "one round trip for every poll of the chain"
        );

        // Another chain for the same request is a new check.
        assert_eq!(answer(&q, "a", &h[..1]), 1);
        q.forget("a");
        assert_eq!(answer(&q, "a", &h[..1]), 1);
        assert_eq!(store.calls() - before, 3);
        assert_eq!(q.poll("b", &[] as &[[u8; 32]]), Some(0));
    }
}
