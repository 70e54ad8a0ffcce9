//! Planner fixtures: a planner with the tests' geometry, hash families, the protocol's
//! calls in one line each, and read-only probes of the CPU pool.

use std::hash::{DefaultHasher, Hash, Hasher};

use offload_core::GroupKind;
use offload_core::{
    BlockHash, BlockKey, KvEvent, Planner, PlannerConfig, ScheduleKind, ScheduledGroups,
    ScheduledRequest, StepPlan, StoreJob, TransferId,
};

/// Tokens per block.
pub const BS: usize = 16;

/// An eager or lazy planner over `world` ranks with `blocks` CPU blocks and KV events on.
pub fn planner(blocks: u32, world: u32, lazy: bool) -> Planner {
    Planner::new(
        PlannerConfig::new(BS as u32, blocks)
            .with_world_size(world)
            .with_lazy(lazy)
            .with_events(true),
        &[GroupKind::FullAttention],
    )
}

/// `n` block hashes of prompt family `family`: two families never share a hash. Readable
/// in assertions; a list mixing families is not chained (see [`chained`]).
pub fn hashes(family: u128, n: u128) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash(family * 1000 + i)).collect()
}

/// The chained hashes of blocks with `content`, after the block hashed `parent`: each
/// covers its block and every block before it, as a server's hashes do, so two lists
/// share a hash only where they share the whole prefix.
pub fn chained(
    parent: Option<BlockHash>,
    content: impl IntoIterator<Item = u64>,
) -> Vec<BlockHash> {
    let mut prev = parent;
    content
        .into_iter()
        .map(|c| {
            let mut h = DefaultHasher::new();
            (prev, c).hash(&mut h);
            let next = BlockHash(u128::from(h.finish()));
            prev = Some(next);
            next
        })
        .collect()
}

/// The index key of `hash` in the planner's group.
pub fn key(hash: BlockHash) -> BlockKey {
    BlockKey::new(0, hash)
}

/// A scheduled request whose hashes the server holds in a slice.
pub type Sched<'a> = ScheduledRequest<'a, &'a [BlockHash]>;

/// `req` scheduled for the first time with its whole block table `gpu`, `computed`
/// tokens being its GPU prefix hit.
pub fn new_req<'a>(
    req: &'a str,
    computed: usize,
    gpu: &[u32],
    hashes: &'a [BlockHash],
) -> Sched<'a> {
    sched(req, ScheduleKind::New, computed, gpu, hashes)
}

/// `req` scheduled again after a preemption with its whole new block table `gpu`.
pub fn resumed<'a>(
    req: &'a str,
    computed: usize,
    gpu: &[u32],
    hashes: &'a [BlockHash],
) -> Sched<'a> {
    sched(req, ScheduleKind::Resumed, computed, gpu, hashes)
}

/// `req` running on from the previous step with `computed` tokens done before this step
/// and `added` GPU blocks allocated for it this step.
pub fn running<'a>(
    req: &'a str,
    computed: usize,
    added: &[u32],
    hashes: &'a [BlockHash],
) -> Sched<'a> {
    sched(req, ScheduleKind::Running, computed, added, hashes)
}

fn sched<'a>(
    req: &'a str,
    kind: ScheduleKind,
    computed: usize,
    gpu: &[u32],
    hashes: &'a [BlockHash],
) -> Sched<'a> {
    ScheduledRequest {
        req_id: req,
        kind,
        num_computed_tokens: computed,
        num_scheduled_tokens: 0,
        gpu_blocks: gpu.to_vec(),
        hashes,
    }
}

/// A scheduled request of a multi-group planner: a block table per group.
pub type GroupSched<'a> = ScheduledGroups<'a, &'a [BlockHash]>;

/// `req` scheduled as `kind` with `computed` tokens done before this step, `scheduled`
/// computed by it, and a (whole or added) block table per group.
pub fn sched_groups<'a>(
    req: &'a str,
    kind: ScheduleKind,
    computed: usize,
    scheduled: usize,
    gpu: &[&[u32]],
    hashes: &'a [BlockHash],
) -> GroupSched<'a> {
    ScheduledGroups {
        req_id: req,
        kind,
        num_computed_tokens: computed,
        num_scheduled_tokens: scheduled,
        gpu_blocks: gpu.iter().map(|g| g.to_vec()).collect(),
        hashes,
    }
}

/// One engine step of a multi-group planner with `reqs` scheduled and no lazy candidates.
pub fn step_groups<'a>(
    p: &mut Planner,
    reqs: impl IntoIterator<Item = GroupSched<'a>>,
) -> StepPlan {
    p.schedule(reqs, []).expect("a step with readable hashes")
}

/// One engine step with `reqs` scheduled and no lazy candidates.
pub fn step<'a>(p: &mut Planner, reqs: impl IntoIterator<Item = Sched<'a>>) -> StepPlan {
    p.schedule(reqs, []).expect("a step with readable hashes")
}

/// One engine step that schedules no request (the plan carries what was chosen since
/// the previous step: accepted loads, finished requests' flushes).
pub fn idle_step(p: &mut Planner) -> StepPlan {
    step(p, [])
}

/// Every rank reports transfer `id` done.
pub fn complete_on_every_rank(p: &mut Planner, id: TransferId) {
    for _ in 0..p.config().world_size {
        p.complete(id, true).expect("a transfer in flight");
    }
}

/// Runs `req` over the prompt `h` through lookup, allocation (GPU blocks from
/// `first_gpu` on), one step, and its finish; completes the flush on every rank, takes
/// the completion that releases `req`, and returns the flush. Eager mode only.
pub fn store_prompt(p: &mut Planner, req: &str, h: &[BlockHash], first_gpu: u32) -> StoreJob {
    let tokens = h.len() * BS;
    p.lookup(req, h, tokens + 1, 0).expect("lookup");
    let gpu: Vec<u32> = (first_gpu..first_gpu + h.len() as u32 + 1).collect();
    p.on_alloc(req, &[&gpu], 0, 0).expect("allocation");
    step(p, [new_req(req, 0, &gpu, h)]);
    assert!(p.request_finished(req, h, tokens).expect("finish"));
    let store = idle_step(p).store.expect("the prompt's blocks to flush");
    complete_on_every_rank(p, store.id);
    assert_eq!(p.take_completions().finished_sending, vec![req.to_string()]);
    store
}

/// Pins held on CPU blocks, summed over the pool (lookup hits, loads, stores in flight).
pub fn pinned(p: &Planner) -> u32 {
    let pool = p.cache().pool();
    (0..pool.capacity())
        .map(|b| pool.ref_count(b).expect("block in range"))
        .sum()
}

/// The keys `store` writes its CPU blocks under, pairwise with its GPU blocks.
pub fn store_keys(p: &Planner, store: &StoreJob) -> Vec<BlockHash> {
    store
        .cpu_blocks
        .iter()
        .map(|&b| p.cache().pool().key(b).expect("block in range").hash)
        .collect()
}

/// Every block announced by `Stored` events, as `(group, hash)`, sorted.
pub fn stored_event_keys(events: Vec<KvEvent>) -> Vec<(u32, BlockHash)> {
    let mut keys: Vec<(u32, BlockHash)> = events
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::Stored { group, hashes, .. } => {
                Some(hashes.into_iter().map(move |h| (group, h)))
            }
            _ => None,
        })
        .flatten()
        .collect();
    keys.sort_unstable();
    keys
}

/// Every hash announced by `Stored` events, in order.
pub fn stored_event_hashes(events: &[KvEvent]) -> Vec<BlockHash> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored { hashes, .. } => Some(hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}
