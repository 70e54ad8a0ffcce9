//! [`RemoteTier`]: block-level calls on a [`RemoteStore`], with keys, value checks and
//! counters.

use std::ops::Range;
use std::sync::Arc;

use super::fill::{BlockFill, Fill};
use super::key::KeySpace;
use super::stats::{bump, TierStats};
use super::value::{decode, decode_verified, ValueParts};
use super::{RemoteKey, RemoteStore, TierError};

/// A verified block as fetched: the stored value and where its payload lies in it, so the
/// payload is never copied out of the buffer the network filled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchedBlock {
    value: Vec<u8>,
    payload: Range<usize>,
}

impl FetchedBlock {
    /// The block's bytes, as the engine that stored it had them.
    pub fn payload(&self) -> &[u8] {
        &self.value[self.payload.clone()]
    }
}

/// A store must answer every key; one that does not is broken, and nothing it said is
/// matched to a key.
fn check_count(op: &'static str, answers: usize, keys: usize) -> Result<(), TierError> {
    if answers == keys {
        return Ok(());
    }
    Err(TierError::Store {
        op,
        reason: format!("{answers} answers for {keys} keys"),
    })
}

/// What a fetch's answers came to, beyond the counters: the keys whose values were
/// rejected, and whether a failure was logged yet.
struct Tally {
    rejected: Vec<RemoteKey>,
    first: bool,
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            rejected: Vec::new(),
            first: true,
        }
    }
}

/// One engine rank's view of the remote tier.
pub struct RemoteTier {
    store: Box<dyn RemoteStore>,
    keys: KeySpace,
    stats: Arc<TierStats>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("store", &self.store.describe())
            .field("keys", &self.keys)
            .finish()
    }
}

impl RemoteTier {
    /// Blocks of the layout `keys` describes, kept in `store`; counters go to `stats`.
    pub fn new(store: Box<dyn RemoteStore>, keys: KeySpace, stats: Arc<TierStats>) -> Self {
        Self { store, keys, stats }
    }

    /// The counters this tier adds to.
    pub fn stats(&self) -> &Arc<TierStats> {
        &self.stats
    }

    /// The keys this tier uses.
    pub fn keys(&self) -> &KeySpace {
        &self.keys
    }

    /// The store, for logs.
    pub fn describe(&self) -> String {
        self.store.describe()
    }

    fn keys_of<H: AsRef<[u8]>>(&self, hashes: &[H]) -> Result<Vec<RemoteKey>, TierError> {
        hashes.iter().map(|h| self.keys.key(h.as_ref())).collect()
    }

    /// How many leading blocks of the chain `hashes` the store holds, asked in one round
    /// trip. A key whose check failed ends the run like a missing one (its failure is
    /// counted); an error means a hash no key takes, or a store that skipped keys.
    pub fn probe_chain<H: AsRef<[u8]>>(&mut self, hashes: &[H]) -> Result<usize, TierError> {
        if hashes.is_empty() {
            return Ok(0);
        }
        let keys = self.keys_of(hashes)?;
        let answers = self.store.exists(&keys);
        bump(&self.stats.probe_round_trips, 1);
        check_count("exists", answers.len(), keys.len())?;
        bump(&self.stats.probe_keys, keys.len() as u64);
        let mut run = 0;
        let mut first = true;
        let mut counting = true;
        for a in &answers {
            match a {
                Ok(true) if counting => run += 1,
                Ok(_) => counting = false,
                Err(e) => {
                    counting = false;
                    self.failed(e, &mut first);
                }
            }
        }
        bump(&self.stats.probe_hits, run as u64);
        Ok(run)
    }

    /// Fetches the blocks `hashes` in one round trip and verifies each against this
    /// layout, its hash and `block_bytes`. A missing, failed or rejected block is `None`
    /// (a rejected one is counted and logged, never returned). Errors as for
    /// [`Self::probe_chain`].
    pub fn fetch<H: AsRef<[u8]>>(
        &mut self,
        hashes: &[H],
        block_bytes: usize,
    ) -> Result<Vec<Option<FetchedBlock>>, TierError> {
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let keys = self.keys_of(hashes)?;
        let started = std::time::Instant::now();
        let answers = self.store.get(&keys);
        self.round_trip(started);
        check_count("get", answers.len(), keys.len())?;
        let fp = self.keys.fingerprint();
        let decode = if self.store.verifies_checksums() {
            decode_verified
        } else {
            decode
        };
        let mut tally = Tally::default();
        let mut out = Vec::with_capacity(answers.len());
        for ((answer, hash), key) in answers.into_iter().zip(hashes).zip(&keys) {
            let mut block = None;
            let fill = answer.map(|value| {
                let Some(value) = value else {
                    return Fill::Missing;
                };
                match decode(&value, fp, hash.as_ref(), block_bytes) {
                    Ok(payload) => {
                        let start = payload.as_ptr() as usize - value.as_ptr() as usize;
                        let payload = start..start + payload.len();
                        block = Some(FetchedBlock { value, payload });
                        Fill::Filled
                    }
                    Err(e) => Fill::Rejected(e),
                }
            });
            self.count(fill, key, block_bytes, &mut tally);
            out.push(block);
        }
        self.settle(tally);
        Ok(out)
    }

