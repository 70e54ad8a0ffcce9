//! One slot's I/O for [`DiskStore`]: reading a block's payload into the caller's slices
//! and checking it against its entry, writing a payload and then its entry, erasing an
//! entry, the reused aligned I/O buffers, and a batch's I/Os spread over the store's
//! threads.
//!
//! A slot holds only the payload, on page boundaries, so with `O_DIRECT` a block whose
//! slices are aligned as the kernel asks (`aligned::DioAlign`) and at least a page each
//! (`MIN_DIRECT_SLICE` says why) moves straight between the slot and its slices
//! (`preadv`/`pwritev`; a last part that is not a whole alignment unit goes through a
//! small aligned scratch), counted (`direct_reads`, `direct_writes`). Other slices go
//! through a slot-sized aligned buffer and a copy (`bounced_reads`, `bounced_writes`).
//! With the page cache the kernel copies between the cache and the slices anyway.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use super::aligned::{AlignedBuf, DioAlign};
use super::error::IoKind;
use super::file;
use super::index::Location;
use super::layout::{Entry, PayloadSum, ALIGN, ENTRY_BYTES};
use super::recovery::read_entry;
use super::source::Block;
use super::stats::DiskStats;
use super::store::{DiskStore, Placed};
use crate::tier::value::VERIFY_PIECE;

/// Bytes read from (or written to) the page cache per `preadv` (`pwritev`), summed while
/// they are in the core's cache (a 2 MiB block summed apart from one `preadv` of all of
/// it is read from memory a second time).
const SUM_GROUP: usize = 256 << 10;

/// Fewest bytes of a slice (but the last) that a direct transfer takes as it is. Smaller
/// ones go through the bounce buffer: measured on a virtio disk (ext4, the kernel asking
/// 512-byte alignment), 64 KiB blocks read directly into 32 slices of 2 KiB ran at about
/// 0.55x of a raw read, bounced through one contiguous page-aligned buffer at about 0.75x
/// (`benches/disk.rs`); each sub-page segment costs the device more than the copy saves.
const MIN_DIRECT_SLICE: usize = ALIGN as usize;

/// How a payload's parts split for a direct transfer: the whole parts before the last,
/// then `head` bytes of the last, then its `tail` bytes (less than one alignment unit)
/// through a scratch buffer.
struct DirectSplit {
    head: usize,
    tail: usize,
}

/// The split of `parts` (their addresses and lengths) for a direct transfer under
/// `align`, `None` when one of them is not aligned as it asks or a slice before the last
/// is smaller than [`MIN_DIRECT_SLICE`].
fn direct_split(parts: &[(*const u8, usize)], align: DioAlign) -> Option<DirectSplit> {
    let ((last_ptr, last_len), init) = parts.split_last()?;
    let whole = |&(p, n): &(*const u8, usize)| n >= MIN_DIRECT_SLICE && align.takes(p, n);
    if !align.fits_pages() || !init.iter().all(whole) {
        return None;
    }
    let tail = last_len % align.offset;
    let head = last_len - tail;
    // An empty head needs no address; a tail-only last part goes all through scratch.
    (head == 0 || align.takes(*last_ptr, head)).then_some(DirectSplit { head, tail })
}

/// Whether a direct transfer takes every one of `parts` as it is, the last one too (no
/// tail through scratch): then blocks in consecutive slots move as one I/O.
pub(super) fn whole_direct(parts: &[(*const u8, usize)], align: DioAlign) -> bool {
    matches!(
        direct_split(parts, align),
        Some(DirectSplit { tail: 0, .. })
    )
}

/// The addresses and lengths of `parts`.
pub(super) fn shape<P: AsRef<[u8]>>(parts: &[P]) -> Vec<(*const u8, usize)> {
    parts
        .iter()
        .map(|p| (p.as_ref().as_ptr(), p.as_ref().len()))
        .collect()
}

