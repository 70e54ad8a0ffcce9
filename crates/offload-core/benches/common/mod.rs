//! Shared by the benches: a seeded stream of block hashes.

use offload_core::{BlockHash, BlockKey};

/// splitmix64: a seeded stream of well-mixed words, as random as vLLM's sha256 hashes.
#[derive(Debug, Clone)]
pub(crate) struct Rng(pub(crate) u64);

#[allow(dead_code)] // each bench uses a subset
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(crate) fn hash(&mut self) -> BlockHash {
        BlockHash((u128::from(self.next()) << 64) | u128::from(self.next()))
    }

    pub(crate) fn hashes(&mut self, n: usize) -> Vec<BlockHash> {
        (0..n).map(|_| self.hash()).collect()
    }

    pub(crate) fn keys(&mut self, n: usize) -> Vec<BlockKey> {
        (0..n).map(|_| BlockKey::new(0, self.hash())).collect()
    }
}
