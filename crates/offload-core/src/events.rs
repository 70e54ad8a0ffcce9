//! KV events (what entered and left the CPU tier) and the planner's counters.

use crate::key::BlockHash;

/// A change to the set of blocks held on CPU, in the shape of vLLM's KV events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// A chain of blocks became available on CPU (their stores completed on every rank).
    Stored {
        /// KV-cache group.
        group: u32,
        /// The blocks' hashes, in chain order.
        hashes: Vec<BlockHash>,
        /// The hash of the block before the first one, when the chain does not start a prompt.
        parent: Option<BlockHash>,
        /// Tokens per block; the chain covers `hashes.len() * block_size` tokens.
        block_size: u32,
    },
    /// Blocks were evicted from CPU.
    Removed {
        /// KV-cache group.
        group: u32,
        /// The evicted blocks' hashes.
        hashes: Vec<BlockHash>,
    },
    /// Every block was dropped (`reset_cache`).
    AllCleared,
}

/// Buffers events until the caller drains them; off unless the caller asks for events,
/// so an engine that never drains does not grow memory.
#[derive(Debug, Clone, Default)]
pub struct EventBuffer {
    enabled: bool,
    events: Vec<KvEvent>,
}

impl EventBuffer {
    /// A buffer that records events only when `enabled`.
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            events: Vec::new(),
        }
    }

    /// Whether events are recorded.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records an event.
    pub fn push(&mut self, event: KvEvent) {
        if self.enabled {
            self.events.push(event);
        }
    }

    /// Records the eviction of `hash`, merging with a directly preceding removal in
    /// the same group so a burst of evictions is one event.
    pub fn push_removed(&mut self, group: u32, hash: BlockHash) {
        if !self.enabled {
            return;
        }
        if let Some(KvEvent::Removed { group: g, hashes }) = self.events.last_mut() {
            if *g == group {
                hashes.push(hash);
                return;
            }
        }
        self.events.push(KvEvent::Removed {
            group,
            hashes: vec![hash],
        });
    }

    /// Takes every buffered event, oldest first.
    pub fn drain(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}

/// Groups blocks published one after another into chained [`KvEvent::Stored`] events:
/// a block whose parent is the previous block's hash extends the current event.
#[derive(Debug)]
pub(crate) struct StoredChain {
    group: u32,
    block_size: u32,
    current: Option<(Vec<BlockHash>, Option<BlockHash>)>,
}

impl StoredChain {
    pub(crate) fn new(group: u32, block_size: u32) -> Self {
        Self {
            group,
            block_size,
            current: None,
        }
    }

    /// Adds a published block (`parent`: the hash of the block before it in its request).
    pub(crate) fn push(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        out: &mut EventBuffer,
    ) {
        match &mut self.current {
            Some((hashes, _)) if parent.is_some() && hashes.last().copied() == parent => {
                hashes.push(hash);
            }
            _ => {
                self.flush(out);
                self.current = Some((vec![hash], parent));
            }
        }
    }

    /// The group whose blocks this chain collects.
    pub(crate) fn group(&self) -> u32 {
        self.group
    }

    /// Emits the chain being built.
    pub(crate) fn flush(&mut self, out: &mut EventBuffer) {
        if let Some((hashes, parent)) = self.current.take() {
            out.push(KvEvent::Stored {
                group: self.group,
                hashes,
                parent,
                block_size: self.block_size,
            });
        }
    }
}

/// Monotonic counters of the scheduler-side planner.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlannerStats {
    /// Prefix lookups answered (cached answers included).
    pub lookups: u64,
    /// Prefix lookups answered from a request's cached result.
    pub cached_lookups: u64,
    /// Tokens the scheduler accepted to load from CPU.
    pub hit_tokens: u64,
    /// Blocks in issued loads.
    pub load_blocks: u64,
    /// Blocks in issued stores.
    pub store_blocks: u64,
    /// Blocks published after every rank stored them.
    pub stored_blocks: u64,
    /// Candidate blocks skipped because they were on CPU or in flight already.
    pub dedup_skipped: u64,
    /// Candidate blocks skipped because every CPU block was pinned or in flight.
    pub no_space_skipped: u64,
    /// Blocks evicted to make room.
    pub evicted_blocks: u64,
    /// Load transfers that failed on some rank.
    pub failed_loads: u64,
    /// Store transfers that failed on some rank.
    pub failed_stores: u64,
    /// Times a request's block hashes were found rewritten (truncated and regrown with
    /// other content) and the planner forgot what it knew past the common prefix.
    pub rewritten_hash_lists: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_buffer_records_nothing() {
        let mut buf = EventBuffer::new(false);
        buf.push(KvEvent::AllCleared);
        buf.push_removed(0, BlockHash(1));
        assert!(buf.drain().is_empty());
    }

    #[test]
    fn consecutive_removals_merge_per_group() {
        let mut buf = EventBuffer::new(true);
        buf.push_removed(0, BlockHash(1));
        buf.push_removed(0, BlockHash(2));
        buf.push_removed(1, BlockHash(3));
        buf.push(KvEvent::AllCleared);
        buf.push_removed(0, BlockHash(4));
        let events = buf.drain();
        assert_eq!(
            events,
            vec![
                KvEvent::Removed {
                    group: 0,
                    hashes: vec![BlockHash(1), BlockHash(2)]
                },
                KvEvent::Removed {
                    group: 1,
                    hashes: vec![BlockHash(3)]
                },
                KvEvent::AllCleared,
                KvEvent::Removed {
                    group: 0,
                    hashes: vec![BlockHash(4)]
                },
            ]
        );
        assert!(buf.drain().is_empty());
    }
}
