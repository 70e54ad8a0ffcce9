//! [`WriteBehind`]: blocks reach the remote tier from a queue bounded in bytes, written in
//! batches on a thread of their own, so no caller ever waits for the network.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::blocks::RemoteTier;
use super::stats::{bump, TierStats};

/// Most blocks per batch: enough to hide the round trip, few enough that one batch ends
/// well within a deadline.
const BATCH_BLOCKS: usize = 64;
/// Most bytes per batch.
const BATCH_BYTES: u64 = 64 << 20;

struct Item {
    hash: Vec<u8>,
    payload: Vec<u8>,
}

#[derive(Default)]
struct Shared {
    /// Bytes accepted and not yet written or failed.
    inflight: AtomicU64,
    /// Blocks accepted since the start.
    accepted: AtomicU64,
    /// Blocks written or failed since the start, under the lock `flush` waits on.
    finished: Mutex<u64>,
    done: Condvar,
    stop: AtomicBool,
}

/// The write-behind queue of one worker.
///
/// # Examples
/// Blocks are offered after they reached CPU memory; the call takes the bytes, never
/// blocks, and a full queue drops the block (the CPU tier still has it):
/// ```no_run
/// # fn demo(tier: offload_core::tier::RemoteTier, block: Vec<u8>) -> std::io::Result<()> {
/// use offload_core::tier::WriteBehind;
/// use std::time::Duration;
///
/// let mut writer = WriteBehind::spawn(tier, 256 << 20)?;
/// let accepted = writer.offer(&[0xab; 32], block);
/// writer.shutdown(Duration::from_secs(1));
/// # Ok(()) }
/// ```
pub struct WriteBehind {
    tx: Option<Sender<Item>>,
    shared: Arc<Shared>,
    stats: Arc<TierStats>,
    max_inflight_bytes: u64,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for WriteBehind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteBehind")
            .field("inflight_bytes", &self.inflight_bytes())
            .field("max_inflight_bytes", &self.max_inflight_bytes)
            .finish()
    }
}

impl WriteBehind {
    /// Starts the writer thread; at most `max_inflight_bytes` of payload wait or are being
    /// written at any time.
    pub fn spawn(tier: RemoteTier, max_inflight_bytes: u64) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared::default());
        let stats = Arc::clone(tier.stats());
        let thread = std::thread::Builder::new()
            .name("kvoffload-remote-write".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || run(tier, &rx, &shared)
            })?;
        Ok(Self {
            tx: Some(tx),
            shared,
            stats,
            max_inflight_bytes,
            thread: Some(thread),
        })
    }

    /// Queues block `hash` with bytes `payload` for writing. Returns `false`, and counts a
    /// dropped write, when the queue cannot take `payload.len()` more bytes or the writer
    /// stopped.
    pub fn offer(&self, hash: &[u8], payload: Vec<u8>) -> bool {
        self.offer_with(hash, payload.len(), |out| *out = payload)
    }

    /// [`Self::offer`] for a payload of `len` bytes that `fill` produces (appending to an
    /// empty buffer), called only once the queue has room: a dropped write costs no copy.
    pub fn offer_with(&self, hash: &[u8], len: usize, fill: impl FnOnce(&mut Vec<u8>)) -> bool {
        let n = len as u64;
        let max = self.max_inflight_bytes;
        let reserved = self
            .shared
            .inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                q.checked_add(n).filter(|&t| t <= max)
            })
            .is_ok();
        let Some(tx) = self.tx.as_ref().filter(|_| reserved) else {
            if reserved {
                self.shared.inflight.fetch_sub(n, Ordering::AcqRel);
            }
            bump(&self.stats.writes_dropped, 1);
            return false;
        };
        let mut payload = Vec::with_capacity(len);
        fill(&mut payload);
        if payload.len() != len {
            // The bound was reserved for `len` bytes; anything else is not this block.
            self.shared.inflight.fetch_sub(n, Ordering::AcqRel);
            bump(&self.stats.writes_dropped, 1);
            return false;
        }
        self.shared.accepted.fetch_add(1, Ordering::AcqRel);
        let item = Item {
            hash: hash.to_vec(),
            payload,
        };
        if tx.send(item).is_err() {
            // The thread is gone (it only exits on shutdown); undo the reservation.
            self.shared.inflight.fetch_sub(n, Ordering::AcqRel);
            finish(&self.shared, 1);
            bump(&self.stats.writes_dropped, 1);
            return false;
        }
        bump(&self.stats.writes_queued, 1);
        true
    }

    /// Payload bytes accepted and not yet written or failed.
    pub fn inflight_bytes(&self) -> u64 {
        self.shared.inflight.load(Ordering::Acquire)
    }

    /// Waits until every block accepted before the call is written or failed, at most
    /// `timeout`; returns whether it got there.
    pub fn flush(&self, timeout: Duration) -> bool {
        let target = self.shared.accepted.load(Ordering::Acquire);
        let deadline = Instant::now() + timeout;
        let mut finished = self
            .shared
            .finished
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while *finished < target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            finished = self
                .shared
                .done
                .wait_timeout(finished, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Writes what is queued for at most `drain` (see [`Self::flush`]), then drops the rest
    /// and stops the thread. The thread ends after at most one more batch, which its
    /// store's deadline bounds.
    pub fn shutdown(&mut self, drain: Duration) {
        if self.tx.is_some() {
            self.flush(drain);
        }
        self.shared.stop.store(true, Ordering::Release);
        self.tx = None;
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("kvoffload: the remote write thread panicked");
            }
        }
    }
}

