//! [`Slru`]: segmented LRU, so that blocks stored once and never used again do not push
//! out the ones that are.
//!
//! A serving trace stores every prompt's blocks, but only shared prefixes come back:
//! each request's own tail is stored, never hit, and under plain LRU it still evicts a
//! prefix that many requests share. Here a block starts on probation and moves to the
//! protected segment when it is used again (a lookup pinned it and let it go); victims
//! come from probation first. The protected segment is capped, so prefixes that stop
//! being asked for are demoted and age out in turn.

use crate::key::BlockId;

use super::{EvictionPolicy, Lru};

/// Share of the blocks the protected segment may hold, in percent.
const PROTECTED_PERCENT: usize = 80;

/// Segmented least-recently-used eviction over block ids `0..capacity`.
///
/// # Examples
/// ```
/// use offload_core::{EvictionPolicy, Slru};
///
/// let mut slru = Slru::new(3);
/// slru.insert(0); // stored
/// slru.insert(1); // stored
/// slru.remove(0); // pinned by a lookup
/// slru.insert(0); // let go: used again, so protected
/// slru.insert(2); // stored
/// // Blocks never used again go first, oldest first.
/// assert_eq!(slru.pop_victim(), Some(1));
/// assert_eq!(slru.pop_victim(), Some(2));
/// assert_eq!(slru.pop_victim(), Some(0));
/// ```
#[derive(Debug, Clone)]
pub struct Slru {
    probation: Lru,
    protected: Lru,
    /// Bit `b`: block `b` was made evictable before since it was last evicted, so its
    /// next insert is a use. Blocks the cache frees without evicting them (a failed
    /// load, a reset) keep their bit until [`EvictionPolicy::clear`] or their eviction.
    seen: Vec<u64>,
    protected_cap: usize,
    capacity: usize,
}

impl Slru {
    /// An empty policy for block ids `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        let capacity = capacity as usize;
        Self {
            probation: Lru::new(capacity as u32),
            protected: Lru::new(capacity as u32),
            seen: vec![0; capacity.div_ceil(64)],
            protected_cap: (capacity * PROTECTED_PERCENT / 100).max(1),
            capacity,
        }
    }

    fn seen_bit(block: BlockId) -> (usize, u64) {
        let b = block as usize;
        (b / 64, 1u64 << (b % 64))
    }
}

impl EvictionPolicy for Slru {
    fn insert(&mut self, block: BlockId) {
        if block as usize >= self.capacity {
            return;
        }
        let (w, m) = Self::seen_bit(block);
        if self.seen[w] & m == 0 {
            self.seen[w] |= m;
            self.probation.insert(block);
            return;
        }
        self.probation.remove(block);
        self.protected.insert(block);
        if self.protected.len() > self.protected_cap {
            if let Some(old) = self.protected.pop_victim() {
                self.probation.insert(old);
            }
        }
    }

    fn remove(&mut self, block: BlockId) {
        self.probation.remove(block);
        self.protected.remove(block);
    }

    fn pop_victim(&mut self) -> Option<BlockId> {
        let victim = self
            .probation
            .pop_victim()
            .or_else(|| self.protected.pop_victim())?;
        let (w, m) = Self::seen_bit(victim);
        self.seen[w] &= !m;
        Some(victim)
    }

    fn contains(&self, block: BlockId) -> bool {
        self.probation.contains(block) || self.protected.contains(block)
    }

    fn len(&self) -> usize {
        self.probation.len() + self.protected.len()
    }

    fn clear(&mut self) {
        self.probation.clear();
        self.protected.clear();
        self.seen.fill(0);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn used_blocks_outlive_blocks_stored_later_but_never_used() {
        let mut s = Slru::new(10);
        for b in 0..4 {
            s.insert(b);
        }
        s.remove(1);
        s.insert(1);
        for b in 4..8 {
            s.insert(b);
        }
        let order: Vec<_> = std::iter::from_fn(|| s.pop_victim()).collect();
        assert_eq!(order, vec![0, 2, 3, 4, 5, 6, 7, 1]);
        // Evicted blocks start over: a new store of block 1 is on probation again.
        s.insert(1);
        s.insert(2);
        assert_eq!(s.pop_victim(), Some(1));
    }

    #[test]
    fn the_protected_segment_is_capped() {
        let mut s = Slru::new(5); // at most 4 protected
        for b in 0..5 {
            s.insert(b);
            s.remove(b);
            s.insert(b);
        }
        // Block 0 was demoted when block 4 joined: it goes first.
        assert_eq!(s.pop_victim(), Some(0));
        assert_eq!(s.len(), 4);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Against a set model: victims are held blocks, each once, and one exists
        /// whenever a block is held.
        #[test]
        fn victims_are_held_blocks(ops in prop::collection::vec((0u8..4, 0u32..40), 1..400)) {
            let mut s = Slru::new(40);
            let mut model = BTreeSet::new();
            for (op, b) in ops {
                match op {
                    0 | 1 => { s.insert(b); model.insert(b); }
                    2 => { s.remove(b); model.remove(&b); }
                    _ => match s.pop_victim() {
                        Some(v) => prop_assert!(model.remove(&v), "victim {} not held", v),
                        None => prop_assert!(model.is_empty()),
                    },
                }
                prop_assert_eq!(s.len(), model.len());
                for b in 0..40 {
                    prop_assert_eq!(s.contains(b), model.contains(&b));
                }
            }
        }
    }
}
