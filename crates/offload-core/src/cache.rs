//! [`BlockCache`]: the pool, the prefix index and the eviction policy kept consistent.
//!
//! Invariants (checked by the property test in `cache/tests.rs` after every operation):
//! - a block is `Free` iff it is on the free list; a free block is neither indexed nor
//!   evictable and has no pins;
//! - an indexed block is `Pending` or `Ready`, and the index maps its key back to it;
//! - a block is evictable iff it is `Ready` with no pins, so pinned and in-flight blocks
//!   are never evicted;
//! - `Pending` blocks hold the pin of the store that fills them and are never returned
//!   by lookups;
//! - `Detached` blocks are pinned, unindexed, and go back to the free list when the last
//!   pin is dropped.

use crate::events::{EventBuffer, KvEvent};
use crate::evict::{EvictionPolicy, Slru};
use crate::index::PrefixIndex;
use crate::key::{BlockHash, BlockId, BlockKey};
use crate::pool::{BlockPool, BlockState, PoolError};

/// What [`BlockCache::reserve_key`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reservation {
    /// A block for the new store, `Pending` and pinned by it.
    Reserved(BlockId),
    /// The key is on CPU or being stored already.
    Present,
    /// Every block is pinned or in flight.
    NoSpace,
}

/// CPU-side block bookkeeping of one rank: ids, keys, pins and eviction order.
///
/// # Examples
/// ```
/// use offload_core::{BlockCache, BlockHash, BlockKey};
///
/// let mut cache = BlockCache::new(1, false);
/// let key = BlockKey::new(0, BlockHash(42));
/// let block = cache.reserve(key).expect("a free block");
/// assert_eq!(cache.ready_prefix(0, &[BlockHash(42)]), 0); // store still in flight
/// cache.publish(block).unwrap();
/// assert_eq!(cache.ready_prefix(0, &[BlockHash(42)]), 1);
/// ```
#[derive(Debug)]
pub struct BlockCache<P: EvictionPolicy = Slru> {
    pool: BlockPool,
    index: PrefixIndex,
    policy: P,
    events: EventBuffer,
    evicted: u64,
}

impl BlockCache<Slru> {
    /// A cache of `capacity` blocks with segmented LRU ([`Slru`]) eviction; KV events
    /// are buffered when `events` is true.
    ///
    /// On a churning trace (a CPU pool smaller than its shared prefixes, the `churn`
    /// trace of `benches/compare_scheduler.py`), second chance ([`crate::Clock`])
    /// served fewer CPU hits than vLLM's own CPU tier (plain LRU), and plain LRU
    /// ([`crate::Lru`]) as many: each request's own blocks, stored and never used
    /// again, push shared prefixes out. Segmented LRU evicts those first. Its relinks
    /// cost little: a prefix stored in one go is linked in order, so pinning and
    /// unpinning it touches neighbouring links.
    pub fn new(capacity: u32, events: bool) -> Self {
        Self::with_policy(capacity, Slru::new(capacity), events)
    }
}

impl<P: EvictionPolicy> BlockCache<P> {
    /// A cache of `capacity` blocks evicting with `policy`.
    pub fn with_policy(capacity: u32, policy: P, events: bool) -> Self {
        Self {
            pool: BlockPool::new(capacity),
            index: PrefixIndex::with_capacity(capacity as usize),
            policy,
            events: EventBuffer::new(events),
            evicted: 0,
        }
    }

    /// Number of CPU blocks.
    pub fn capacity(&self) -> u32 {
        self.pool.capacity()
    }

    /// The underlying pool, read-only.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The underlying index, read-only.
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Number of blocks that can be evicted right now.
    pub fn num_evictable(&self) -> usize {
        self.policy.len()
    }

    /// Blocks evicted since construction.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// How many leading `hashes` of `group` are on CPU with completed stores.
    #[inline]
    pub fn ready_prefix(&self, group: u32, hashes: &[BlockHash]) -> usize {
        let pool = &self.pool;
        self.index
            .longest_prefix(group, hashes, |b| pool.state(b) == Some(BlockState::Ready))
    }