/// Copies `payload` into the start of `buf` (a slot-sized bounce buffer), summing each
/// piece into `sum` while it is in cache, and zeroes the rest: a reused buffer holds
/// another block's tail, and nothing of it may reach the disk.
pub(super) fn fill_summed(buf: &mut [u8], payload: &[&[u8]], sum: &mut PayloadSum) {
    let mut at = 0;
    for p in payload {
        for piece in p.chunks(VERIFY_PIECE) {
            buf[at..at + piece.len()].copy_from_slice(piece);
            sum.update(piece);
            at += piece.len();
        }
    }
    buf[at..].fill(0);
}

/// Copies `from` over `parts` in order (the caller checked the lengths agree), summing
/// each piece into `sum` while it is in cache.
pub(super) fn copy_summed(mut from: &[u8], parts: &mut [&mut [u8]], sum: &mut PayloadSum) {
    for part in parts.iter_mut() {
        let (src, rest) = from.split_at(part.len());
        from = rest;
        for (s, d) in src.chunks(VERIFY_PIECE).zip(part.chunks_mut(VERIFY_PIECE)) {
            sum.update(s);
            d.copy_from_slice(s);
        }
    }
}

impl DiskStore {
    /// The entry at `at` if it names the block of `digest` in `at.slot` with a payload
    /// of this geometry's length; `None` for any other, torn or unreadable entry.
    pub(super) fn entry_for(&self, at: Location, digest: u128) -> Option<Entry> {
        let s = &self.shared;
        let mut raw = [0u8; ENTRY_BYTES];
        read_entry(&s.idx, &s.geo, at.entry, &mut raw).ok()?;
        Entry::decode(&raw).filter(|e| {
            e.digest == digest && e.slot == at.slot && e.payload_len == s.geo.block_bytes
        })
    }

    /// Reads the block of `digest` at `at` into `parts` (exactly the payload's length)
    /// and checks it against its entry: the entry's when every check passed, `None` when
    /// one failed (a miss). The checksum runs here, on the I/O threads, so a batch's
    /// blocks are verified in parallel. On anything but `Ok(Some)` the parts may hold
    /// anything.
    pub(super) fn read_slot_into(
        &self,
        at: Location,
        digest: u128,
        parts: &mut [&mut [u8]],
    ) -> Result<Option<Entry>, IoKind> {
        let s = &self.shared;
        let Some(entry) = self.entry_for(at, digest) else {
            return Ok(None);
        };
        let offset = s.geo.data_offset(at.slot);
        let mut sum = PayloadSum::new(digest);
        if !s.data.is_direct() {
            // Summed piece by piece as the kernel's copies land, while in cache.
            s.data
                .read_parts(parts, offset, &s.faults, SUM_GROUP, |p| sum.update(p))?;
        } else {
            match direct_split(&shape(parts), s.data.align()) {
                Some(split) => {
                    self.read_direct(offset, parts, &split)?;
                    sum.update_all(parts);
                }
                None => self.read_bounced(offset, parts, &mut sum)?,
            }
        }
        Ok((sum.finish() == entry.payload_sum).then_some(entry))
    }

    /// One `preadv` straight into `parts` (split as `split` says).
    fn read_direct(
        &self,
        offset: u64,
        parts: &mut [&mut [u8]],
        split: &DirectSplit,
    ) -> Result<(), IoKind> {
        let s = &self.shared;
        let Some((last, init)) = parts.split_last_mut() else {
            return Ok(());
        };
        let (head, tail) = last.split_at_mut(split.head);
        let mut scratch = (split.tail > 0).then(|| AlignedBuf::new(s.data.align().offset));
        {
            let mut pieces: Vec<&mut [u8]> = init.iter_mut().map(|p| &mut **p).collect();
            pieces.push(head);
            if let Some(b) = &mut scratch {
                pieces.push(&mut b.as_mut_slice()[..s.data.align().offset]);
            }
            s.data
                .read_parts(&mut pieces, offset, &s.faults, usize::MAX, |_| {})?;
        }
        if let Some(b) = &scratch {
            tail.copy_from_slice(&b.as_slice()[..split.tail]);
        }
        DiskStats::add(&s.stats.direct_reads, 1);
        Ok(())
    }

