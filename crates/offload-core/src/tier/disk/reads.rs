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

use super::error::IoKind;
use super::layout::key_digest;
use super::stats::DiskStats;
use super::store::DiskStore;
use crate::tier::fill::through_get;
use crate::tier::value::{encode, stored_hash, ValueError};
use crate::tier::{BlockFill, Fill, LayoutFingerprint, RemoteKey, TierError};

impl DiskStore {
    /// Reads the slots of `keys` with `read` (on the I/O threads; given the key's position,
    /// its digest and its slot) and settles each: `Ok(Some)` a good block (its hash, by `hash_of`, to
    /// the journal), `Ok(None)` a block that failed its checks (counted, its slot freed and
    /// its entry cleared), `Err` a failed I/O (counted towards disabling the tier).
    pub(super) fn read_batch<R: Send>(
        &self,
        keys: &[RemoteKey],
        read: impl Fn(usize, u128, u64) -> Result<Option<R>, IoKind> + Sync,
        hash_of: impl Fn(&R) -> Option<&[u8]>,
    ) -> Vec<Result<Option<R>, TierError>> {
        if self.is_disabled() {
            return keys.iter().map(|_| Ok(None)).collect();
        }
        let started = Instant::now();
        let wanted: Vec<(usize, u128, Option<u64>)> = {
            let mut index = self.index();
            keys.iter()
                .enumerate()
                .map(|(i, k)| {
                    let d = key_digest(k.as_str().as_bytes());
                    (i, d, index.begin_read(d))
                })
                .collect()
        };
        let reads = self.parallel(&wanted, |&(i, d, slot)| slot.map(|s| read(i, d, s)));
        let s = &self.shared;
        let mut index = self.index();
        let mut out = Vec::with_capacity(keys.len());
        for (&(_, digest, slot), read) in wanted.iter().zip(reads) {
            let Some(slot) = slot else {
                out.push(Ok(None));
                continue;
            };
            index.end_read(slot);
            match read {
                Some(Ok(Some(got))) => {
                    self.outcome(Ok(()));
                    // A block a restart recovered is reported once read (or written).
                    if let Some(h) = hash_of(&got) {
                        self.journal(|j| j.stored(slot, h));
                    }
                    DiskStats::add(&s.stats.reads, 1);
                    DiskStats::add(&s.stats.bytes_read, s.geo.slot_bytes);
                    out.push(Ok(Some(got)));
                }
                Some(Ok(None)) => {
                    DiskStats::add(&s.stats.reads, 1);
                    DiskStats::add(&s.stats.checksum_failures, 1);
                    index.drop_slot(slot, digest);
                    self.clear_entry(slot);
                    self.journal(|j| j.removed(slot));
                    out.push(Ok(None));
                }
                Some(Err(kind)) => {
                    self.outcome(Err(kind));
                    out.push(Err(TierError::Store {
                        op: "get",
                        reason: format!("disk read failed ({})", kind.name()),
                    }));
                }
                None => out.push(Ok(None)),
            }
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
            |_, digest, slot| {
                let mut payload = vec![0u8; block_bytes];
                let entry = self.read_slot_into(slot, digest, &mut [&mut payload[..]])?;
                Ok(entry.map(|e| encode(fingerprint, e.hash(), &[&payload])))
            },
            |v| stored_hash(v),
        )
    }

    /// `get_into`: every block read straight into its destination. Destinations that do
    /// not take this store's blocks (another payload length than the slots') go through
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
        // Each block's destination is taken by the one I/O thread that reads its slot.
        let cells: Vec<Mutex<&mut BlockFill<'_, '_>>> = blocks.iter_mut().map(Mutex::new).collect();
        let reads = self.read_batch(
            keys,
            |i, digest, slot| {
                let mut block = cells[i].lock().unwrap_or_else(PoisonError::into_inner);
                self.read_slot_into(slot, digest, &mut block.parts)
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