    /// Hints the CPU to fetch what [`Self::reserve_key`] reads first for `key` (its
    /// index bucket): a store reserves a run of independent keys, and hinting them all
    /// first overlaps their cache misses instead of taking them one after the other.
    #[inline]
    pub fn prefetch_key(&self, key: &BlockKey) {
        self.index.prefetch(key);
    }

    /// The block stored under `key` if its store has completed.
    #[inline]
    pub fn get_ready(&self, key: &BlockKey) -> Option<BlockId> {
        self.index
            .get(key)
            .filter(|b| self.pool.state(*b) == Some(BlockState::Ready))
    }

    /// [`Self::get_ready`], trying `guess` first: a prefix stored in one go sits in
    /// consecutive blocks, so the block after the previous hit is usually the one, and
    /// checking its key reads the pool in order instead of a random index bucket.
    #[inline]
    pub fn get_ready_near(&self, key: &BlockKey, guess: BlockId) -> Option<BlockId> {
        // A ready block is indexed under its key (see the module invariants), so a
        // ready block holding `key` is exactly what the index would return.
        if self.pool.is_ready_with_key(guess, key) {
            return Some(guess);
        }
        self.get_ready(key)
    }

    /// Whether `block` holds a completed store.
    #[inline]
    pub fn is_ready(&self, block: BlockId) -> bool {
        self.pool.state(block) == Some(BlockState::Ready)
    }

