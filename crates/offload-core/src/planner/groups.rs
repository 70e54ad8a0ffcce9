//! Several KV-cache groups (vLLM's hybrid allocator): each group has its own GPU block
//! table per request and its own CPU blocks, keyed by `(group, hash)`.
//!
//! What a group needs differs by kind:
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
//!
//! The single-group planner ([`Planner::new`]) never comes here.

use crate::cache::BlockCache;
use crate::error::PlanError;
use crate::events::PlannerStats;
use crate::key::{BlockHash, BlockId, BlockKey};

use super::request::{Hit, Request};
use super::select::{PendingStore, StoreEntry};
use super::types::{HashSource, ScheduledRequest};
use super::{live_entry, Planner, PlannerConfig};

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

    /// Whether the group holds every block of a request, so a hit needs all of them.
    fn keeps_every_block(self) -> bool {
        self == Self::FullAttention
    }
}

/// One scheduled request of a step, with a block table per KV-cache group (see
/// [`ScheduledRequest`], whose `gpu_blocks` is group 0's table). Positions a
/// sliding-window group does not hold carry the server's null block id; they are never
/// read.
pub type ScheduledGroups<'a, H> = ScheduledRequest<'a, H, Vec<Vec<u32>>>;

impl<'a, H> From<ScheduledRequest<'a, H>> for ScheduledGroups<'a, H> {
    /// The request with its one block table.
    fn from(s: ScheduledRequest<'a, H>) -> Self {
        Self {
            req_id: s.req_id,
            kind: s.kind,
            num_computed_tokens: s.num_computed_tokens,
            num_scheduled_tokens: s.num_scheduled_tokens,
            gpu_blocks: vec![s.gpu_blocks],
            hashes: s.hashes,
        }
    }
}

/// A request's blocks in one group.
#[derive(Debug, Default, Clone)]
pub(super) struct GroupBlocks {
    pub(super) gpu_blocks: Vec<u32>,
    /// Blocks before this index were considered for storing already.
    pub(super) stored_upto: usize,
}

/// The pinned part of a hit in one group: CPU blocks for positions `from..`.
#[derive(Debug, Default, Clone)]
pub(super) struct GroupHit {
    pub(super) from: usize,
    pub(super) blocks: Vec<BlockId>,
}

impl GroupHit {
    fn get(&self, pos: usize) -> Option<BlockId> {
        self.blocks.get(pos.checked_sub(self.from)?).copied()
    }
}

impl Planner {
    /// A planner for a model with several KV-cache groups, `groups[g]` being group `g`'s
    /// kind. One full-attention group is the single-group planner of [`Self::new`].
    ///
    /// # Examples
    /// A full-attention group and a sliding-window group of 32 tokens: a hit of 3 blocks
    /// needs all 3 full-attention blocks but only the sliding-window blocks of its
    /// window (the last 2).
    /// ```
    /// use offload_core::{BlockHash, GroupKind, Planner, PlannerConfig};
    ///
    /// let groups = [GroupKind::FullAttention, GroupKind::SlidingWindow { window: 32 }];
    /// let planner = Planner::with_groups(PlannerConfig::new(16, 64), &groups);
    /// assert_eq!(planner.groups(), &groups);
    /// assert_eq!(groups[1].skipped_blocks(48, 16), 1);
    /// ```
    pub fn with_groups(cfg: PlannerConfig, groups: &[GroupKind]) -> Self {
        let mut planner = Self::new(cfg);
        if groups != [GroupKind::FullAttention] && !groups.is_empty() {
            planner.groups = Some(groups.into());
        }
        planner
    }

    /// The KV-cache groups' kinds (one full-attention group for [`Self::new`]).
    pub fn groups(&self) -> &[GroupKind] {
        self.groups
            .as_deref()
            .unwrap_or(&[GroupKind::FullAttention])
    }