    /// The slot read into an aligned buffer, then copied into `parts`, summed in that
    /// copy.
    fn read_bounced(
        &self,
        offset: u64,
        parts: &mut [&mut [u8]],
        sum: &mut PayloadSum,
    ) -> Result<(), IoKind> {
        let s = &self.shared;
        let mut buf = self.buffer();
        let read = s.data.read(buf.as_mut_slice(), offset, &s.faults);
        if read.is_ok() {
            copy_summed(&buf.as_slice()[..s.geo.block_bytes as usize], parts, sum);
            DiskStats::add(&s.stats.bounced_reads, 1);
        }
        self.give_back(buf);
        read
    }

    pub(super) fn buffer(&self) -> AlignedBuf {
        let pooled = self
            .shared
            .buffers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        pooled.unwrap_or_else(|| AlignedBuf::new(self.shared.geo.slot_bytes as usize))
    }

    pub(super) fn give_back(&self, buf: AlignedBuf) {
        let mut pool = self
            .shared
            .buffers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Every I/O thread may bounce a whole run at once (`runs.rs`); twice the threads
        // at least.
        let keep = self.shared.io_threads * self.run_blocks(usize::MAX).max(2);
        if pool.len() < keep {
            pool.push(buf);
        }
    }

    /// Writes `block`'s payload into its slot and then its entry (see `layout`):
    /// straight from its slices where it can, else through a reused aligned buffer.
    pub(super) fn write_slot(&self, at: &Placed, block: &Block<'_>) -> Result<(), IoKind> {
        let s = &self.shared;
        let geo = &s.geo;
        let digest = at.digest;
        let offset = geo.data_offset(at.slot);
        let mut sum = PayloadSum::new(digest);
        if !s.data.is_direct() {
            // Summed a group at a time just before the kernel copies it into the cache.
            s.data
                .write_parts(&block.payload, offset, &s.faults, SUM_GROUP, |p| {
                    sum.update(p)
                })?;
        } else {
            match direct_split(&shape(&block.payload), s.data.align()) {
                Some(split) => {
                    sum.update_all(&block.payload);
                    self.write_direct(offset, &block.payload, &split)?;
                }
                None => self.write_bounced(offset, &block.payload, &mut sum)?,
            }
        }
        self.write_entry(at, sum.finish(), block.hash)
    }

    /// Writes the entry of a block whose payload (summing to `payload_sum`) is in its
    /// slot: it goes after the data, as it commits the slot (see `layout`).
    pub(super) fn write_entry(
        &self,
        at: &Placed,
        payload_sum: u64,
        hash: &[u8],
    ) -> Result<(), IoKind> {
        use std::os::unix::fs::FileExt;
        let s = &self.shared;
        let entry = Entry::new(
            at.digest,
            at.slot,
            s.geo.block_bytes,
            s.seq.fetch_add(1, Ordering::Relaxed) + 1,
            payload_sum,
            hash,
        );
        s.idx
            .write_all_at(&entry.encode(), s.geo.entry_offset(at.entry))
            .map_err(|e| file::classify(&e))
    }

    /// One `pwritev` straight from `payload` (split as `split` says), the last part's
    /// tail through a zeroed scratch (so no stale bytes reach the disk).
    fn write_direct(
        &self,
        offset: u64,
        payload: &[&[u8]],
        split: &DirectSplit,
    ) -> Result<(), IoKind> {
        let s = &self.shared;
        let Some((last, init)) = payload.split_last() else {
            return Ok(());
        };
        let (head, tail) = last.split_at(split.head);
        let unit = s.data.align().offset;
        let scratch = (split.tail > 0).then(|| {
            let mut b = AlignedBuf::new(unit);
            b.as_mut_slice()[..tail.len()].copy_from_slice(tail);
            b
        });
        let mut pieces: Vec<&[u8]> = init.to_vec();
        pieces.push(head);
        if let Some(b) = &scratch {
            pieces.push(&b.as_slice()[..unit]);
        }
        s.data
            .write_parts(&pieces, offset, &s.faults, usize::MAX, |_| {})?;
        DiskStats::add(&s.stats.direct_writes, 1);
        Ok(())
    }

