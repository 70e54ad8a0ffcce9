//! A batch of reads for [`DiskStore`], into values it hands out (`get`) or straight into
//! the caller's blocks (`get_into`), with the same bookkeeping for both: the index's read
//! pins, the counters, the journal, a bad block's slot freed, the consecutive-error count.
//!
//! A slot holds only the block's payload (`layout.rs`), so into the caller's blocks a
//! read is the payload straight into the block's slices (`slot_io.rs`), checked against
//! the slot's entry: its key digest, payload length and the payload's checksum, bound to
//! the key. The entry also names the block's hash, which `get_into` compares with the
//! hash asked for; the layout is the whole file's (its header), compared once. `get`
//! builds a value in the remote format from the entry and the payload, for callers that
//! take values (tests, destinations of another size).

use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use super::layout::key_digest;
use super::runs::{consecutive_runs, per_block, RunResults, Wanted};
use super::stats::DiskStats;
use super::store::DiskStore;
use crate::tier::fill::through_get;
use crate::tier::value::{encode, stored_hash, ValueError};
use crate::tier::{BlockFill, Fill, LayoutFingerprint, RemoteKey, TierError};

impl DiskStore {
    /// Reads the blocks of `keys` with `read` (on the I/O threads, a run of blocks in
    /// consecutive slots at a time, as long as `runs` says where `coalesce`; it returns a
    /// result per block of the run, and whether the run was one I/O) and settles each: `Ok(Some)` a
    /// good block (its hash, by `hash_of`, to the journal), `Ok(None)` a block that failed
    /// its checks (counted, its slot freed and its entry cleared), `Err` a failed I/O
    /// (counted, once per I/O, towards disabling the tier).
    pub(super) fn read_batch<R: Send>(
        &self,
        keys: &[RemoteKey],
        coalesce: bool,
        read: impl Fn(&[Wanted]) -> RunResults<Option<R>> + Sync,
        hash_of: impl Fn(&R) -> Option<&[u8]>,
    ) -> Vec<Result<Option<R>, TierError>> {
        if self.is_disabled() {
            return keys.iter().map(|_| Ok(None)).collect();
        }
        let started = Instant::now();
        let found: Vec<Wanted> = {
            let mut index = self.index();
            keys.iter()
                .enumerate()
                .filter_map(|(i, k)| {
                    let digest = key_digest(k.as_str().as_bytes());
                    index.begin_read(digest).map(|at| Wanted { i, digest, at })
                })
                .collect()
        };
        let longest = if coalesce {
            self.run_blocks(found.len())
        } else {
            1
        };
        let runs = consecutive_runs(&found, longest, |w| w.at.slot);
        let per_run = self.parallel(&runs, |r| read(&found[r.clone()]));
        let s = &self.shared;
        let mut index = self.index();
        let mut out: Vec<Result<Option<R>, TierError>> = keys.iter().map(|_| Ok(None)).collect();
        for (w, (read, counts)) in found.iter().zip(per_block(per_run)) {
            index.end_read(w.at.entry);
            out[w.i] = match read {
                Ok(Some(got)) => {
                    self.outcome(Ok(()));
                    // A block a restart recovered is reported once read (or written).
                    if let Some(h) = hash_of(&got) {
                        self.journal(|j| j.stored(w.at.entry, h));
                    }
                    DiskStats::add(&s.stats.reads, 1);
                    DiskStats::add(&s.stats.bytes_read, s.geo.slot_bytes);
                    Ok(Some(got))
                }
                Ok(None) => {
                    DiskStats::add(&s.stats.reads, 1);
                    DiskStats::add(&s.stats.checksum_failures, 1);
                    index.drop_entry(w.at.entry, w.digest);
                    self.clear_entry(w.at.entry);
                    self.journal(|j| j.removed(w.at.entry));
                    Ok(None)
                }
                Err(kind) => {
                    if counts {
                        self.outcome(Err(kind));
                    }
                    Err(TierError::Store {
                        op: "get",
                        reason: format!("disk read failed ({})", kind.name()),
                    })
                }
            };
        }
        self.update_resident(&index);
        let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        DiskStats::add(&s.stats.read_micros, micros);
        out
    }

    /// `get`: each block read into a value of its own, in the remote format (built from
    /// the file's layout, the entry's hash and the payload).
    pub(super) fn get_batch(&self, keys: &[RemoteKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        let fingerprint = LayoutFingerprint(self.shared.geo.fingerprint);
        let block_bytes = self.shared.geo.block_bytes as usize;
        self.read_batch(
            keys,
            false,
            |run| {
                let results = run
                    .iter()
                    .map(|w| {
                        let mut payload = vec![0u8; block_bytes];
                        let entry = self.read_slot_into(w.at, w.digest, &mut [&mut payload[..]])?;
                        Ok(entry.map(|e| encode(fingerprint, e.hash(), &[&payload])))
                    })
                    .collect();
                (results, false)
            },
            |v| stored_hash(v),
        )
    }

    /// `get_into`: every block read straight into its destination, a run of blocks in
    /// consecutive slots with one I/O (`runs.rs`). Destinations that do not
    /// take this store's blocks (another payload length than the slots') go through
    /// `get`, which names the mismatch as it does for `fetch`.
    pub(super) fn fill_batch(
        &mut self,
        keys: &[RemoteKey],
        fingerprint: LayoutFingerprint,
        blocks: &mut [BlockFill<'_, '_>],
    ) -> Vec<Result<Fill, TierError>> {
        let block_bytes = self.shared.geo.block_bytes as usize;
        if !blocks.iter().all(|b| b.len() == block_bytes) {
            return through_get(self, keys, fingerprint, blocks);
        }
        let held = LayoutFingerprint(self.shared.geo.fingerprint);
        // Each block's destination is taken by the one I/O thread that reads its run.
        let cells: Vec<Mutex<&mut BlockFill<'_, '_>>> = blocks.iter_mut().map(Mutex::new).collect();
        let reads = self.read_batch(
            keys,
            true,
            |run| {
                let mut guards: Vec<_> = run
                    .iter()
                    .map(|w| cells[w.i].lock().unwrap_or_else(PoisonError::into_inner))
                    .collect();
                let mut parts: Vec<&mut [&mut [u8]]> =
                    guards.iter_mut().map(|g| &mut g.parts[..]).collect();
                self.read_run_into(run, &mut parts)
            },
            |e| Some(e.hash()),
        );
        reads
            .into_iter()
            .zip(cells)
            .map(|(read, cell)| {
                let block = cell.into_inner().unwrap_or_else(PoisonError::into_inner);
                read.map(|entry| match entry {
                    None => Fill::Missing,
                    Some(_) if held != fingerprint => Fill::Rejected(ValueError::Fingerprint {
                        found: held,
                        expected: fingerprint,
                    }),
                    Some(e) if e.hash() != block.hash => Fill::Rejected(ValueError::Hash),
                    Some(_) => Fill::Filled,
                })
            })
            .collect()
    }
}
