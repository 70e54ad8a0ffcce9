//! The owner's in-memory index: where each block's slot is, and the slot's state, so a
//! block being written is never read and a block being read is never overwritten.
//!
//! Two arrays, one entry per slot, grouped in sets as the files are (`layout`):
//! `tags` holds 16 bits of a readable block's digest (0: nothing readable), one set's 64
//! tags in one aligned 128-byte line pair, so a lookup compares them with a few vector
//! instructions and reads the full record only on a tag match (a miss finds a false tag
//! match once in a thousand lookups); `records` holds the full digest, the slot's recency
//! and state. 34 bytes a slot in all ([`SlotIndex::bytes_per_slot`]).

use super::layout::{Geometry, MAX_WAYS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Empty,
    Valid,
    Writing,
}

/// One slot. `readers` counts reads in flight; such a slot is not a victim. The digest
/// is two halves, not a `u128`, so the record is 8-byte aligned and 32 bytes, not 48.
#[derive(Debug, Clone, Copy)]
struct Record {
    digest: [u64; 2],
    tick: u64,
    readers: u16,
    state: State,
}

const EMPTY: Record = Record {
    digest: [0; 2],
    tick: 0,
    readers: 0,
    state: State::Empty,
};

fn halves(digest: u128) -> [u64; 2] {
    [digest as u64, (digest >> 64) as u64]
}

/// The tag of a readable block: never 0, which marks a slot with nothing readable. Bits
/// of the low half, as the set is chosen by the high half (`Geometry::set_start`).
fn tag_of(digest: u128) -> u16 {
    (digest as u16).max(1)
}

/// One set's tags, aligned so a set is one 128-byte line pair (the pair the hardware
/// fetches together).
#[derive(Debug, Clone, Copy)]
#[repr(align(128))]
struct TagSet([u16; MAX_WAYS as usize]);

/// How many keys ahead a batched lookup prefetches a key's tag set, and then its record,
/// so their cache misses overlap instead of following each other.
const LOOKAHEAD: usize = 32;

