//! The owner's in-memory index: which entry holds each block, where its slot is, and the
//! state of both, so a block being written is never read and a block being read is never
//! overwritten.
//!
//! Entries are grouped in sets as the index file's are (`layout`): `tags` holds 16 bits
//! of a readable block's digest (0: nothing readable), one set's 64 tags in one aligned
//! 128-byte line pair, so a lookup compares them with a few vector instructions and reads
//! the full digest only on a tag match (a miss finds a false tag match once in a thousand
//! lookups); `digests` holds the full digests, apart from `records` (the block's slot,
//! recency and state), so what a lookup reads, tags and digests, is half the index and
//! more of it stays in the last-level cache; `owners` says which entry each slot's block
//! belongs to.
//!
//! # Where a block goes
//! Slots are handed out by a clock hand that sweeps the data file in order, so the
//! blocks of a batch (a prompt's, stored together) land in consecutive slots and are
//! read back in large I/Os. The hand passes over a slot whose block is being written or
//! read, or was read since the hand last passed (and loses that mark): CLOCK, the usual
//! approximation of LRU that keeps a store's blocks together where exact LRU would
//! scatter them over the holes its evictions leave. A key's entry is taken in its set:
//! an empty one, else the set's least recently used block goes too (rare: there are
//! half again as many entries as slots, `layout::ENTRIES_PER_SLOT`).
//!
//! Per block of capacity: 1.5 entries of 34 bytes (tag, digest and record) and a 4-byte
//! owner, 55 bytes in all ([`SlotIndex::bytes_per_slot`]).
//!
//! # Invariants ([`SlotIndex::check_invariants`])
//! - A slot's owner names an entry that is `Valid` or `Writing` and names that slot
//!   back; every such entry is its slot's owner.
//! - A set's tag is non-zero exactly where its entry is `Valid`, and is that digest's;
//!   an empty entry's digest is zero.
//! - `resident` counts the `Valid` entries.

use super::layout::{Geometry, MAX_WAYS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Empty,
    Valid,
    Writing,
}

/// One entry but its digest. `readers` counts reads in flight; such a block is not a
/// victim. `referenced`: read (or stored again) since the clock hand last passed its slot.
#[derive(Debug, Clone, Copy)]
struct Record {
    tick: u64,
    slot: u32,
    readers: u16,
    state: State,
    referenced: bool,
}

const EMPTY: Record = Record {
    tick: 0,
    slot: 0,
    readers: 0,
    state: State::Empty,
    referenced: false,
};

/// A digest as an entry keeps it: two halves, not a `u128`, so an entry's digest is
/// 8-byte aligned and 16 bytes, four to a cache line.
type Halves = [u64; 2];

fn halves(digest: u128) -> Halves {
    [digest as u64, (digest >> 64) as u64]
}

fn whole(halves: Halves) -> u128 {
    u128::from(halves[0]) | u128::from(halves[1]) << 64
}

/// The tag of a readable block: never 0, which marks an entry with nothing readable.
/// Bits of the low half, as the set is chosen by the high half (`Geometry::set_start`).
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
    /// Write the payload into `slot`, then the entry `entry` (blocks that had to go are
    /// in the list [`SlotIndex::place`] was given).
    Write {
        /// The entry that will describe the block.
        entry: u64,
        /// The slot that will hold its payload.
        slot: u64,
    },
    /// No slot or no entry of the key's set is free of reads and writes: skip.
    Busy,
}

/// Where a block being read is: its entry and its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Location {
    pub entry: u64,
    pub slot: u64,
}

/// Blocks of a file's geometry, looked up by key digest within the digest's set, their
/// slots handed out by a clock hand. Public for its benchmark (`benches/disk.rs`); a
/// [`DiskStore`](super::DiskStore) owns one.
#[derive(Debug)]
pub struct SlotIndex {
    geo: Geometry,
    tags: Vec<TagSet>,
    /// Per entry: its block's digest (0 when empty).
    digests: Vec<Halves>,
    records: Vec<Record>,
    /// Per slot: 1 + the entry whose block it holds (or is written with), 0 when free.
    owners: Vec<u32>,
    hand: u64,
    clock: u64,
    resident: u64,
}

impl SlotIndex {
    pub(crate) fn new(geo: Geometry) -> Self {
        Self {
            geo,
            tags: huge_vec(geo.sets() as usize, TagSet([0; MAX_WAYS as usize])),
            digests: huge_vec(geo.entries as usize, [0; 2]),
            records: huge_vec(geo.entries as usize, EMPTY),
            owners: huge_vec(geo.slots as usize, 0),
            hand: 0,
            clock: 0,
            resident: 0,
        }
    }

    /// An index of about `slots` slots with entries in sets of 64, as a disk tier of
    /// that many blocks has (for the benchmark: no files behind it). `None` for fewer
    /// than 43 slots (one set's worth).
    pub fn with_slots(slots: u64) -> Option<Self> {
        let block = super::layout::ALIGN;
        Geometry::fit(Geometry::capacity_for(slots, block)?, block, 0)
            .filter(|g| g.ways == MAX_WAYS)
            .map(Self::new)
    }

