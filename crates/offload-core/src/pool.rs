//! [`BlockPool`]: the fixed set of CPU block ids, their ref counts and the free list.

use crate::key::{BlockId, BlockKey};
use crate::prefetch::prefetch;

/// Where a CPU block is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// On the free list; holds nothing.
    Free,
    /// Indexed, but its store has not completed on every rank: never served.
    Pending,
    /// Indexed and complete: may be served by lookups.
    Ready,
    /// Dropped from the index (reset, failed store) while a transfer still holds it;
    /// returns to the free list when the last pin is released.
    Detached,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    ref_count: u32,
    state: BlockState,
}

/// The CPU block ids of one rank's budget.
///
/// The pool only counts: it never touches host memory and never hands out more ids
/// than it was created with.
///
/// # Examples
/// ```
/// use offload_core::{BlockPool, BlockState};
///
/// let mut pool = BlockPool::new(2);
/// let a = pool.alloc().unwrap();
/// let b = pool.alloc().unwrap();
/// assert!(pool.alloc().is_none());
/// pool.unpin(a).unwrap();
/// pool.release(a).unwrap();
/// assert_eq!(pool.num_free(), 1);
/// assert_eq!(pool.state(b), Some(BlockState::Pending));
/// ```
#[derive(Debug, Clone)]
pub struct BlockPool {
    /// What lookups touch for every block: 8 bytes each, so a pool's worth stays in
    /// the CPU's caches far longer than with the keys inline.
    slots: Vec<Slot>,
    /// Only read on eviction and detach.
    keys: Vec<BlockKey>,
    free: Vec<BlockId>,
}

/// A pool operation that the block's state does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The id is not below the pool's capacity.
    #[error("CPU block id {id} is out of range (pool has {capacity} blocks)")]
    OutOfRange {
        /// The offending id.
        id: BlockId,
        /// The pool's capacity.
        capacity: u32,
    },
    /// Releasing a block that is free already, or that is still pinned.
    #[error("CPU block {id} cannot be released: state {state:?}, ref count {ref_count}")]
    NotReleasable {
        /// The block.
        id: BlockId,
        /// Its state.
        state: BlockState,
        /// Its ref count.
        ref_count: u32,
    },
    /// Unpinning a block whose ref count is zero.
    #[error("CPU block {0} is not pinned")]
    NotPinned(BlockId),
}

impl BlockPool {
    /// A pool of `capacity` free blocks. Ids are handed out lowest first, so a fresh pool
    /// fills host memory in order (which keeps runs of consecutive ids for coalescing).
    pub fn new(capacity: u32) -> Self {
        Self {
            slots: vec![
                Slot {
                    ref_count: 0,
                    state: BlockState::Free,
                };
                capacity as usize
            ],
            keys: vec![BlockKey::default(); capacity as usize],
            free: (0..capacity).rev().collect(),
        }
    }

    /// Total number of blocks.
    pub fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Number of blocks on the free list.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Takes a block off the free list. It comes back [`BlockState::Pending`] with one pin
    /// (the store that will fill it).
    pub fn alloc(&mut self) -> Option<BlockId> {
        let id = self.free.pop()?;
        let slot = &mut self.slots[id as usize];
        slot.ref_count = 1;
        slot.state = BlockState::Pending;
        Some(id)
    }

    /// Puts an unpinned, allocated block back on the free list.
    pub fn release(&mut self, id: BlockId) -> Result<(), PoolError> {
        let slot = self.slot_mut(id)?;
        if slot.state == BlockState::Free || slot.ref_count > 0 {
            return Err(PoolError::NotReleasable {
                id,
                state: slot.state,
                ref_count: slot.ref_count,
            });
        }
        slot.ref_count = 0;
        slot.state = BlockState::Free;
        self.free.push(id);
        Ok(())
    }

    /// Adds a pin; returns the new ref count.
    pub fn pin(&mut self, id: BlockId) -> Result<u32, PoolError> {
        let slot = self.slot_mut(id)?;
        slot.ref_count += 1;
        Ok(slot.ref_count)
    }

