//! A batch of reads for [`DiskStore`], into values it hands out (`get`) or straight into
//! the caller's blocks (`get_into`), with the same bookkeeping for both: the index's read
//! pins, the counters, the journal, a bad block's slot freed, the consecutive-error count.
//!
//! Into the caller's blocks, a block costs one copy in user space, not two: with
//! `O_DIRECT` the slot is read into a reused aligned buffer and its payload copied into
//! the block's slices with the checksum summed in that copy; with the page cache
//! `preadv`s of about [`SUM_GROUP`] bytes put the header and trailer in small buffers and
//! the payload straight into the slices, the checksum summed over each as it lands.

use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use super::error::IoKind;
use super::layout::key_digest;
use super::stats::DiskStats;
use super::store::DiskStore;
use crate::tier::fill::{copy_verified_scatter, through_get, PieceSum};
use crate::tier::value::{check_header, stored_hash, FIXED_HEADER, TRAILER};
use crate::tier::{BlockFill, Fill, LayoutFingerprint, RemoteKey, TierError, MAX_HASH_BYTES};

/// Bytes read from the page cache per `preadv` into a caller's block, then summed while
/// they are in the core's cache (a 2 MiB block summed after one `preadv` of all of it is
/// read from memory a second time).
const SUM_GROUP: usize = 256 << 10;

/// The header of a value read into a caller's block: the bytes before its payload.
struct Header {
    bytes: [u8; FIXED_HEADER + MAX_HASH_BYTES],
    len: usize,
}

impl Header {
    fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl DiskStore {
    /// Reads the slots of `keys` with `read` (on the I/O threads; given the key's position
    /// and its slot) and settles each: `Ok(Some)` a good block (its hash, by `hash_of`, to
    /// the journal), `Ok(None)` a block that failed its checks (counted, its slot freed and
    /// its entry cleared), `Err` a failed I/O (counted towards disabling the tier).
    pub(super) fn read_batch<R: Send>(
        &self,
        keys: &[RemoteKey],
        read: impl Fn(usize, u64) -> Result<Option<R>, IoKind> + Sync,
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
        let reads = self.parallel(&wanted, |&(i, _, slot)| slot.map(|s| read(i, s)));
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

    /// `get_into`: every block read straight into its destination. Destinations that do
    /// not take this store's blocks (another payload length than the slots' values leave
    /// room for) go through `get`, which names the mismatch as it does for `fetch`.
    pub(super) fn fill_batch(
        &mut self,
        keys: &[RemoteKey],
        fingerprint: LayoutFingerprint,
        blocks: &mut [BlockFill<'_, '_>],
    ) -> Vec<Result<Fill, TierError>> {
        let value_len = self.shared.geo.value_len as usize;
        let payload_len = blocks.first().map_or(0, BlockFill::len);
        let header_len = value_len.checked_sub(payload_len + TRAILER);
        let fits = header_len
            .is_some_and(|h| (FIXED_HEADER..=FIXED_HEADER + MAX_HASH_BYTES).contains(&h))
            && blocks.iter().all(|b| b.len() == payload_len);
        let Some(header_len) = header_len.filter(|_| fits) else {
            return through_get(self, keys, fingerprint, blocks);
        };
        // Each block's destination is taken by the one I/O thread that reads its slot.
        let cells: Vec<Mutex<&mut BlockFill<'_, '_>>> = blocks.iter_mut().map(Mutex::new).collect();
        let reads = self.read_batch(
            keys,
            |i, slot| {
                let mut block = cells[i].lock().unwrap_or_else(PoisonError::into_inner);
                self.read_slot_into(slot, header_len, &mut block.parts)
            },
            |h| stored_hash(h.as_slice()),
        );
        reads
            .into_iter()
            .zip(cells)
            .map(|(read, cell)| {
                let block = cell.into_inner().unwrap_or_else(PoisonError::into_inner);
                read.map(|header| match header {
                    None => Fill::Missing,
                    Some(h) => {
                        match check_header(
                            h.as_slice(),
                            value_len,
                            fingerprint,
                            block.hash,
                            payload_len,
                        ) {
                            Ok(()) => Fill::Filled,
                            Err(e) => Fill::Rejected(e),
                        }
                    }
                })
            })
            .collect()
    }

    /// Reads slot `slot` (values with a `header_len`-byte header) with its payload into
    /// `parts` and checks it against its entry (length, trailer) and its checksum; the
    /// value's header when every check passed (the caller checks what it says), `None`
    /// when one failed. On anything but `Ok(Some)` the parts may hold anything.
    fn read_slot_into(
        &self,
        slot: u64,
        header_len: usize,
        parts: &mut [&mut [u8]],
    ) -> Result<Option<Header>, IoKind> {
        let s = &self.shared;
        let offset = s.geo.data_offset(slot);
        let mut header = Header {
            bytes: [0; FIXED_HEADER + MAX_HASH_BYTES],
            len: header_len,
        };
        if !s.data.is_direct() {
            let mut trailer = [0u8; TRAILER];
            let mut sum = PieceSum::new();
            {
                let mut pieces: Vec<&mut [u8]> = Vec::with_capacity(parts.len() + 2);
                pieces.push(&mut header.bytes[..header_len]);
                pieces.extend(parts.iter_mut().map(|p| &mut **p));
                let body: usize = pieces.iter().map(|p| p.len()).sum();
                pieces.push(&mut trailer);
                // Summed piece by piece as the kernel's copies land, while in cache. A
                // piece lies within one part, so the trailer (the last part) comes as
                // pieces of its own, after `body` bytes, and is not summed.
                let mut seen = 0;
                s.data
                    .read_parts(&mut pieces, offset, &s.faults, SUM_GROUP, |piece| {
                        if seen < body {
                            sum.update(piece);
                        }
                        seen += piece.len();
                    })?;
            }
            let good = self.commits(slot, u64::from_le_bytes(trailer)) && sum.matches(trailer);
            return Ok(good.then_some(header));
        }
        let mut buf = self.buffer();
        let read = s.data.read(buf.as_mut_slice(), offset, &s.faults);
        let raw = &buf.as_slice()[..s.geo.value_len as usize];
        // `O_DIRECT` leaves the bytes in memory, not in cache: summed in the copy out of
        // the aligned buffer, not in a pass of their own.
        let good = read.is_ok()
            && self.committed(slot, raw)
            && copy_verified_scatter(raw, header_len, parts);
        if good {
            header.bytes[..header_len].copy_from_slice(&raw[..header_len]);
        }
        self.give_back(buf);
        read.map(|()| good.then_some(header))
    }
}