    /// Slots the index describes (blocks it can hold).
    pub fn slots(&self) -> u64 {
        self.geo.slots
    }

    /// Host bytes the index holds per slot: every array's allocated capacity.
    pub fn bytes_per_slot(&self) -> f64 {
        let bytes = self.tags.capacity() * std::mem::size_of::<TagSet>()
            + self.digests.capacity() * std::mem::size_of::<Halves>()
            + self.records.capacity() * std::mem::size_of::<Record>()
            + self.owners.capacity() * std::mem::size_of::<u32>();
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

    /// Entry `entry`'s tag.
    fn tag_mut(&mut self, entry: usize) -> &mut u16 {
        let ways = self.geo.ways as usize;
        &mut self.tags[entry / ways].0[entry % ways]
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

    /// The first entry of `set` whose tag matched (`matches`) and that holds `digest`.
    fn confirm(&self, set: usize, mut matches: u64, digest: u128) -> Option<u64> {
        let want = halves(digest);
        let first = set * self.geo.ways as usize;
        while matches != 0 {
            let i = first + matches.trailing_zeros() as usize;
            if self.digests[i] == want {
                return Some(i as u64);
            }
            matches &= matches - 1;
        }
        None
    }

    fn set_of(&self, digest: u128) -> usize {
        self.geo.set_of(digest) as usize
    }

    /// The entry of `digest`, if its block is readable.
    pub fn find(&self, digest: u128) -> Option<u64> {
        let set = self.set_of(digest);
        self.confirm(set, self.matches(set, tag_of(digest)), digest)
    }

    /// [`Self::find`] of every digest, into `out`, as a pipeline over each 64 digests:
    /// a key's tag set is prefetched `LOOKAHEAD` keys before its tags are compared, and
    /// the digest of its first tag match is prefetched `LOOKAHEAD` keys before it is
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
                        prefetch(&self.digests[sets[i] * ways + m.trailing_zeros() as usize]);
                    }
                }
                if let Some(j) = i.checked_sub(LOOKAHEAD) {
                    out.push(self.confirm(sets[j], found[j], chunk[j]));
                }
            }
        }
    }

    /// The slot of entry `entry`'s block.
    pub(crate) fn slot_of(&self, entry: u64) -> u64 {
        u64::from(self.records[entry as usize].slot)
    }

    /// Marks a read of `digest` started: where its block is, now protected from eviction
    /// and marked as used.
    pub(crate) fn begin_read(&mut self, digest: u128) -> Option<Location> {
        let entry = self.find(digest)?;
        let t = self.tick();
        let r = &mut self.records[entry as usize];
        r.readers += 1;
        r.tick = t;
        r.referenced = true;
        Some(Location {
            entry,
            slot: u64::from(r.slot),
        })
    }

    pub(crate) fn end_read(&mut self, entry: u64) {
        let r = &mut self.records[entry as usize];
        r.readers = r.readers.saturating_sub(1);
    }

    /// Takes entry `entry`'s block out: its entry empty, its slot free.
    fn evict(&mut self, entry: usize) {
        let r = self.records[entry];
        if r.state == State::Valid {
            self.resident -= 1;
        }
        if r.state != State::Empty {
            self.owners[r.slot as usize] = 0;
        }
        self.records[entry] = EMPTY;
        self.digests[entry] = [0; 2];
        *self.tag_mut(entry) = 0;
    }

    /// The next slot under the clock hand that is free or whose block may go (pushed
    /// on `evicted`); `None` when two sweeps find every slot busy.
    fn take_slot(&mut self, evicted: &mut Vec<u64>) -> Option<u32> {
        let n = self.geo.slots;
        for _ in 0..2 * n {
            let slot = self.hand;
            self.hand = if slot + 1 == n { 0 } else { slot + 1 };
            let owner = self.owners[slot as usize];
            if owner == 0 {
                return u32::try_from(slot).ok();
            }
            let entry = (owner - 1) as usize;
            let r = &mut self.records[entry];
            if r.state != State::Valid || r.readers > 0 {
                continue;
            }
            if r.referenced {
                r.referenced = false;
                continue;
            }
            self.evict(entry);
            evicted.push(entry as u64);
            return u32::try_from(slot).ok();
        }
        None
    }

    /// Where to write `digest`: a slot from the clock hand and an entry of its set; both
    /// are `Writing` until [`Self::finish_write`]. Blocks that had to go are pushed on
    /// `evicted` (their entries).
    pub fn place(&mut self, digest: u128, evicted: &mut Vec<u64>) -> Placement {
        if let Some(entry) = self.find(digest) {
            let t = self.tick();
            let r = &mut self.records[entry as usize];
            r.tick = t;
            r.referenced = true;
            return Placement::Present;
        }
        let set = self.set(digest);
        let want = halves(digest);
        if set
            .clone()
            .any(|i| self.records[i].state == State::Writing && self.digests[i] == want)
        {
            // Another batch writes the same block now.
            return Placement::Present;
        }
        let Some(slot) = self.take_slot(evicted) else {
            return Placement::Busy;
        };
        let records = &self.records;
        let entry = set
            .clone()
            .find(|&i| records[i].state == State::Empty)
            .or_else(|| {
                set.filter(|&i| records[i].state == State::Valid && records[i].readers == 0)
                    .min_by_key(|&i| records[i].tick)
            });
        // The slot stays free (its block, if it had one, is gone already).
        let Some(entry) = entry else {
            return Placement::Busy;
        };
        if self.records[entry].state == State::Valid {
            self.evict(entry);
            evicted.push(entry as u64);
        }
        let t = self.tick();
        self.digests[entry] = want;
        self.records[entry] = Record {
            tick: t,
            slot,
            readers: 0,
            state: State::Writing,
            referenced: false,
        };
        self.owners[slot as usize] = entry as u32 + 1;
        Placement::Write {
            entry: entry as u64,
            slot: u64::from(slot),
        }
    }

    /// Ends a write: the entry holds its block when `ok`; otherwise entry and slot are
    /// free again.
    pub fn finish_write(&mut self, entry: u64, ok: bool) {
        let i = entry as usize;
        if !ok {
            self.evict(i);
            return;
        }
        self.records[i].state = State::Valid;
        let tag = tag_of(whole(self.digests[i]));
        self.resident += 1;
        *self.tag_mut(i) = tag;
    }

    /// Forgets the block of `entry` (it failed a check), if it is still `digest`'s.
    pub(crate) fn drop_entry(&mut self, entry: u64, digest: u128) {
        let i = entry as usize;
        if self.digests[i] == halves(digest) && self.records[i].state == State::Valid {
            self.evict(i);
        }
    }

    /// Restores a block found at start, in `entry`, its payload in `slot`; `seq` (its
    /// write order) becomes its recency. Of two entries naming one slot the later write
    /// wins (the earlier one's bytes were overwritten): the entry that lost, if any, is
    /// returned, to be cleared.
    pub(crate) fn restore(&mut self, entry: u64, digest: u128, seq: u64, slot: u64) -> Option<u64> {
        let (i, s) = (entry as usize, slot as usize);
        let slot32 = u32::try_from(slot).ok().filter(|_| slot < self.geo.slots)?;
        let mut lost = None;
        if let Some(other) = self.owners[s].checked_sub(1).map(|o| o as usize) {
            if other != i && self.records[other].tick > seq {
                return Some(entry);
            }
            self.evict(other);
            lost = (other != i).then_some(other as u64);
        }
        if self.records[i].state != State::Empty {
            self.evict(i);
        }
        self.digests[i] = halves(digest);
        self.records[i] = Record {
            tick: seq,
            slot: slot32,
            readers: 0,
            state: State::Valid,
            referenced: false,
        };
        self.owners[s] = entry as u32 + 1;
        self.resident += 1;
        *self.tag_mut(i) = tag_of(digest);
        if seq >= self.clock {
            // The hand goes on after the last block written, as it would have.
            self.clock = seq;
            self.hand = (slot + 1) % self.geo.slots;
        }
        lost
    }

    /// The recency clock, persisted as the next write's sequence.
    pub(crate) fn clock(&self) -> u64 {
        self.clock
    }

    /// Checks the invariants in the module docs; the first broken one, named.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut valid = 0;
        for (i, r) in self.records.iter().enumerate() {
            let tag = self.tags[i / self.geo.ways as usize].0[i % self.geo.ways as usize];
            match r.state {
                State::Empty => {
                    if tag != 0 || self.digests[i] != [0; 2] {
                        return Err(format!("empty entry {i} has tag {tag} or a digest"));
                    }
                }
                State::Valid | State::Writing => {
                    if self.owners.get(r.slot as usize) != Some(&(i as u32 + 1)) {
                        return Err(format!("entry {i} names slot {} not owned by it", r.slot));
                    }
                    let want = if r.state == State::Valid {
                        valid += 1;
                        tag_of(whole(self.digests[i]))
                    } else {
                        0
                    };
                    if tag != want {
                        return Err(format!("entry {i} has tag {tag}, not {want}"));
                    }
                }
            }
        }
        for (s, &o) in self.owners.iter().enumerate() {
            if let Some(e) = o.checked_sub(1) {
                let r = self.records.get(e as usize);
                if !r.is_some_and(|r| r.state != State::Empty && r.slot as usize == s) {
                    return Err(format!(
                        "slot {s} is owned by entry {e}, which does not name it"
                    ));
                }
            }
        }
        if valid != self.resident {
            return Err(format!(
                "{valid} valid entries, resident says {}",
                self.resident
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
