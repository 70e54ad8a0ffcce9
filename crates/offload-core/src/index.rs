//! [`PrefixIndex`]: `(group, BlockHash)` -> CPU block id, as an open-addressing table.
//!
//! A lookup of a request's prefix probes one key per block, each at a random place in a
//! table as large as the pool: on a busy scheduler those probes are cache misses, and a
//! cold lookup is bound by how many cache lines each probe touches, not by instructions.
//! So the table is one flat array of 32-byte buckets (key and block id together, two per
//! cache line, never straddling one), at most half full, with linear probing: a hit
//! reads one line almost always, and a miss one or two adjacent lines. Removal shifts
//! the following entries back (no tombstones), so the load never creeps up under churn.

use crate::key::{BlockHash, BlockId, BlockKey};
use crate::prefetch::prefetch;

/// Marks an empty bucket: no pool hands out this id (ids are below the capacity, a `u32`).
const EMPTY: BlockId = BlockId::MAX;

/// One bucket: a full key and its block. 32 bytes and 16-aligned through the `u128`.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    hash: u128,
    group: u32,
    block: BlockId,
}

const VACANT: Bucket = Bucket {
    hash: 0,
    group: 0,
    block: EMPTY,
};

/// Where [`PrefixIndex::find_slot`] would put a key that is absent: valid for
/// [`PrefixIndex::insert_vacant`] as long as the index is not changed in between (the
/// index checks, and probes again when it was).
#[derive(Debug, Clone, Copy)]
pub struct Vacancy {
    pos: usize,
    generation: u64,
}

/// Maps block keys to CPU block ids.
///
/// The table is sized for the whole pool at construction, so inserts never reallocate.
///
/// # Examples
/// ```
/// use offload_core::{BlockHash, BlockKey, PrefixIndex};
///
/// let mut index = PrefixIndex::with_capacity(4);
/// let hashes = [BlockHash(1), BlockHash(2), BlockHash(3)];
/// index.insert(BlockKey::new(0, hashes[0]), 7);
/// index.insert(BlockKey::new(0, hashes[1]), 9);
/// assert_eq!(index.longest_prefix(0, &hashes, |_| true), 2);
/// ```
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    buckets: Box<[Bucket]>,
    /// `buckets.len() - 1`; the length is a power of two.
    mask: usize,
    len: usize,
    /// Bumped by every insert and remove, so a [`Vacancy`] taken before one is not used.
    generation: u64,
}

impl PrefixIndex {
    /// An empty index that holds `capacity` keys without reallocating: at least twice
    /// as many buckets, so probe runs stay short.
    pub fn with_capacity(capacity: usize) -> Self {
        let n = capacity.saturating_mul(2).max(16).next_power_of_two();
        Self {
            buckets: vec![VACANT; n].into_boxed_slice(),
            mask: n - 1,
            len: 0,
            generation: 0,
        }
    }