    /// Whether `key` is on CPU or being stored.
    #[inline]
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.index.contains(key)
    }

    /// Pins a block so it is neither evicted nor freed until [`Self::unpin`].
    // A lookup pins every block of its hit: left to itself the compiler keeps this a
    // call from the lookup or inlines it depending on unrelated code around it.
    #[inline]
    pub fn pin(&mut self, block: BlockId) -> Result<(), PoolError> {
        if self.pool.pin(block)? == 1 {
            self.policy.remove(block);
        }
        Ok(())
    }

    /// Drops a pin. A `Ready` block with no pins becomes the most recently used
    /// evictable block; a `Detached` one returns to the free list.
    pub fn unpin(&mut self, block: BlockId) -> Result<(), PoolError> {
        if self.pool.unpin(block)? == 0 {
            match self.pool.state(block) {
                Some(BlockState::Ready) => self.policy.insert(block),
                Some(BlockState::Detached) => self.pool.release(block)?,
                // A pending block's last pin is its store's; `publish`/`abort` handle it.
                _ => {}
            }
        }
        Ok(())
    }

    /// Takes a block for a new store of `key`, evicting the policy's victim block
    /// when none is free. The block comes back `Pending`, indexed (so the same key is
    /// not stored twice) and pinned by the store. `None` when every block is pinned or
    /// in flight, or when `key` is present already (see [`Self::reserve_key`]).
    pub fn reserve(&mut self, key: BlockKey) -> Option<BlockId> {
        match self.reserve_key(key) {
            Reservation::Reserved(block) => Some(block),
            Reservation::Present | Reservation::NoSpace => None,
        }
    }

    /// [`Self::reserve`], telling a key that is present already from a full pool. One
    /// index probe answers both whether the key is present and where it goes.
    pub fn reserve_key(&mut self, key: BlockKey) -> Reservation {
        let vacancy = match self.index.find_slot(&key) {
            Ok(at) => at,
            Err(_) => return Reservation::Present,
        };
        if self.pool.num_free() == 0 {
            let Some(victim) = self.policy.pop_victim() else {
                return Reservation::NoSpace;
            };
            // Changes the index: the insert below probes again (warm lines by now).
            self.drop_ready(victim);
        }
        let Some(block) = self.pool.alloc() else {
            return Reservation::NoSpace;
        };
        // The id came from the pool, so it is in range.
        let _ = self.pool.set_key(block, key);
        self.index.insert_vacant(vacancy, key, block);
        Reservation::Reserved(block)
    }

    /// Marks a completed store's block `Ready` and drops the store's pin.
    pub fn publish(&mut self, block: BlockId) -> Result<(), PoolError> {
        if self.pool.state(block) == Some(BlockState::Pending) {
            self.pool.set_state(block, BlockState::Ready)?;
        }
        self.unpin(block)
    }

    /// Drops a failed store's block from the index and releases the store's pin.
    pub fn abort(&mut self, block: BlockId) -> Result<(), PoolError> {
        if self.pool.state(block) == Some(BlockState::Pending) {
            self.detach(block)?;
        }
        self.unpin(block)
    }

    /// Drops a `Ready` block from the index so no lookup serves it again: a load from it
    /// failed, so neither its bytes nor the path to them can be trusted, and a request
    /// that would be offered it again could fail forever. An unpinned block is freed at
    /// once, a pinned one when its last pin drops. Other states are left alone.
    pub fn invalidate(&mut self, block: BlockId) -> Result<(), PoolError> {
        if self.pool.state(block) != Some(BlockState::Ready) {
            return Ok(());
        }
        if let Some(key) = self.pool.key(block) {
            self.events.push_removed(key.group, key.hash);
        }
        self.detach(block)?;
        if self.pool.ref_count(block) == Some(0) {
            self.policy.remove(block);
            self.pool.release(block)?;
        }
        Ok(())
    }

    /// Drops every block from the index: unpinned blocks are freed at once, pinned ones
    /// when their transfers finish. Nothing stored before the reset is served after it.
    pub fn clear(&mut self) {
        for block in 0..self.pool.capacity() {
            match (self.pool.state(block), self.pool.ref_count(block)) {
                (Some(BlockState::Ready), Some(0)) => {
                    self.policy.remove(block);
                    // In range and unpinned: release cannot fail.
                    let _ = self.pool.release(block);
                }
                (Some(BlockState::Ready | BlockState::Pending), _) => {
                    let _ = self.pool.set_state(block, BlockState::Detached);
                }
                _ => {}
            }
        }
        self.index.clear();
        self.policy.clear();
        self.events.push(KvEvent::AllCleared);
    }

    /// The event buffer (the planner adds store events).
    pub fn events_mut(&mut self) -> &mut EventBuffer {
        &mut self.events
    }

    /// Takes the buffered events.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        self.events.drain()
    }

    fn detach(&mut self, block: BlockId) -> Result<(), PoolError> {
        if let Some(key) = self.pool.key(block) {
            if self.index.get(&key) == Some(block) {
                self.index.remove(&key);
            }
        }
        self.pool.set_state(block, BlockState::Detached)
    }

    fn drop_ready(&mut self, victim: BlockId) {
        if let Some(key) = self.pool.key(victim) {
            self.index.remove(&key);
            self.events.push_removed(key.group, key.hash);
        }
        self.evicted += 1;
        // Victims come from the policy, which only holds unpinned ready blocks.
        let _ = self.pool.set_state(victim, BlockState::Detached);
        let _ = self.pool.release(victim);
    }

    /// Checks every invariant in the module docs; for tests and debug assertions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut indexed = 0usize;
        let mut free = 0usize;
        for b in 0..self.pool.capacity() {
            let state = self.pool.state(b).ok_or("state out of range")?;
            let refs = self.pool.ref_count(b).ok_or("ref count out of range")?;
            let key = self.pool.key(b).ok_or("key out of range")?;
            let in_index = self.index.get(&key) == Some(b);
            let evictable = self.policy.contains(b);
            match state {
                BlockState::Free => {
                    free += 1;
                    if refs != 0 || in_index || evictable {
                        return Err(format!("free block {b}: refs {refs}, indexed {in_index}, evictable {evictable}"));
                    }
                }
                BlockState::Pending => {
                    indexed += 1;
                    if refs == 0 || !in_index || evictable {
                        return Err(format!("pending block {b}: refs {refs}, indexed {in_index}, evictable {evictable}"));
                    }
                }
                BlockState::Ready => {
                    indexed += 1;
                    if !in_index || evictable != (refs == 0) {
                        return Err(format!("ready block {b}: refs {refs}, indexed {in_index}, evictable {evictable}"));
                    }
                }
                BlockState::Detached => {
                    if refs == 0 || in_index || evictable {
                        return Err(format!("detached block {b}: refs {refs}, indexed {in_index}, evictable {evictable}"));
                    }
                }
            }
        }
        if indexed != self.index.len() {
            return Err(format!(
                "index holds {} keys but {indexed} blocks are indexed",
                self.index.len()
            ));
        }
        if free != self.pool.num_free() {
            return Err(format!(
                "{free} free blocks but free list holds {}",
                self.pool.num_free()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
