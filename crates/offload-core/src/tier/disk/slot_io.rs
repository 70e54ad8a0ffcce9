//! One slot's I/O for [`DiskStore`]: reading and checking a block, writing it and its
//! entry, erasing an entry, the reused aligned I/O buffers, and a batch's I/Os spread
//! over the store's threads.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use super::error::IoKind;
use super::file::{self, AlignedBuf};
use super::layout::{Entry, ENTRY_BYTES};
use super::recovery::read_entry;
use super::source::Source;
use super::store::DiskStore;
use crate::tier::value::{checksum_ok, copy_verified};

impl DiskStore {
    /// Reads one slot and checks its bytes against the entry's commitment (length and the
    /// value's trailer) and the value's checksum; the header is the caller's
    /// (`value::decode_verified`). The checksum runs here, on the I/O threads, so a batch's
    /// blocks are verified in parallel and a bad one frees its slot (`verifies_checksums`).
    pub(super) fn read_slot(&self, slot: u64) -> Result<Option<Vec<u8>>, IoKind> {
        let s = &self.shared;
        let geo = &s.geo;
        let offset = geo.data_offset(slot);
        let len = geo.value_len as usize;
        if !s.data.is_direct() {
            // Buffered I/O needs no aligned buffer: the kernel copies from the page cache
            // straight into the value handed out, and the checksum reads bytes that copy
            // just left in the cache.
            let mut value = vec![0u8; len];
            let read = s.data.read(&mut value, offset, &s.faults);
            let good = read.is_ok() && self.committed(slot, &value) && checksum_ok(&value);
            return read.map(|()| good.then_some(value));
        }
        let mut buf = self.buffer();
        let read = s.data.read(buf.as_mut_slice(), offset, &s.faults);
        let raw = &buf.as_slice()[..len];
        // `O_DIRECT` leaves the bytes in memory, not in cache: summed in the copy out of
        // the aligned buffer, not in a pass of their own.
        let committed = read.is_ok() && self.committed(slot, raw);
        let value = if committed { copy_verified(raw) } else { None };
        self.give_back(buf);
        read.map(|()| value)
    }

    /// Whether slot `slot`'s entry commits to `value` (its length and trailer).
    pub(super) fn committed(&self, slot: u64, value: &[u8]) -> bool {
        let trailer = value
            .get(value.len().saturating_sub(8)..)
            .and_then(|t| <[u8; 8]>::try_from(t).ok())
            .map(u64::from_le_bytes);
        trailer.is_some_and(|t| self.commits(slot, t))
    }

    /// Whether slot `slot`'s entry commits to a value of the slot's length with this
    /// trailer.
    pub(super) fn commits(&self, slot: u64, trailer: u64) -> bool {
        let s = &self.shared;
        let geo = &s.geo;
        let mut raw = [0u8; ENTRY_BYTES];
        let entry = match read_entry(&s.idx, geo, slot, &mut raw) {
            Ok(()) => Entry::decode(&raw),
            Err(_) => None,
        };
        entry.is_some_and(|e| e.value_len == geo.value_len && e.value_sum == trailer)
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
        if pool.len() < 2 * self.shared.io_threads {
            pool.push(buf);
        }
    }

    /// Writes `value` into slot `slot` and then its entry. The value is encoded (or
    /// copied) straight into a reused aligned buffer: no allocation per write.
    pub(super) fn write_slot(
        &self,
        slot: u64,
        digest: u128,
        value: &Source<'_>,
    ) -> Result<(), IoKind> {
        let s = &self.shared;
        let geo = &s.geo;
        let mut buf = self.buffer();
        let b = buf.as_mut_slice();
        let len = value.len();
        // The batch checked the length against the slot's, so it fits.
        let Some(trailer) = value.fill(b) else {
            self.give_back(buf);
            return Err(IoKind::Other);
        };
        // A reused buffer holds another block's tail: the padding is zeroed so nothing
        // of it reaches the disk.
        b[len..].fill(0);
        let written = s
            .data
            .write(buf.as_slice(), geo.data_offset(slot), &s.faults);
        self.give_back(buf);
        written?;
        let entry = Entry {
            digest,
            value_len: len as u64,
            seq: s.seq.fetch_add(1, Ordering::Relaxed) + 1,
            value_sum: trailer,
        };
        use std::os::unix::fs::FileExt;
        // The entry goes after the data: it commits the slot (see `layout`).
        s.idx
            .write_all_at(&entry.encode(), geo.entry_offset(slot))
            .map_err(|e| file::classify(&e))
    }

    /// Erases `slot`'s entry on disk, so a restart does not find the bad block again.
    /// Best effort: an entry left behind fails the same check again.
    pub(super) fn clear_entry(&self, slot: u64) {
        use std::os::unix::fs::FileExt;
        let s = &self.shared;
        let _ = s
            .idx
            .write_all_at(&[0u8; ENTRY_BYTES], s.geo.entry_offset(slot));
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
