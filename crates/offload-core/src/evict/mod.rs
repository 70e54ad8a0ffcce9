//! Eviction: which unpinned, published CPU block to reuse next. One flavour per file:
//! [`Slru`] (the default: segmented LRU, blocks never used again go first), [`Lru`]
//! (exact order, as vLLM's block pool evicts, relinking list neighbours on every pin
//! and unpin) and [`Clock`] (a pin or unpin touches one bit; second chance only
//! approximates that order).

mod clock;
mod lru;
mod slru;

pub use clock::Clock;
pub use lru::Lru;
pub use slru::Slru;

use crate::key::BlockId;

/// A policy over a fixed slab of block ids.
///
/// The cache tells the policy when a block becomes evictable (published and unpinned)
/// and when it stops being so (pinned, freed); the policy picks victims among the
/// evictable ones. Implementations must be O(1) per call and must not allocate after
/// construction: they run on the scheduler's hot path.
pub trait EvictionPolicy: std::fmt::Debug + Send {
    /// `block` became evictable; it is the most recently used one.
    fn insert(&mut self, block: BlockId);
    /// `block` is no longer evictable. Removing a block that is not held is a no-op.
    fn remove(&mut self, block: BlockId);
    /// Takes the next victim out of the policy.
    fn pop_victim(&mut self) -> Option<BlockId>;
    /// Whether `block` is held as evictable.
    fn contains(&self, block: BlockId) -> bool;
    /// Number of evictable blocks.
    fn len(&self) -> usize;
    /// Whether no block is evictable.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forgets every block.
    fn clear(&mut self);
}
