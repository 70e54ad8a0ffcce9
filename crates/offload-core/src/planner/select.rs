//! Which GPU blocks to store: eager (every newly confirmed block of a running request)
//! and lazy (blocks about to be evicted from the GPU).

use crate::cache::{BlockCache, Reservation};
use crate::events::PlannerStats;
use crate::key::{BlockHash, BlockId, BlockKey};

use super::kinds::{group_id, GroupKind};
use super::request::Request;
use super::types::LazyCandidate;

/// One block of the store job being assembled.
#[derive(Debug, Clone, Copy)]
pub(super) struct StoreEntry {
    pub(super) block: BlockId,
    pub(super) hash: BlockHash,
    pub(super) parent: Option<BlockHash>,
    /// Where the block comes from: its request's index in the job's `req_ids` and its
    /// position in that request; `None` for a lazy candidate (no request).
    pub(super) source: Option<(u32, u32)>,
}

/// The store job being assembled for the next step.
#[derive(Debug, Default)]
pub(super) struct PendingStore {
    pub(super) entries: Vec<StoreEntry>,
    pub(super) gpu_blocks: Vec<u32>,
    /// Requests whose blocks are read, with their serials.
    pub(super) req_ids: Vec<(String, u64)>,
    pub(super) flush_req_ids: Vec<String>,
    /// GPU blocks the caller must keep until the store retires (eager stores of blocks
    /// the server frees from running requests).
    pub(super) held: Vec<u32>,
    /// GPU blocks [`Planner::offer_lazy`](super::Planner::offer_lazy) selected: the
    /// caller holds them from the offer on, and gets them back when the store retires.
    pub(super) offered: Vec<u32>,
    /// The entries' KV-cache groups, see [`group_of`]: kept apart from the entries, and
    /// empty while every group is 0, so a store of group 0 alone carries nothing more.
    pub(super) groups: Vec<u32>,
}

impl PendingStore {
    /// The request's index in `req_ids`: where it is if already queued, or where it will
    /// be pushed. `None` if a queued request is missing (a broken invariant, not input).
    pub(super) fn slot(&self, req: &str, serial: u64, queued: bool) -> Option<usize> {
        if queued {
            self.req_ids
                .iter()
                .position(|(q, s)| q == req && *s == serial)
        } else {
            Some(self.req_ids.len())
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records the group of the entry just pushed.
    pub(super) fn push_group(&mut self, group: u32) {
        if group != 0 {
            self.groups.resize(self.entries.len().saturating_sub(1), 0);
            self.groups.push(group);
        }
    }
}

/// Entry `i`'s KV-cache group in a job's `groups` (entries past its end are group 0).
pub(super) fn group_of(groups: &[u32], i: usize) -> u32 {
    groups.get(i).copied().unwrap_or(0)
}

/// Selects `r`'s blocks up to `confirmed` that are neither on CPU nor in flight into the
/// store job being assembled: per group, its blocks from where it stopped (and from the
/// first block it still holds, see [`GroupKind`]). The caller synced `r.hashes` up to
/// `confirmed` just before. With `hold` (the server may reuse blocks it frees before
/// the store runs), blocks of groups that free blocks from running requests go to the
/// store's held blocks. Returns whether `r` now has a store in the pending job.
#[allow(clippy::too_many_arguments)]
pub(super) fn select_eager(
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
    if r.groups.len() != kinds.len() {
        r.groups.resize(kinds.len());
    }
    let mut selected = false;
    // The request's index in the job's `req_ids`, found once it has a block to store.
    let mut slot = None;
    for (g, (kind, gb)) in kinds.iter().zip(r.groups.iter_mut()).enumerate() {
        let upto = confirmed.min(gb.gpu_blocks.len());
        let from = gb
            .stored_upto
            .max(kind.first_held(r.alloc_tokens, r.state_tokens, bs));
        gb.stored_upto = gb.stored_upto.max(upto);
        if from >= upto {
            continue;
        }
        let slot = *slot.get_or_insert_with(|| pending.slot(req, r.serial, r.queued));
        let group = group_id(g);
        // A prefill confirms a whole prompt at once: grow the job's lists once, not by
        // doubling.
        pending.entries.reserve(upto - from);
        pending.gpu_blocks.reserve(upto - from);
        for h in &r.hashes[from..upto] {
            cache.prefetch_key(&BlockKey::new(group, *h));
        }
        for i in from..upto {
            let key = BlockKey::new(group, r.hashes[i]);
            match cache.reserve_key(key) {
                Reservation::Present => stats.dedup_skipped += 1,
                Reservation::Reserved(block) => {
                    pending.entries.push(StoreEntry {
                        block,
                        hash: r.hashes[i],
                        parent: i.checked_sub(1).map(|p| r.hashes[p]),
                        source: slot
                            .and_then(|s| Some((u32::try_from(s).ok()?, u32::try_from(i).ok()?))),
                    });
                    pending.push_group(group);
                    let gpu = gb.gpu_blocks[i];
                    pending.gpu_blocks.push(gpu);
                    if hold && kind.frees_running_blocks() {
                        pending.held.push(gpu);
                    }
                    selected = true;
                }
                Reservation::NoSpace => {
                    // Every CPU block is pinned or in flight; the rest would not fit either.
                    stats.no_space_skipped += (upto - i) as u64;
                    break;
                }
            }
        }
    }
    // A request selected twice in one step (scheduled, then finished) joins the step's
    // store job once; its in-flight count is per job.
    if selected && !r.queued {
        r.queued = true;
        r.stores_in_flight += 1;
        pending.req_ids.push((req.to_string(), r.serial));
    }
    r.queued
}

/// Lazy mode: considers GPU blocks about to be evicted, in the order given (least
/// recently used first), and selects those not on CPU or in flight. Returns the
/// selected GPU block ids.
pub(super) fn select_lazy(
    candidates: &[LazyCandidate],
    cache: &mut BlockCache,
    pending: &mut PendingStore,
    stats: &mut PlannerStats,
) -> Vec<u32> {
    let n = candidates.len();
    let mut chosen = Vec::with_capacity(n);
    // A burst of freed blocks is a few hundred candidates: grow the job's lists once.
    pending.entries.reserve(n);
    pending.gpu_blocks.reserve(n);
    for (_, key) in candidates {
        cache.prefetch_key(key);
    }
    for &(gpu, key) in candidates {
        let block = match cache.reserve_key(key) {
            Reservation::Reserved(block) => block,
            Reservation::Present => {
                stats.dedup_skipped += 1;
                continue;
            }
            Reservation::NoSpace => {
                stats.no_space_skipped += 1;
                break;
            }
        };
        pending.entries.push(StoreEntry {
            block,
            hash: key.hash,
            parent: None,
            source: None,
        });
        pending.push_group(key.group);
        pending.gpu_blocks.push(gpu);
        chosen.push(gpu);
    }
    chosen
}
