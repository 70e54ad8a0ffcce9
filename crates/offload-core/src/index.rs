//! [`PrefixIndex`]: `(group, BlockHash)` -> CPU block id.

use std::collections::HashMap;

use crate::key::{BlockHash, BlockId, BlockKey, BuildKeyHasher};

/// Maps block keys to CPU block ids.
///
/// The map is sized for the whole pool at construction, so inserts never reallocate.
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
    map: HashMap<BlockKey, BlockId, BuildKeyHasher>,
}

impl PrefixIndex {
    /// An empty index that holds `capacity` keys without reallocating.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            map: HashMap::with_capacity_and_hasher(capacity, BuildKeyHasher),
        }
    }

    /// The block stored under `key`.
    #[inline]
    pub fn get(&self, key: &BlockKey) -> Option<BlockId> {
        self.map.get(key).copied()
    }

    /// Whether `key` is present.
    #[inline]
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.map.contains_key(key)
    }

    /// Maps `key` to `block`; returns the block it replaced.
    pub fn insert(&mut self, key: BlockKey, block: BlockId) -> Option<BlockId> {
        self.map.insert(key, block)
    }

    /// Removes `key`; returns the block it mapped to.
    pub fn remove(&mut self, key: &BlockKey) -> Option<BlockId> {
        self.map.remove(key)
    }

    /// Removes every key, keeping the allocation.
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
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
}