    /// Fetches the blocks `hashes` in one round trip straight into `dests` (block `i`'s
    /// payload over the slices `dests[i]`, in order: a CPU block's slice of each layer
    /// region), with every check [`Self::fetch`] makes; whether each block was filled. A
    /// block not filled (missing, failed or rejected, counted as by [`Self::fetch`]) may
    /// have left anything in its destination. Errors as for [`Self::probe_chain`], and
    /// when `dests` does not give one destination per hash.
    pub fn fetch_into<H: AsRef<[u8]>>(
        &mut self,
        hashes: &[H],
        dests: Vec<Vec<&mut [u8]>>,
    ) -> Result<Vec<bool>, TierError> {
        check_count("fetch_into", dests.len(), hashes.len())?;
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let keys = self.keys_of(hashes)?;
        let mut blocks: Vec<BlockFill<'_, '_>> = hashes
            .iter()
            .zip(dests)
            .map(|(h, parts)| BlockFill::new(h.as_ref(), parts))
            .collect();
        let started = std::time::Instant::now();
        let answers = self
            .store
            .get_into(&keys, self.keys.fingerprint(), &mut blocks);
        self.round_trip(started);
        check_count("get", answers.len(), keys.len())?;
        let mut tally = Tally::default();
        let mut out = Vec::with_capacity(answers.len());
        for ((answer, block), key) in answers.into_iter().zip(&blocks).zip(&keys) {
            out.push(matches!(answer, Ok(Fill::Filled)));
            self.count(answer, key, block.len(), &mut tally);
        }
        self.settle(tally);
        Ok(out)
    }

    fn round_trip(&self, started: std::time::Instant) {
        let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        bump(&self.stats.get_round_trips, 1);
        bump(&self.stats.get_micros, micros);
    }

    /// Counts one block's answer to a fetch; a rejected value is logged and its key kept
    /// for [`Self::settle`].
    fn count(
        &self,
        answer: Result<Fill, TierError>,
        key: &RemoteKey,
        block_bytes: usize,
        tally: &mut Tally,
    ) {
        match answer {
            Ok(Fill::Filled) => {
                bump(&self.stats.get_hits, 1);
                bump(&self.stats.bytes_read, block_bytes as u64);
            }
            Ok(Fill::Rejected(e)) => {
                bump(&self.stats.corrupt_values, 1);
                log::warn!("kvoffload: remote value {key} rejected ({e}); recomputing");
                tally.rejected.push(key.clone());
            }
            Ok(Fill::Missing) => bump(&self.stats.get_misses, 1),
            Err(e) => self.failed(&e, &mut tally.first),
        }
    }

    /// Tells the store which values a fetch rejected, so it can free them.
    fn settle(&mut self, tally: Tally) {
        if !tally.rejected.is_empty() {
            self.store.discard(&tally.rejected);
        }
    }

    /// Writes blocks in one round trip; returns how many were written. Each block is its
    /// hash and its bytes in parts (one slice per layer region, concatenated). Errors as
    /// for [`Self::probe_chain`].
    pub fn store<H: AsRef<[u8]>, P: AsRef<[u8]>>(
        &mut self,
        blocks: &[(H, Vec<P>)],
    ) -> Result<usize, TierError> {
        if blocks.is_empty() {
            return Ok(0);
        }
        let fp = self.keys.fingerprint();
        let mut entries = Vec::with_capacity(blocks.len());
        let mut sizes = Vec::with_capacity(blocks.len());
        for (hash, parts) in blocks {
            let key = self.keys.key(hash.as_ref())?;
            let parts: Vec<&[u8]> = parts.iter().map(AsRef::as_ref).collect();
            sizes.push(parts.iter().map(|p| p.len() as u64).sum::<u64>());
            entries.push((key, ValueParts::new(fp, hash.as_ref(), parts)));
        }
        let answers = self.store.put_parts(&entries);
        bump(&self.stats.write_round_trips, 1);
        check_count("put", answers.len(), entries.len())?;
        let mut written = 0;
        let mut first = true;
        for (answer, size) in answers.iter().zip(sizes) {
            match answer {
                Ok(()) => {
                    written += 1;
                    bump(&self.stats.writes_done, 1);
                    bump(&self.stats.bytes_written, size);
                }
                Err(e) => {
                    bump(&self.stats.writes_failed, 1);
                    self.failed(e, &mut first);
                }
            }
        }
        Ok(written)
    }

    /// Counts a failed key; the first failure of a call is logged, the rest only counted.
    fn failed(&self, e: &TierError, first: &mut bool) {
        bump(&self.stats.failed_keys, 1);
        if matches!(e, TierError::Timeout { .. }) {
            bump(&self.stats.timeouts, 1);
        }
        if matches!(e, TierError::Disabled { .. }) {
            return;
        }
        if std::mem::take(first) {
            log::warn!("kvoffload: remote tier {}: {e}", self.store.describe());
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::tier::LayoutFingerprint;

    /// Answers one key fewer than asked.
    struct ShortStore;

    impl RemoteStore for ShortStore {
        fn exists(&mut self, keys: &[RemoteKey]) -> Vec<Result<bool, TierError>> {
            keys.iter().skip(1).map(|_| Ok(true)).collect()
        }
        fn get(&mut self, keys: &[RemoteKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
            keys.iter().skip(1).map(|_| Ok(None)).collect()
        }
        fn put(&mut self, entries: &[(RemoteKey, Vec<u8>)]) -> Vec<Result<(), TierError>> {
            entries.iter().skip(1).map(|_| Ok(())).collect()
        }
        fn describe(&self) -> String {
            "short".into()
        }
    }

    #[test]
    fn a_store_that_skips_keys_is_an_error_not_a_shifted_answer() {
        let keys = KeySpace::new("s", LayoutFingerprint(1)).unwrap();
        let mut t = RemoteTier::new(Box::new(ShortStore), keys, Arc::default());
        let h = [[1u8; 32], [2u8; 32]];
        assert!(t.probe_chain(&h).is_err());
        assert!(t.fetch(&h, 8).is_err());
        assert!(t
            .store(&[(h[0], vec![vec![0u8; 8]]), (h[1], vec![vec![0u8; 8]])])
            .is_err());
    }
}
