//! [`PrefixIndex`]: `(group, BlockHash)` -> CPU block id.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};

use crate::pool::BlockId;

/// A block's content hash, 128 bits taken from the leading bytes of vLLM's hash.
///
/// vLLM chains hashes (block k's hash covers blocks 0..=k), and uses sha256 by default;
/// 128 bits keep the chance of a collision serving wrong KV negligible, where a 64-bit
/// truncation would not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// Builds a hash from vLLM's hash bytes: the first 16 bytes, little-endian.
    ///
    /// Shorter hashes (a 64-bit xxhash) are zero-extended, so the full hash is kept.
    /// Returns `None` for an empty slice.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.is_empty() {
            return None;
        }
        let mut buf = [0u8; 16];
        let n = bytes.len().min(16);
        buf[..n].copy_from_slice(&bytes[..n]);
        Some(Self(u128::from_le_bytes(buf)))
    }
}

/// The index key: a KV-cache group id and a block hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct BlockKey {
    /// vLLM's KV-cache group id.
    pub group: u32,
    /// The block's hash.
    pub hash: BlockHash,
}

impl BlockKey {
    /// A key in group `group`.
    pub const fn new(group: u32, hash: BlockHash) -> Self {
        Self { group, hash }
    }
}

impl Hash for BlockKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The hash bits are already uniform (cryptographic or xxhash output), so one
        // word of them plus the group is enough for bucketing.
        state.write_u64((self.hash.0 as u64) ^ (u64::from(self.group) << 32));
    }
}

/// A cheap hasher for [`BlockKey`]: one multiply to spread the already-random bits.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(buf));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
}

/// Builds [`KeyHasher`]s for the index map.
#[derive(Debug, Default, Clone, Copy)]
pub struct BuildKeyHasher;

impl BuildHasher for BuildKeyHasher {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

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
    fn hash_from_bytes_keeps_128_bits() {
        let bytes: Vec<u8> = (0u8..32).collect();
        let h = BlockHash::from_bytes(&bytes).unwrap();
        assert_eq!(
            h.0.to_le_bytes(),
            <[u8; 16]>::try_from(&bytes[..16]).unwrap()
        );
        // Two hashes that agree on their first 8 bytes stay distinct.
        let mut other = bytes.clone();
        other[15] ^= 1;
        assert_ne!(BlockHash::from_bytes(&other).unwrap(), h);
    }

    #[test]
    fn short_hashes_are_zero_extended_and_empty_is_rejected() {
        assert_eq!(BlockHash::from_bytes(&[1, 0]).unwrap(), BlockHash(1));
        assert!(BlockHash::from_bytes(&[]).is_none());
    }

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