    /// The bucket a key's probe run starts at. The hash bits are already uniform
    /// (cryptographic or xxhash output); one multiply folds in the group and spreads a
    /// short (zero-extended 64-bit) hash as well as a long one.
    #[inline]
    fn home(&self, key: &BlockKey) -> usize {
        let h = key.hash.0;
        let x = (h as u64) ^ ((h >> 64) as u64) ^ (u64::from(key.group) << 32);
        (x.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & self.mask
    }

    #[inline]
    fn matches(b: &Bucket, key: &BlockKey) -> bool {
        b.hash == key.hash.0 && b.group == key.group
    }

    /// The bucket holding `key`, or the empty bucket that ends its probe run.
    #[inline]
    fn probe(&self, key: &BlockKey) -> Result<usize, usize> {
        let mut i = self.home(key);
        loop {
            let b = &self.buckets[i];
            if b.block == EMPTY {
                return Err(i);
            }
            if Self::matches(b, key) {
                return Ok(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Hints the CPU to fetch the bucket `key`'s probe starts at, so that a run of
    /// independent lookups overlaps its cache misses.
    #[inline]
    pub fn prefetch(&self, key: &BlockKey) {
        prefetch(&self.buckets[self.home(key)]);
    }

    /// The block stored under `key`.
    #[inline]
    pub fn get(&self, key: &BlockKey) -> Option<BlockId> {
        self.probe(key).ok().map(|i| self.buckets[i].block)
    }

    /// Whether `key` is present.
    #[inline]
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.probe(key).is_ok()
    }

    /// One probe for a store: the block stored under `key` (`Err`), or where to insert
    /// it (`Ok`) with [`Self::insert_vacant`].
    #[inline]
    pub fn find_slot(&self, key: &BlockKey) -> Result<Vacancy, BlockId> {
        match self.probe(key) {
            Ok(i) => Err(self.buckets[i].block),
            Err(pos) => Ok(Vacancy {
                pos,
                generation: self.generation,
            }),
        }
    }

    /// Inserts the absent `key` where `at` says (from [`Self::find_slot`] on the same
    /// key); when the index changed since, probes again. Returns the block `key` mapped
    /// to if it was inserted meanwhile (it is replaced, as [`Self::insert`] does).
    pub fn insert_vacant(&mut self, at: Vacancy, key: BlockKey, block: BlockId) -> Option<BlockId> {
        if at.generation != self.generation {
            return self.insert(key, block);
        }
        self.fill(at.pos, key, block);
        None
    }

    fn fill(&mut self, pos: usize, key: BlockKey, block: BlockId) {
        assert!(
            self.len < self.mask,
            "prefix index full: {} keys in {} buckets",
            self.len,
            self.mask + 1
        );
        self.buckets[pos] = Bucket {
            hash: key.hash.0,
            group: key.group,
            block,
        };
        self.len += 1;
        self.generation += 1;
    }

    /// Maps `key` to `block`; returns the block it replaced.
    ///
    /// # Panics
    /// When every bucket but one is taken: more keys than twice the capacity the index
    /// was built for (the cache never indexes more keys than it has blocks).
    pub fn insert(&mut self, key: BlockKey, block: BlockId) -> Option<BlockId> {
        match self.probe(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.buckets[i].block, block)),
            Err(i) => {
                self.fill(i, key, block);
                None
            }
        }
    }

    /// Removes `key`; returns the block it mapped to.
    pub fn remove(&mut self, key: &BlockKey) -> Option<BlockId> {
        let mut hole = self.probe(key).ok()?;
        let block = self.buckets[hole].block;
        // Backward shift: move each later entry of the run into the hole unless its
        // home lies cyclically in (hole, j], where moving it would put it before home.
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let b = self.buckets[j];
            if b.block == EMPTY {
                break;
            }
            let home = self.home(&BlockKey::new(b.group, BlockHash(b.hash)));
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.buckets[hole] = b;
                hole = j;
            }
        }
        self.buckets[hole] = VACANT;
        self.len -= 1;
        self.generation += 1;
        Some(block)
    }