impl Drop for WriteBehind {
    fn drop(&mut self) {
        self.shutdown(Duration::ZERO);
    }
}

fn finish(shared: &Shared, blocks: u64) {
    let mut finished = shared
        .finished
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    *finished += blocks;
    shared.done.notify_all();
}

fn run(mut tier: RemoteTier, rx: &Receiver<Item>, shared: &Shared) {
    let stats = Arc::clone(tier.stats());
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        let mut bytes = batch[0].payload.len() as u64;
        while batch.len() < BATCH_BLOCKS && bytes < BATCH_BYTES {
            let Ok(next) = rx.try_recv() else { break };
            bytes += next.payload.len() as u64;
            batch.push(next);
        }
        let n = batch.len() as u64;
        if shared.stop.load(Ordering::Acquire) {
            bump(&stats.writes_dropped, n);
        } else {
            let blocks: Vec<(Vec<u8>, Vec<Vec<u8>>)> = batch
                .into_iter()
                .map(|i| (i.hash, vec![i.payload]))
                .collect();
            if let Err(e) = tier.store(&blocks) {
                bump(&stats.writes_failed, n);
                log::warn!("kvoffload: remote write of {n} block(s) refused: {e}");
            }
        }
        shared.inflight.fetch_sub(bytes, Ordering::AcqRel);
        finish(shared, n);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::tier::{KeySpace, LayoutFingerprint, MemoryStore};

    fn writer(store: &MemoryStore, max: u64) -> WriteBehind {
        let keys = KeySpace::new("w", LayoutFingerprint(3)).unwrap();
        let tier = RemoteTier::new(Box::new(store.clone()), keys, Arc::default());
        WriteBehind::spawn(tier, max).unwrap()
    }

    /// Runs `f` on another thread; panics if it blocks (on the store, say).
    fn returns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || tx.send(f()));
        rx.recv_timeout(Duration::from_secs(30))
            .expect("the call blocked")
    }

    #[test]
    fn offers_never_wait_for_the_store_and_a_full_queue_drops() {
        let store = MemoryStore::default();
        store.pause();
        let w = Arc::new(writer(&store, 300));
        let offers = returns({
            let w = Arc::clone(&w);
            move || {
                (0..5u8)
                    .map(|i| w.offer(&[i; 8], vec![i; 100]))
                    .collect::<Vec<_>>()
            }
        });
        // The store holds every call, yet offers return: 300 bytes fit, the rest drop.
        assert_eq!(offers, [true, true, true, false, false]);
        assert_eq!(w.inflight_bytes(), 300);
        let s = w.stats.snapshot();
        assert_eq!(
            (s.writes_queued, s.writes_dropped, s.writes_done),
            (3, 2, 0)
        );
        assert!(!w.flush(Duration::from_millis(1)));
        store.resume();
        assert!(w.flush(Duration::from_secs(30)));
        assert_eq!(w.inflight_bytes(), 0);
        assert_eq!(w.stats.snapshot().writes_done, 3);
        assert!(w.offer(&[9; 8], vec![9; 300]), "room again once written");
        assert!(
            !w.offer(&[9; 8], vec![9; 301]),
            "a block over the bound never fits"
        );
    }

    #[test]
    fn queued_blocks_go_out_in_batches() {
        let store = MemoryStore::default();
        store.pause();
        let mut w = writer(&store, 1 << 20);
        for i in 0..20u8 {
            assert!(w.offer(&[i; 8], vec![i; 64]));
        }
        store.resume();
        assert!(w.flush(Duration::from_secs(30)));
        // The thread took at most one block before the pause let go; the rest is one batch.
        assert!(store.calls() <= 2, "{} round trips", store.calls());
        assert_eq!(w.stats.snapshot().write_round_trips, store.calls());
        w.shutdown(Duration::ZERO);
        assert!(
            !w.offer(&[0; 8], vec![0; 8]),
            "a stopped writer takes nothing"
        );
    }
}