    /// Drops a pin; returns the new ref count.
    pub fn unpin(&mut self, id: BlockId) -> Result<u32, PoolError> {
        let slot = self.slot_mut(id)?;
        if slot.ref_count == 0 {
            return Err(PoolError::NotPinned(id));
        }
        slot.ref_count -= 1;
        Ok(slot.ref_count)
    }

    /// Hints the CPU to fetch the block's state and ref count (see [`Self::state`]).
    #[inline]
    pub fn prefetch(&self, id: BlockId) {
        if let Some(slot) = self.slots.get(id as usize) {
            prefetch(slot);
        }
    }

    /// Whether block `id` is [`BlockState::Ready`] and was stored under `key`.
    #[inline]
    pub fn is_ready_with_key(&self, id: BlockId, key: &BlockKey) -> bool {
        let i = id as usize;
        self.slots
            .get(i)
            .is_some_and(|s| s.state == BlockState::Ready && self.keys[i] == *key)
    }

    /// The block's state, or `None` when out of range.
    #[inline]
    pub fn state(&self, id: BlockId) -> Option<BlockState> {
        self.slots.get(id as usize).map(|s| s.state)
    }

    /// Changes the block's state (the cache drives the transitions).
    pub(crate) fn set_state(&mut self, id: BlockId, state: BlockState) -> Result<(), PoolError> {
        self.slot_mut(id)?.state = state;
        Ok(())
    }

    /// The block's ref count, or `None` when out of range.
    pub fn ref_count(&self, id: BlockId) -> Option<u32> {
        self.slots.get(id as usize).map(|s| s.ref_count)
    }

    /// The key the block was stored under.
    pub fn key(&self, id: BlockId) -> Option<BlockKey> {
        self.keys.get(id as usize).copied()
    }

    /// Records the key the block is stored under.
    pub(crate) fn set_key(&mut self, id: BlockId, key: BlockKey) -> Result<(), PoolError> {
        let capacity = self.capacity();
        *self
            .keys
            .get_mut(id as usize)
            .ok_or(PoolError::OutOfRange { id, capacity })? = key;
        Ok(())
    }

    fn slot_mut(&mut self, id: BlockId) -> Result<&mut Slot, PoolError> {
        let capacity = self.capacity();
        self.slots
            .get_mut(id as usize)
            .ok_or(PoolError::OutOfRange { id, capacity })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_each_id_once_lowest_first() {
        let mut pool = BlockPool::new(3);
        let ids: Vec<_> = std::iter::from_fn(|| pool.alloc()).collect();
        assert_eq!(ids, vec![0, 1, 2]);
        assert_eq!(pool.num_free(), 0);
    }

    #[test]
    fn pins_count_up_and_down() {
        let mut pool = BlockPool::new(1);
        let b = pool.alloc().unwrap();
        assert_eq!(pool.pin(b).unwrap(), 2);
        assert_eq!(pool.unpin(b).unwrap(), 1);
        assert_eq!(pool.unpin(b).unwrap(), 0);
        assert_eq!(pool.unpin(b), Err(PoolError::NotPinned(b)));
    }

    #[test]
    fn release_rejects_free_and_pinned_blocks() {
        let mut pool = BlockPool::new(1);
        let b = pool.alloc().unwrap();
        assert!(matches!(
            pool.release(b),
            Err(PoolError::NotReleasable { .. })
        ));
        pool.unpin(b).unwrap();
        pool.release(b).unwrap();
        assert!(matches!(
            pool.release(b),
            Err(PoolError::NotReleasable { .. })
        ));
        assert_eq!(pool.num_free(), 1);
    }

    #[test]
    fn out_of_range_ids_are_errors() {
        let mut pool = BlockPool::new(1);
        assert_eq!(
            pool.pin(1),
            Err(PoolError::OutOfRange { id: 1, capacity: 1 })
        );
        assert!(pool.state(1).is_none());
    }
}