    /// The payload copied (and summed) into an aligned buffer, the padding zeroed, and
    /// the whole slot written.
    fn write_bounced(
        &self,
        offset: u64,
        payload: &[&[u8]],
        sum: &mut PayloadSum,
    ) -> Result<(), IoKind> {
        let s = &self.shared;
        let mut buf = self.buffer();
        fill_summed(buf.as_mut_slice(), payload, sum);
        let written = s.data.write(buf.as_slice(), offset, &s.faults);
        self.give_back(buf);
        written?;
        DiskStats::add(&s.stats.bounced_writes, 1);
        Ok(())
    }

    /// Erases entry `entry` on disk, so neither the scheduler's probe nor a restart
    /// finds its block again. Best effort: an entry left behind fails a read's checks.
    pub(super) fn clear_entry(&self, entry: u64) {
        use std::os::unix::fs::FileExt;
        let s = &self.shared;
        let _ = s
            .idx
            .write_all_at(&[0u8; ENTRY_BYTES], s.geo.entry_offset(entry));
    }

    /// Runs `work` on every item on the store's I/O threads (see [`IoPool::run`](super::io_pool::IoPool::run)), the
    /// results in the items' order.
    pub(super) fn parallel<T: Sync, R: Send>(
        &self,
        items: &[T],
        work: impl Fn(&T) -> R + Sync,
    ) -> Vec<R> {
        self.shared.io.run(items, work)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::super::layout::{key_digest, Entry, ENTRY_BYTES};
    use super::super::{DiskOptions, DiskStore};
    use crate::tier::{KeySpace, LayoutFingerprint, RemoteStore, ValueParts};

    const FP: LayoutFingerprint = LayoutFingerprint(0xb1d);

    #[test]
    fn another_blocks_bytes_under_a_valid_entry_for_this_key_are_a_miss() {
        // One set of four slots, persisted: block A is written, then its entry is made to
        // name key B (re-summed, so it is a valid entry) and the store reopened. B's
        // lookup finds a slot holding A's intact bytes under an entry that carries their
        // checksum: only the checksum's binding to the key tells them apart.
        let dir = std::env::temp_dir().join(format!("kvoffload-bind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let block = 5000usize;
        let mut o = DiskOptions::new(
            dir.join("kv.rank_0"),
            4096 + 4 * (8192 + 128),
            block as u64,
            FP,
        );
        o.persist = true;
        o.use_page_cache = true;
        let keys = KeySpace::new("t", FP).unwrap();
        let (a, b) = (keys.key(&[1; 16]).unwrap(), keys.key(&[2; 16]).unwrap());
        let bytes: Vec<u8> = (0..block).map(|i| (i * 13) as u8).collect();
        {
            let mut store = DiskStore::open(&o).unwrap();
            let parts = ValueParts::new(FP, &[1; 16], vec![&bytes[..]]);
            assert!(store.put_parts(&[(a.clone(), parts)])[0].is_ok());
            let at = store.entry_offset_of(&a).unwrap();
            let idx = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(store.index_path())
                .unwrap();
            let mut raw = [0u8; ENTRY_BYTES];
            idx.read_exact_at(&mut raw, at).unwrap();
            let e = Entry::decode(&raw).unwrap();
            let moved = Entry::new(
                key_digest(b.as_str().as_bytes()),
                e.slot,
                e.payload_len,
                e.seq,
                e.payload_sum,
                &[2; 16],
            );
            idx.write_all_at(&moved.encode(), at).unwrap();
        }
        let mut store = DiskStore::open(&o).unwrap();
        assert_eq!(store.snapshot().recovered_blocks, 1, "the entry is valid");
        assert_eq!(store.get(std::slice::from_ref(&b))[0], Ok(None));
        assert_eq!(store.snapshot().checksum_failures, 1);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
