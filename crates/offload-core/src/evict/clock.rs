//! [`Clock`]: second-chance eviction over two bitsets.
//!
//! A hit pins its blocks and a finished load unpins them, on every lookup; with an exact
//! LRU list each of those relinks two random neighbours (cache misses on a large pool).
//! Here both are a bit flip in bitsets of `capacity / 8` bytes, which stay in cache. The
//! hand sweeps the evictable blocks in id order: a block used since the hand last passed
//! gets a second chance (its reference bit is cleared), the first one without is the
//! victim. Each sweep clears every reference bit it passes, so a victim is found within
//! two turns of the hand, 64 blocks per step.

use crate::key::BlockId;

use super::EvictionPolicy;

const WORD: usize = 64;

/// Second-chance (CLOCK) eviction over block ids `0..capacity`.
///
/// # Examples
/// ```
/// use offload_core::{Clock, EvictionPolicy};
///
/// let mut clock = Clock::new(3);
/// clock.insert(0);
/// clock.insert(1);
/// clock.insert(2);
/// // Every block was used since the hand last passed: each gets a second chance,
/// // then the oldest in hand order goes first.
/// assert_eq!(clock.pop_victim(), Some(0));
/// clock.insert(0); // used again
/// assert_eq!(clock.pop_victim(), Some(1));
/// ```
#[derive(Debug, Clone)]
pub struct Clock {
    /// Bit `b`: block `b` is held as evictable.
    evictable: Vec<u64>,
    /// Bit `b`: block `b` was used since the hand last passed it.
    referenced: Vec<u64>,
    /// The next block id the hand looks at.
    hand: usize,
    len: usize,
    capacity: usize,
}

impl Clock {
    /// An empty policy for block ids `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        let capacity = capacity as usize;
        let words = capacity.div_ceil(WORD);
        Self {
            evictable: vec![0; words],
            referenced: vec![0; words],
            hand: 0,
            len: 0,
            capacity,
        }
    }
}

fn bit(block: BlockId) -> (usize, u64) {
    let b = block as usize;
    (b / WORD, 1u64 << (b % WORD))
}

impl EvictionPolicy for Clock {
    fn insert(&mut self, block: BlockId) {
        if block as usize >= self.capacity {
            return;
        }
        let (w, m) = bit(block);
        if self.evictable[w] & m == 0 {
            self.evictable[w] |= m;
            self.len += 1;
        }
        self.referenced[w] |= m;
    }

    fn remove(&mut self, block: BlockId) {
        if block as usize >= self.capacity {
            return;
        }
        let (w, m) = bit(block);
        if self.evictable[w] & m != 0 {
            self.evictable[w] &= !m;
            self.len -= 1;
        }
    }

    fn pop_victim(&mut self) -> Option<BlockId> {
        if self.len == 0 {
            return None;
        }
        let words = self.evictable.len();
        let mut w = self.hand / WORD;
        let mut from = !0u64 << (self.hand % WORD);
        // Two full turns plus the partial first word: the first turn clears every
        // reference bit, so the second finds an unreferenced evictable block.
        for _ in 0..=2 * words {
            let held = self.evictable[w] & from;
            let cold = held & !self.referenced[w];
            if cold != 0 {
                let b = cold.trailing_zeros();
                let m = 1u64 << b;
                // The blocks the hand passed in this word used their second chance.
                self.referenced[w] &= !(held & (m - 1));
                self.evictable[w] &= !m;
                self.len -= 1;
                let victim = w * WORD + b as usize;
                self.hand = if victim + 1 >= self.capacity {
                    0
                } else {
                    victim + 1
                };
                return BlockId::try_from(victim).ok();
            }
            self.referenced[w] &= !held;
            w = if w + 1 == words { 0 } else { w + 1 };
            from = !0;
        }
        None
    }

    fn contains(&self, block: BlockId) -> bool {
        if block as usize >= self.capacity {
            return false;
        }
        let (w, m) = bit(block);
        self.evictable[w] & m != 0
    }

    fn len(&self) -> usize {
        self.len
    }

    fn clear(&mut self) {
        self.evictable.fill(0);
        self.referenced.fill(0);
        self.hand = 0;
        self.len = 0;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn unreferenced_blocks_go_first_and_the_hand_moves_on() {
        let mut c = Clock::new(130);
        for b in 0..130 {
            c.insert(b);
        }
        // First turn clears every reference bit; block 0 is the first without one.
        assert_eq!(c.pop_victim(), Some(0));
        c.insert(1); // used again: survives the next pass
        assert_eq!(c.pop_victim(), Some(2));
        assert_eq!(c.pop_victim(), Some(3));
        c.remove(4); // pinned
        assert_eq!(c.pop_victim(), Some(5));
        assert_eq!(c.len(), 130 - 4 - 1);
    }

    #[test]
    fn out_of_range_ids_are_ignored_and_empty_has_no_victim() {
        let mut c = Clock::new(3);
        c.insert(7);
        c.remove(7);
        assert!(!c.contains(7));
        assert_eq!(c.pop_victim(), None);
        c.insert(2);
        c.clear();
        assert_eq!(c.pop_victim(), None);
        assert!(c.is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Against a set model: victims are always held blocks, each once, and a victim
        /// exists whenever a block is held.
        #[test]
        fn victims_are_held_blocks(ops in prop::collection::vec((0u8..3, 0u32..200), 1..400)) {
            let mut c = Clock::new(200);
            let mut model = BTreeSet::new();
            for (op, b) in ops {
                match op {
                    0 => { c.insert(b); model.insert(b); }
                    1 => { c.remove(b); model.remove(&b); }
                    _ => match c.pop_victim() {
                        Some(v) => prop_assert!(model.remove(&v), "victim {} not held", v),
                        None => prop_assert!(model.is_empty()),
                    },
                }
                prop_assert_eq!(c.len(), model.len());
                for b in 0..200 {
                    prop_assert_eq!(c.contains(b), model.contains(&b));
                }
            }
        }
    }
}
