//! The rule object of each KV-cache group kind: which blocks of a request a group keeps,
//! and so which blocks a hit needs and which blocks may be stored.
//!
//! A model is a list of KV-cache groups (vLLM's hybrid allocator); a dense model is one
//! full-attention group. Every group has its own GPU block table per request and its own
//! CPU blocks, keyed by `(group, hash)`. What a group needs differs by kind:
//! - full attention keeps every block of a request for its whole life; a CPU hit is the
//!   longest run of stored blocks after the GPU hit;
//! - sliding window attends only to the last `window` tokens: vLLM frees the blocks that
//!   fall out of the window from a running request's table (its null block takes their
//!   place), and allocates a request with a prefix hit of `T` tokens no block before the
//!   window of `T`. So a hit ending at block `n` needs only the blocks inside that window,
//!   and a block is stored only while the request still holds it;
//! - Mamba (vLLM's `mamba_cache_mode="align"`: Mamba, Gated DeltaNet) keeps one state per
//!   block: once a request has computed `(i + 1) * block_size` tokens, its block `i` holds
//!   the state after exactly those tokens, written where a computed chunk ended (vLLM
//!   ends prefill chunks on block boundaries for this). Blocks whose boundary no chunk
//!   ended at are the null block, and vLLM frees a state once the next one is written.
//!   So a hit ending at block `n` needs only block `n - 1` (the state at the hit
//!   boundary), and a block is stored only at the step whose chunk ended on its
//!   boundary: earlier it holds a running state, later it may be freed or null.
//!
//! A hit must be one every group can serve: its length is the longest `n` at which every
//! full-attention group has all blocks after the GPU hit, every sliding-window group
//! the blocks of its window and every Mamba group the state at `n`. Loads copy every
//! block vLLM allocated for the hit (and no null block); a GPU block id names the same
//! bytes whatever group owns it, so workers copy blocks without knowing their group.

/// The kind of a KV-cache group: which blocks of a request it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GroupKind {
    /// Every block stays in the request's table until it finishes (vLLM's full
    /// attention and MLA).
    FullAttention,
    /// Attends to the last `window` tokens (vLLM's `sliding_window` plus its
    /// `extra_retained_tokens`); earlier blocks are freed from a running request.
    SlidingWindow {
        /// Tokens a request keeps KV for: the next token attends to the last
        /// `window - 1` computed ones.
        window: u32,
    },
    /// One recurrent state per block, the state after the block's last token (vLLM's
    /// Mamba-kind groups in `mamba_cache_mode="align"`, without speculative or
    /// prefill-checkpoint blocks); a request holds the state of its last computed
    /// block boundary only.
    Mamba,
}

impl GroupKind {
    /// Leading blocks of a request with `tokens` computed that the group no longer holds
    /// (vLLM's `get_num_skipped_tokens`, in whole blocks).
    pub fn skipped_blocks(self, tokens: usize, block_size: usize) -> usize {
        match self {
            Self::FullAttention => 0,
            Self::SlidingWindow { window } => {
                tokens.saturating_sub((window as usize).saturating_sub(1)) / block_size.max(1)
            }
            // vLLM keeps the state of the last computed token: the block ending at
            // `tokens` if `tokens` is a block boundary, no earlier one.
            Self::Mamba => tokens.saturating_sub(1) / block_size.max(1),
        }
    }

    /// Whether the group holds every block of a request, so a hit needs all of them and
    /// a pinned hit stays one when the GPU hit grows or the run is extended.
    pub(super) fn keeps_every_block(self) -> bool {
        self == Self::FullAttention
    }

    /// The first block a hit ending at block `end` (after a GPU hit of `start` blocks)
    /// needs in this group: the group's blocks of the hit are `first..end`.
    pub(super) fn first_needed(self, start: usize, end: usize, block_size: usize) -> usize {
        start.max(self.skipped_blocks(end * block_size, block_size))
    }

    /// The first block the request still holds in this group, given the tokens computed
    /// when the server last allocated for it and the tokens through which its last
    /// computed chunk ran (where a Mamba group last wrote a state).
    pub(super) fn first_held(self, alloc_tokens: usize, state_tokens: usize, bs: usize) -> usize {
        match self {
            Self::Mamba => self.skipped_blocks(state_tokens, bs),
            _ => self.skipped_blocks(alloc_tokens, bs),
        }
    }

    /// Whether the server frees this group's blocks from running requests, so a store
    /// that may run after the next allocation holds the blocks it reads.
    pub(super) fn frees_running_blocks(self) -> bool {
        !self.keeps_every_block()
    }
}

/// Group `g`'s id in index keys.
pub(super) fn group_id(g: usize) -> u32 {
    u32::try_from(g).unwrap_or(u32::MAX)
}