/// Asks the CPU to bring `item`'s cache lines (at most two: a [`TagSet`] or a record)
/// into L1 without waiting for them.
#[inline(always)]
fn prefetch<T>(item: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = (item as *const T).cast::<i8>();
        // SAFETY: a prefetch is a hint that never faults or changes memory; both
        // addresses lie inside `item` (`size_of::<T>() > 64` for the second), which the
        // reference keeps alive.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p);
            if std::mem::size_of::<T>() > 64 {
                _mm_prefetch::<_MM_HINT_T0>(p.add(64));
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = item;
}

/// `n` copies of `item`, the memory backed by huge pages where the kernel allows it
/// (`MADV_HUGEPAGE`): a lookup lands on a random set of a large index, and with 4 KiB
/// pages nearly every one also misses the TLB.
fn huge_vec<T: Copy>(n: usize, item: T) -> Vec<T> {
    const HUGE: usize = 2 << 20;
    let mut v = Vec::with_capacity(n);
    let bytes = n * std::mem::size_of::<T>();
    if bytes >= 2 * HUGE {
        let start = (v.as_mut_ptr() as usize).next_multiple_of(HUGE);
        let end = (v.as_mut_ptr() as usize + bytes) / HUGE * HUGE;
        // SAFETY: [start, end) lies inside the vector's allocation, which this function
        // owns; the advice changes how the kernel backs the pages, never their contents,
        // and its failure (no huge pages) leaves ordinary pages.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    // Filled after the advice, so the first touch of each page already gets a huge one.
    v.resize(n, item);
    v
}

/// Where a put goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Placement {
    /// The block is there already (same key, same bytes): nothing to write.
    Present,
    /// Write into this slot; `evicted` says whether a block had to go.
    Write {
        /// The slot to write.
        slot: u64,
        /// Whether a block was evicted from it.
        evicted: bool,
    },
    /// Every slot of the set is busy: skip.
    Busy,
}

/// Slots of a file's geometry, looked up by key digest within the digest's set. Public for
/// its benchmark (`benches/disk.rs`); a [`DiskStore`](super::DiskStore) owns one.
#[derive(Debug)]
pub struct SlotIndex {
    geo: Geometry,
    tags: Vec<TagSet>,
    records: Vec<Record>,
    clock: u64,
    resident: u64,
}

impl SlotIndex {
    pub(crate) fn new(geo: Geometry) -> Self {
        Self {
            geo,
            tags: huge_vec(geo.sets() as usize, TagSet([0; MAX_WAYS as usize])),
            records: huge_vec(geo.slots as usize, EMPTY),
            clock: 0,
            resident: 0,
        }
    }

    /// An index of `slots` slots in sets of 64, as a disk tier of that many blocks has
    /// (for the benchmark: no files behind it). `None` for fewer than 64 slots.
    pub fn with_slots(slots: u64) -> Option<Self> {
        Geometry::fit(
            super::layout::IDX_HEADER
                + slots * (super::layout::ALIGN + super::layout::ENTRY_BYTES as u64),
            super::layout::ALIGN,
            0,
        )
        .filter(|g| g.ways == MAX_WAYS)
        .map(Self::new)
    }

    /// Slots the index describes.
    pub fn slots(&self) -> u64 {
        self.geo.slots
    }

    /// Host bytes the index holds per slot: every array's allocated capacity.
    pub fn bytes_per_slot(&self) -> f64 {
        let bytes = self.tags.capacity() * std::mem::size_of::<TagSet>()
            + self.records.capacity() * std::mem::size_of::<Record>();
        bytes as f64 / self.geo.slots.max(1) as f64
    }

    /// Blocks readable now.
    pub fn resident(&self) -> u64 {
        self.resident
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn set(&self, digest: u128) -> std::ops::Range<usize> {
        let start = self.geo.set_start(digest) as usize;
        start..start + self.geo.ways as usize
    }

    /// Slot `slot`'s tag.
    fn tag_mut(&mut self, slot: usize) -> &mut u16 {
        let ways = self.geo.ways as usize;
        &mut self.tags[slot / ways].0[slot % ways]
    }

    /// Which of set `set`'s ways hold `tag`, as a bit mask.
    #[cfg(target_arch = "x86_64")]
    fn matches(&self, set: usize, tag: u16) -> u64 {
        use core::arch::x86_64::{
            __m128i, _mm_cmpeq_epi16, _mm_loadu_si128, _mm_movemask_epi8, _mm_packs_epi16,
            _mm_set1_epi16,
        };
        let tags = &self.tags[set].0;
        let mut mask = 0u64;
        // SAFETY: SSE2 is part of x86_64, so these intrinsics are always available; each
        // load reads 16 bytes at `tags[16 * k + 8 * h]`, k < 4 and h < 2, inside the
        // 64-tag (128-byte) array `tags` borrows, and an unaligned load has no alignment
        // requirement.
        unsafe {
            let want = _mm_set1_epi16(tag as i16);
            for k in 0..4 {
                let p = tags.as_ptr().add(16 * k) as *const __m128i;
                let lo = _mm_cmpeq_epi16(_mm_loadu_si128(p), want);
                let hi = _mm_cmpeq_epi16(_mm_loadu_si128(p.add(1)), want);
                // Each 16-bit all-ones/zero lane saturates to one 0xFF/0 byte, in order.
                let bits = _mm_movemask_epi8(_mm_packs_epi16(lo, hi)) as u32 as u64;
                mask |= bits << (16 * k);
            }
        }
        mask
    }

    /// Which of set `set`'s ways hold `tag`, as a bit mask.
    #[cfg(not(target_arch = "x86_64"))]
    fn matches(&self, set: usize, tag: u16) -> u64 {
        // Eight tags at a time into a byte of the mask: a shape the compiler turns into a
        // vector compare and a byte mask, where one bit a tag in a 64-step loop is not.
        let mut mask = 0u64;
        for (k, eight) in self.tags[set].0.chunks_exact(8).enumerate() {
            let mut m = 0u8;
            for (j, &t) in eight.iter().enumerate() {
                m |= u8::from(t == tag) << j;
            }
            mask |= u64::from(m) << (8 * k);
        }
        mask
    }

    /// The first slot of `set` whose tag matched (`matches`) and whose record is `digest`.
    fn confirm(&self, set: usize, mut matches: u64, digest: u128) -> Option<u64> {
        let want = halves(digest);
        let first = set * self.geo.ways as usize;
        while matches != 0 {
            let i = first + matches.trailing_zeros() as usize;
            if self.records[i].digest == want {
                return Some(i as u64);
            }
            matches &= matches - 1;
        }
        None
    }

    fn set_of(&self, digest: u128) -> usize {
        self.geo.set_of(digest) as usize
    }

    /// The slot holding `digest`, if it is readable.
    pub fn find(&self, digest: u128) -> Option<u64> {
        let set = self.set_of(digest);
        self.confirm(set, self.matches(set, tag_of(digest)), digest)
    }

    /// [`Self::find`] of every digest, into `out`, as a pipeline over each 64 digests:
    /// a key's tag set is prefetched `LOOKAHEAD` keys before its tags are compared, and
    /// the record of its first tag match is prefetched `LOOKAHEAD` keys before it is
    /// confirmed, so a batch's cache misses overlap instead of following each other.
    pub fn find_many(&self, digests: &[u128], out: &mut Vec<Option<u64>>) {
        out.clear();
        out.reserve(digests.len());
        let ways = self.geo.ways as usize;
        let mut sets = [0usize; 64];
        let mut found = [0u64; 64];
        for chunk in digests.chunks(64) {
            let n = chunk.len();
            for (set, &d) in sets.iter_mut().zip(chunk) {
                *set = self.set_of(d);
            }
            for &set in &sets[..n.min(LOOKAHEAD)] {
                prefetch(&self.tags[set]);
            }
            for i in 0..n + LOOKAHEAD {
                if let Some(&set) = sets[..n].get(i + LOOKAHEAD) {
                    prefetch(&self.tags[set]);
                }
                if i < n {
                    let m = self.matches(sets[i], tag_of(chunk[i]));
                    found[i] = m;
                    if m != 0 {
                        prefetch(&self.records[sets[i] * ways + m.trailing_zeros() as usize]);
                    }
                }
                if let Some(j) = i.checked_sub(LOOKAHEAD) {
                    out.push(self.confirm(sets[j], found[j], chunk[j]));
                }
            }
        }
    }

    /// Marks a read of `digest` started: its slot, now protected from eviction and
    /// counted as recently used.
    pub(crate) fn begin_read(&mut self, digest: u128) -> Option<u64> {
        let slot = self.find(digest)?;
        let t = self.tick();
        let r = &mut self.records[slot as usize];
        r.readers += 1;
        r.tick = t;
        Some(slot)
    }

    pub(crate) fn end_read(&mut self, slot: u64) {
        let r = &mut self.records[slot as usize];
        r.readers = r.readers.saturating_sub(1);
    }

    /// Where to write `digest`; the slot is `Writing` until [`Self::finish_write`].
    pub fn place(&mut self, digest: u128) -> Placement {
        if let Some(slot) = self.find(digest) {
            let t = self.tick();
            self.records[slot as usize].tick = t;
            return Placement::Present;
        }
        let set = self.set(digest);
        let want = halves(digest);
        let records = &self.records;
        if set
            .clone()
            .any(|i| records[i].state == State::Writing && records[i].digest == want)
        {
            // Another batch writes the same block now.
            return Placement::Present;
        }
        let victim = set
            .clone()
            .find(|&i| records[i].state == State::Empty)
            .or_else(|| {
                set.filter(|&i| records[i].state == State::Valid && records[i].readers == 0)
                    .min_by_key(|&i| records[i].tick)
            });
        let Some(i) = victim else {
            return Placement::Busy;
        };
        let evicted = self.records[i].state == State::Valid;
        if evicted {
            self.resident -= 1;
        }
        let t = self.tick();
        *self.tag_mut(i) = 0;
        self.records[i] = Record {
            digest: want,
            tick: t,
            readers: 0,
            state: State::Writing,
        };
        Placement::Write {
            slot: i as u64,
            evicted,
        }
    }

    /// Ends a write: the slot holds its block when `ok`, nothing otherwise.
    pub fn finish_write(&mut self, slot: u64, ok: bool) {
        let i = slot as usize;
        let r = &mut self.records[i];
        if ok {
            r.state = State::Valid;
            let tag = tag_of(u128::from(r.digest[0]) | u128::from(r.digest[1]) << 64);
            self.resident += 1;
            *self.tag_mut(i) = tag;
        } else {
            *r = EMPTY;
        }
    }

    /// Forgets the block in `slot` (it failed a check).
    pub(crate) fn drop_slot(&mut self, slot: u64, digest: u128) {
        let i = slot as usize;
        let r = &mut self.records[i];
        if r.digest == halves(digest) && r.state == State::Valid {
            self.resident -= 1;
            *r = EMPTY;
            *self.tag_mut(i) = 0;
        }
    }

    /// Restores a block found at start; `seq` (its write order) becomes its recency.
    pub(crate) fn restore(&mut self, slot: u64, digest: u128, seq: u64) {
        let i = slot as usize;
        if self.records[i].state != State::Valid {
            self.resident += 1;
        }
        self.records[i] = Record {
            digest: halves(digest),
            tick: seq,
            readers: 0,
            state: State::Valid,
        };
        *self.tag_mut(i) = tag_of(digest);
        self.clock = self.clock.max(seq);
    }

    /// The recency clock, persisted as the next write's sequence.
    pub(crate) fn clock(&self) -> u64 {
        self.clock
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use super::super::layout::ENTRY_BYTES;

    fn geo(slots: u64) -> Geometry {
        Geometry::fit(4096 + slots * (4096 + ENTRY_BYTES as u64), 4000, 1).unwrap()
    }

    #[test]
    fn lru_within_a_set_and_busy_slots_are_kept() {
        let mut ix = SlotIndex::new(geo(4));
        for d in 1..=4u128 {
            let Placement::Write { slot, evicted } = ix.place(d) else {
                panic!()
            };
            assert!(!evicted);
            ix.finish_write(slot, true);
        }
        assert_eq!(ix.resident(), 4);
        // Read 1: 2 is now the least recently used.
        let s1 = ix.begin_read(1).unwrap();
        ix.end_read(s1);
        let s2 = ix.find(2).unwrap();
        assert_eq!(
            ix.place(5),
            Placement::Write {
                slot: s2,
                evicted: true
            }
        );
        assert_eq!(ix.find(2), None);
        assert_eq!(ix.find(5), None, "not readable while written");
        ix.finish_write(s2, true);
        assert!(ix.find(5).is_some());
        assert_eq!(ix.place(5), Placement::Present);
        // Hold every slot with a reader: nothing can be evicted.
        let held: Vec<u64> = [1u128, 3, 4, 5]
            .iter()
            .map(|&d| ix.begin_read(d).unwrap())
            .collect();
        assert_eq!(ix.place(6), Placement::Busy);
        for s in held {
            ix.end_read(s);
        }
        assert_eq!(ix.resident(), 4);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tag_tests {
    use super::*;

    #[test]
    fn a_tag_match_with_another_digest_is_not_a_hit() {
        let mut ix = SlotIndex::with_slots(128).unwrap();
        assert_eq!(ix.bytes_per_slot(), 34.0);
        assert_eq!(ix.slots(), 128);
        // Same set (high half), same tag (low 16 bits), another digest.
        let a = 5u128 << 64 | 0x1234_0007;
        let b = 5u128 << 64 | 0x9999_0007;
        let Placement::Write { slot, .. } = ix.place(a) else {
            panic!()
        };
        ix.finish_write(slot, true);
        assert_eq!(ix.find(a), Some(slot));
        assert_eq!(ix.find(b), None);
        let mut found = Vec::new();
        ix.find_many(&[b, a, b, a], &mut found);
        assert_eq!(found, [None, Some(slot), None, Some(slot)]);
        ix.drop_slot(slot, a);
        assert_eq!(ix.find(a), None, "a dropped block's tag is cleared");
        assert_eq!(ix.resident(), 0);
    }

    #[test]
    fn find_many_agrees_with_find_on_hits_misses_and_tag_collisions() {
        let mut ix = SlotIndex::with_slots(64 * 16).unwrap();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut keys = Vec::new();
        for _ in 0..600 {
            let d = u128::from(next()) << 64 | u128::from(next());
            if let Placement::Write { slot, .. } = ix.place(d) {
                ix.finish_write(slot, true);
            }
            // A miss in the same set with the same tag, and a plain miss.
            keys.extend([
                d,
                d ^ 0x1_0000,
                u128::from(next()) << 64 | u128::from(next()),
            ]);
        }
        let want: Vec<_> = keys.iter().map(|&d| ix.find(d)).collect();
        assert!(want.iter().filter(|s| s.is_some()).count() > 500);
        let mut got = Vec::new();
        // Batches shorter than the lookahead, of one chunk, and of several plus a tail.
        for len in [1, 5, 64, 200, keys.len()] {
            ix.find_many(&keys[..len], &mut got);
            assert_eq!(got, want[..len]);
        }
    }
}