    /// [`Self::schedule`] with a block table per group.
    ///
    /// Eager mode stores, per group, the confirmed blocks the request still holds: a
    /// sliding-window group's blocks before the window of `num_computed_tokens` were
    /// freed by the server in this step's allocation and are skipped. When stores run
    /// while later steps may reuse blocks (without
    /// [`PlannerConfig::stores_after_forward`]), sliding-window blocks the store reads
    /// are listed in [`StepPlan::held_gpu_blocks`](super::StepPlan): the server frees
    /// them from running requests, so the caller keeps them until
    /// [`Completions::released_gpu_blocks`](super::Completions) names them.
    pub fn schedule_groups<'a, H: HashSource>(
        &mut self,
        scheduled: impl IntoIterator<Item = ScheduledGroups<'a, H>>,
        lazy_candidates: impl IntoIterator<Item = super::LazyCandidate>,
    ) -> Result<super::StepPlan, PlanError> {
        if self.groups.is_none() {
            let single = scheduled.into_iter().map(|s| {
                let mut blocks = s.gpu_blocks;
                ScheduledRequest {
                    req_id: s.req_id,
                    kind: s.kind,
                    num_computed_tokens: s.num_computed_tokens,
                    num_scheduled_tokens: s.num_scheduled_tokens,
                    gpu_blocks: if blocks.is_empty() {
                        Vec::new()
                    } else {
                        blocks.swap_remove(0)
                    },
                    hashes: s.hashes,
                }
            });
            return self.schedule_rows(single, lazy_candidates);
        }
        self.schedule_rows(scheduled, lazy_candidates)
    }

    /// [`Self::on_alloc`] with the request's block table per group (`gpu_blocks[g]`
    /// from token 0, null blocks included).
    ///
    /// The load copies, in every group, each block vLLM allocated for the accepted
    /// tokens: all of them in full-attention groups, those inside the window of the
    /// hit's end in sliding-window groups, the block ending at the hit's end in Mamba
    /// groups (vLLM allocates that one, and nulls the earlier ones). If the scheduler
    /// accepted fewer tokens than offered, a sliding-window group's window moves before
    /// the pinned blocks; a block the hit did not pin makes the load invalid (reported
    /// failed, recomputed).
    pub fn on_alloc_groups<B: AsRef<[u32]>>(
        &mut self,
        req: &str,
        gpu_blocks: &[B],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> Result<(), PlanError> {
        let Some(kinds) = self.groups.clone() else {
            let group0: &[u32] = gpu_blocks.first().map_or(&[], AsRef::as_ref);
            if gpu_blocks.len() > 1 {
                return Err(PlanError::GroupMismatch {
                    req_id: req.to_string(),
                    expected: 1,
                    got: gpu_blocks.len(),
                });
            }
            return self.on_alloc(req, group0, num_computed_tokens, num_external_tokens);
        };
        let bs = self.block_size();
        if num_external_tokens == 0 {
            if let Some(r) = self.requests.get_mut(req) {
                r.release_hit(&mut self.cache);
            }
            return Ok(());
        }
        if gpu_blocks.len() != kinds.len() {
            return Err(PlanError::GroupMismatch {
                req_id: req.to_string(),
                expected: kinds.len(),
                got: gpu_blocks.len(),
            });
        }
        let r = self
            .requests
            .get_mut(req)
            .ok_or_else(|| PlanError::UnknownRequest(req.to_string()))?;
        let hit = r.hit.take().unwrap_or_default();
        let start = if hit.groups.is_empty() {
            num_computed_tokens / bs
        } else {
            hit.start
        };
        let end = start + num_external_tokens.div_ceil(bs);
        let mut gpu = Vec::new();
        let mut cpu = Vec::new();
        let mut valid = num_external_tokens % bs == 0 && hit.groups.len() == kinds.len();
        if valid {
            'groups: for ((kind, ghit), table) in kinds.iter().zip(&hit.groups).zip(gpu_blocks) {
                let table = table.as_ref();
                for i in start.max(kind.skipped_blocks(end * bs, bs))..end {
                    match (ghit.get(i), table.get(i)) {
                        (Some(c), Some(&g)) if self.cache.is_ready(c) => {
                            cpu.push(c);
                            gpu.push(g);
                        }
                        _ => {
                            valid = false;
                            break 'groups;
                        }
                    }
                }
            }
        }
        if !valid {
            log::warn!(
                "kvoffload: load of {num_external_tokens} tokens for request {req} has no \
                 matching CPU hit in every KV-cache group; reporting it failed so it is \
                 recomputed"
            );
            gpu.clear();
            cpu.clear();
            // Every group's blocks of the accepted range, so the server recomputes them all.
            for (kind, table) in kinds.iter().zip(gpu_blocks) {
                let from = start.max(kind.skipped_blocks(end * bs, bs));
                gpu.extend(table.as_ref().get(from..end).unwrap_or_default());
            }
        }
        let mut used = cpu.clone();
        used.sort_unstable();
        for b in hit.blocks {
            if used.binary_search(&b).is_err() {
                let _ = self.cache.unpin(b);
            }
        }
        self.push_load(req, gpu, cpu, valid, num_external_tokens);
        Ok(())
    }

    /// The multi-group lookup behind [`Self::lookup`]: always fresh (the pinned result of
    /// an earlier call is released first), never answered from a cached run.
    pub(super) fn lookup_groups<H: HashSource + ?Sized>(
        &mut self,
        req: &str,
        hashes: &H,
        num_tokens: usize,
        num_computed_tokens: usize,
        kinds: &[GroupKind],
    ) -> Result<usize, PlanError> {
        let bs = self.block_size();
        self.stats.lookups += 1;
        let r = live_entry(&mut self.requests, &mut self.next_serial, req);
        r.release_hit(&mut self.cache);
        if num_computed_tokens % bs != 0 || self.cache.capacity() == 0 {
            return Ok(0);
        }
        let bad = |source| PlanError::BadHash {
            req_id: req.to_string(),
            source,
        };
        let start = num_computed_tokens / bs;
        let need = num_tokens.saturating_sub(1) / bs;
        let limit = r
            .verify(hashes, need, &mut self.cache, &mut self.stats)
            .map_err(bad)?;
        // Full-attention groups bound the hit by their longest stored run; hashes are read
        // only that far.
        let mut hs: Vec<BlockHash> = Vec::new();
        let mut end = limit;
        for (g, kind) in kinds.iter().enumerate() {
            if !kind.keeps_every_block() {
                continue;
            }
            let mut i = start;
            while i < end {
                let h = match hs.get(i - start) {
                    Some(h) => *h,
                    None => {
                        let h = r.hash_at(hashes, i).map_err(bad)?;
                        hs.push(h);
                        h
                    }
                };
                if self
                    .cache
                    .get_ready(&BlockKey::new(group_id(g), h))
                    .is_none()
                {
                    break;
                }
                i += 1;
            }
            end = i;
        }
        for i in start + hs.len()..end {
            hs.push(r.hash_at(hashes, i).map_err(bad)?);
        }
        hs.truncate(end.saturating_sub(start));
        // Per sliding-window or Mamba group, where the blocks found are; then the longest
        // `n` whose window (or state at `n`) every group has.
        let found: Vec<Vec<Option<BlockId>>> = kinds
            .iter()
            .enumerate()
            .map(|(g, kind)| {
                if kind.keeps_every_block() {
                    return Vec::new();
                }
                hs.iter()
                    .map(|h| self.cache.get_ready(&BlockKey::new(group_id(g), *h)))
                    .collect()
            })
            .collect();
        let window_ok = |n: usize| {
            kinds.iter().zip(&found).all(|(kind, f)| {
                kind.keeps_every_block()
                    || (start.max(kind.skipped_blocks(n * bs, bs))..n)
                        .all(|i| f[i - start].is_some())
            })
        };
        let Some(n) = (start + 1..=end).rev().find(|&n| window_ok(n)) else {
            return Ok(0);
        };
        let mut hit = Hit {
            start,
            num_tokens,
            blocks: Vec::new(),
            last: hs.get(n - start - 1).copied(),
            groups: Vec::with_capacity(kinds.len()),
        };
        for (g, (kind, f)) in kinds.iter().zip(&found).enumerate() {
            let from = start.max(kind.skipped_blocks(n * bs, bs));
            let blocks: Vec<BlockId> = (from..n)
                .filter_map(|i| {
                    if kind.keeps_every_block() {
                        self.cache
                            .get_ready(&BlockKey::new(group_id(g), hs[i - start]))
                    } else {
                        f[i - start]
                    }
                })
                .collect();
            hit.groups.push(GroupHit { from, blocks });
        }
        for gh in &hit.groups {
            for &b in &gh.blocks {
                // The block is ready, hence in range and pinnable.
                let _ = self.cache.pin(b);
                hit.blocks.push(b);
            }
        }
        r.hit = Some(hit);
        Ok((n - start) * bs)
    }
}

