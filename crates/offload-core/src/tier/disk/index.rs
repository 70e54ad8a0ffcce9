//! The owner's in-memory index: one record per slot (24 bytes), grouped in sets, with
//! the slot's state so a block being written is never read and a block being read is
//! never overwritten.

use super::layout::Geometry;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Empty,
    Valid,
    Writing,
}

/// One slot. `readers` counts reads in flight; such a slot is not a victim.
#[derive(Debug, Clone, Copy)]
struct Slot {
    digest: u128,
    tick: u64,
    readers: u16,
    state: State,
}

const EMPTY: Slot = Slot {
    digest: 0,
    tick: 0,
    readers: 0,
    state: State::Empty,
};

/// Where a put goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// The block is there already (same key, same bytes): nothing to write.
    Present,
    /// Write into this slot; `evicted` says whether a block had to go.
    Write { slot: u64, evicted: bool },
    /// Every slot of the set is busy: skip.
    Busy,
}

/// Slots of a [`Geometry`], looked up by key digest within the digest's set.
#[derive(Debug)]
pub(crate) struct Index {
    geo: Geometry,
    slots: Vec<Slot>,
    clock: u64,
    resident: u64,
}

impl Index {
    pub(crate) fn new(geo: Geometry) -> Self {
        Self {
            geo,
            slots: vec![EMPTY; geo.slots as usize],
            clock: 0,
            resident: 0,
        }
    }

    pub(crate) fn resident(&self) -> u64 {
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

    /// The slot holding `digest`, if it is readable.
    pub(crate) fn find(&self, digest: u128) -> Option<u64> {
        self.set(digest)
            .find(|&i| self.slots[i].state == State::Valid && self.slots[i].digest == digest)
            .map(|i| i as u64)
    }

    /// Marks a read of `digest` started: its slot, now protected from eviction and
    /// counted as recently used.
    pub(crate) fn begin_read(&mut self, digest: u128) -> Option<u64> {
        let slot = self.find(digest)?;
        let t = self.tick();
        let s = &mut self.slots[slot as usize];
        s.readers += 1;
        s.tick = t;
        Some(slot)
    }

    pub(crate) fn end_read(&mut self, slot: u64) {
        let s = &mut self.slots[slot as usize];
        s.readers = s.readers.saturating_sub(1);
    }

    /// Where to write `digest`; the slot is `Writing` until [`Self::finish_write`].
    pub(crate) fn place(&mut self, digest: u128) -> Placement {
        if let Some(slot) = self.find(digest) {
            let t = self.tick();
            self.slots[slot as usize].tick = t;
            return Placement::Present;
        }
        let set = self.set(digest);
        if set
            .clone()
            .any(|i| self.slots[i].state == State::Writing && self.slots[i].digest == digest)
        {
            // Another batch writes the same block now.
            return Placement::Present;
        }
        let victim = set
            .clone()
            .find(|&i| self.slots[i].state == State::Empty)
            .or_else(|| {
                set.filter(|&i| self.slots[i].state == State::Valid && self.slots[i].readers == 0)
                    .min_by_key(|&i| self.slots[i].tick)
            });
        let Some(i) = victim else {
            return Placement::Busy;
        };
        let evicted = self.slots[i].state == State::Valid;
        if evicted {
            self.resident -= 1;
        }
        let t = self.tick();
        self.slots[i] = Slot {
            digest,
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
    pub(crate) fn finish_write(&mut self, slot: u64, ok: bool) {
        let s = &mut self.slots[slot as usize];
        if ok {
            s.state = State::Valid;
            self.resident += 1;
        } else {
            *s = EMPTY;
        }
    }

    /// Forgets the block in `slot` (it failed a check).
    pub(crate) fn drop_slot(&mut self, slot: u64, digest: u128) {
        let s = &mut self.slots[slot as usize];
        if s.digest == digest && s.state == State::Valid {
            self.resident -= 1;
            s.state = State::Empty;
            s.digest = 0;
        }
    }

    /// Restores a block found at start; `seq` (its write order) becomes its recency.
    pub(crate) fn restore(&mut self, slot: u64, digest: u128, seq: u64) {
        let s = &mut self.slots[slot as usize];
        if s.state != State::Valid {
            self.resident += 1;
        }
        *s = Slot {
            digest,
            tick: seq,
            readers: 0,
            state: State::Valid,
        };
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

    fn geo(slots: u64) -> Geometry {
        Geometry::fit(4096 + slots * (4096 + 64), 4000, 1).unwrap()
    }

    #[test]
    fn lru_within_a_set_and_busy_slots_are_kept() {
        let mut ix = Index::new(geo(4));
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
