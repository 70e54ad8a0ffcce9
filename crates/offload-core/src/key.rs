//! The vocabulary every module shares: block hashes, index keys and CPU block ids.
//!
//! It sits below the prefix index and the block pool so that neither imports the other.

use std::hash::{BuildHasher, Hash, Hasher};

/// A CPU block id: an index into the host memory's block slab.
pub type BlockId = u32;

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
    #[inline]
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        // vLLM's hashes are 32 bytes (sha256) or longer: a fixed-size read, no memset.
        if let Some(head) = bytes.first_chunk::<16>() {
            return Some(Self(u128::from_le_bytes(*head)));
        }
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

/// Tells KV-cache groups apart in remote keys (see [`BlockKey::remote_hash`]): an odd
/// constant, so `group * GROUP_MIX` is a different value for every group.
const GROUP_MIX: u128 = 0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835;

impl BlockKey {
    /// A key in group `group`.
    pub const fn new(group: u32, hash: BlockHash) -> Self {
        Self { group, hash }
    }

    /// The block's key in a remote tier, whose keys are one hash: the hash itself in
    /// group 0 (a model of one group keys its blocks by their hashes), the hash XOR
    /// `group` times an odd constant in the others.
    ///
    /// ```
    /// use offload_core::{BlockHash, BlockKey};
    ///
    /// let h = BlockHash(7);
    /// assert_eq!(BlockKey::new(0, h).remote_hash(), h);
    /// assert_ne!(BlockKey::new(1, h).remote_hash(), BlockKey::new(2, h).remote_hash());
    /// ```
    pub const fn remote_hash(&self) -> BlockHash {
        BlockHash(self.hash.0 ^ GROUP_MIX.wrapping_mul(self.group as u128))
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
}