/// Group `g`'s id in index keys.
fn group_id(g: usize) -> u32 {
    u32::try_from(g).unwrap_or(u32::MAX)
}

/// [`super::select::select_eager`] for every group of a multi-group request: per group,
/// its blocks from where it stopped (and from the first block it still holds) up to
/// `confirmed`; in a Mamba group only the block ending where the last computed chunk
/// ended (`Request::state_tokens`), if that is a block boundary: every other block of
/// the range is null, a running state or freed. With `hold`, blocks of groups that
/// free blocks from running requests go to the store's held blocks.
#[allow(clippy::too_many_arguments)]
pub(super) fn select_groups(
    req: &str,
    r: &mut Request,
    confirmed: usize,
    kinds: &[GroupKind],
    bs: usize,
    hold: bool,
    cache: &mut BlockCache,
    pending: &mut PendingStore,
    stats: &mut PlannerStats,
) -> bool {
    let confirmed = confirmed.min(r.hashes.len());
    let slot = pending.slot(req, r.serial, r.queued);
    let mut selected = false;
    r.groups.resize_with(kinds.len(), GroupBlocks::default);
    for (g, (kind, gb)) in kinds.iter().zip(r.groups.iter_mut()).enumerate() {
        let upto = confirmed.min(gb.gpu_blocks.len());
        let held_from = match kind {
            GroupKind::Mamba => r.state_tokens,
            _ => r.alloc_tokens,
        };
        let from = gb.stored_upto.max(kind.skipped_blocks(held_from, bs));
        for i in from..upto {
            let key = BlockKey::new(group_id(g), r.hashes[i]);
            if cache.contains(&key) {
                stats.dedup_skipped += 1;
                continue;
            }
            let Some(block) = cache.reserve(key) else {
                stats.no_space_skipped += (upto - i) as u64;
                break;
            };
            let gpu = gb.gpu_blocks[i];
            pending.entries.push(StoreEntry {
                block,
                hash: r.hashes[i],
                parent: i.checked_sub(1).map(|p| r.hashes[p]),
                source: slot.and_then(|s| Some((u32::try_from(s).ok()?, u32::try_from(i).ok()?))),
            });
            pending.push_group(group_id(g));
            pending.gpu_blocks.push(gpu);
            if hold && !kind.keeps_every_block() {
                pending.held.push(gpu);
            }
            selected = true;
        }
        gb.stored_upto = gb.stored_upto.max(upto);
    }
    if selected && !r.queued {
        r.queued = true;
        r.stores_in_flight += 1;
        pending.req_ids.push((req.to_string(), r.serial));
    }
    r.queued
}