    /// Removes every key, keeping the allocation.
    pub fn clear(&mut self) {
        self.buckets.fill(VACANT);
        self.len = 0;
        self.generation += 1;
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Length of the longest run `hashes[0..n]` whose keys are present in `group` and
    /// whose blocks satisfy `usable` (for example: the store has completed).
    ///
    /// vLLM's hashes are chained, so the first miss ends the prefix.
    #[inline]
    pub fn longest_prefix(
        &self,
        group: u32,
        hashes: &[BlockHash],
        mut usable: impl FnMut(BlockId) -> bool,
    ) -> usize {
        hashes
            .iter()
            .take_while(|h| {
                self.get(&BlockKey::new(group, **h))
                    .is_some_and(&mut usable)
            })
            .count()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn groups_are_separate_namespaces() {
        let mut index = PrefixIndex::with_capacity(2);
        index.insert(BlockKey::new(0, BlockHash(5)), 1);
        assert!(index.get(&BlockKey::new(1, BlockHash(5))).is_none());
        index.insert(BlockKey::new(1, BlockHash(5)), 2);
        assert_eq!(index.get(&BlockKey::new(0, BlockHash(5))), Some(1));
        assert_eq!(index.get(&BlockKey::new(1, BlockHash(5))), Some(2));
    }

    #[test]
    fn longest_prefix_stops_at_first_miss_or_unusable_block() {
        let mut index = PrefixIndex::with_capacity(8);
        let hashes: Vec<_> = (1..=5).map(BlockHash).collect();
        for (i, h) in hashes.iter().enumerate() {
            if i != 3 {
                index.insert(BlockKey::new(0, *h), i as BlockId);
            }
        }
        assert_eq!(index.longest_prefix(0, &hashes, |_| true), 3);
        assert_eq!(index.longest_prefix(0, &hashes, |b| b != 1), 1);
        assert_eq!(index.longest_prefix(0, &hashes[4..], |_| true), 1);
        assert_eq!(index.longest_prefix(0, &[], |_| true), 0);
    }

    #[test]
    fn insert_remove_clear() {
        let mut index = PrefixIndex::with_capacity(2);
        let k = BlockKey::new(0, BlockHash(9));
        assert_eq!(index.insert(k, 1), None);
        assert_eq!(index.insert(k, 2), Some(1));
        assert_eq!(index.len(), 1);
        assert_eq!(index.remove(&k), Some(2));
        assert!(index.is_empty());
        index.insert(k, 3);
        index.clear();
        assert!(!index.contains(&k));
    }

    #[test]
    fn a_vacancy_taken_before_a_change_is_probed_again() {
        let mut index = PrefixIndex::with_capacity(4);
        // Keys that share a home bucket: the same low and high words, other groups
        // would not; colliding hashes are made by trying.
        let mut same_home = Vec::new();
        let probe = index.home(&BlockKey::new(0, BlockHash(1)));
        for h in 1..10_000u128 {
            if index.home(&BlockKey::new(0, BlockHash(h))) == probe {
                same_home.push(BlockKey::new(0, BlockHash(h)));
            }
            if same_home.len() == 3 {
                break;
            }
        }
        let [a, b, c] = <[BlockKey; 3]>::try_from(same_home).unwrap();
        index.insert(a, 1);
        index.insert(b, 2);
        let at = index.find_slot(&c).unwrap();
        // Removing `a` shifts `b` back into the home bucket; the vacancy after `b` is
        // now past an empty bucket and would make `c` unreachable.
        index.remove(&a);
        assert_eq!(index.insert_vacant(at, c, 3), None);
        assert_eq!(index.get(&c), Some(3));
        assert_eq!(index.get(&b), Some(2));
        assert_eq!(index.find_slot(&b).unwrap_err(), 2);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// Against a map model, with few home buckets (small table, clustered keys) so
        /// probe runs wrap around and removals shift long runs.
        #[test]
        fn matches_a_map(ops in prop::collection::vec((0u8..4, 0u16..48, 0u8..2), 1..400)) {
            let mut index = PrefixIndex::with_capacity(24);
            let mut model: HashMap<BlockKey, BlockId> = HashMap::new();
            for (n, (op, h, g)) in ops.into_iter().enumerate() {
                let key = BlockKey::new(u32::from(g), BlockHash(u128::from(h) << 70));
                let block = n as BlockId;
                match op {
                    0 if model.len() < 24 || model.contains_key(&key) => {
                        prop_assert_eq!(index.insert(key, block), model.insert(key, block));
                    }
                    1 if model.len() < 24 || model.contains_key(&key) => {
                        match index.find_slot(&key) {
                            Ok(at) => {
                                prop_assert!(!model.contains_key(&key));
                                prop_assert_eq!(index.insert_vacant(at, key, block), None);
                                model.insert(key, block);
                            }
                            Err(b) => prop_assert_eq!(Some(b), model.get(&key).copied()),
                        }
                    }
                    2 => prop_assert_eq!(index.remove(&key), model.remove(&key)),
                    3 if n % 50 == 0 => {
                        index.clear();
                        model.clear();
                    }
                    _ => {}
                }
                prop_assert_eq!(index.len(), model.len());
                for h in 0u16..48 {
                    for g in 0u32..2 {
                        let k = BlockKey::new(g, BlockHash(u128::from(h) << 70));
                        prop_assert_eq!(index.get(&k), model.get(&k).copied());
                    }
                }
            }
        }
    }
}
