//! Several KV-cache groups (vLLM's hybrid allocator): per-group hits consistent across
//! groups, sliding-window blocks stored only while the request holds them, null blocks
//! never read, loads that cover every block vLLM allocated, events per group.

#![allow(clippy::unwrap_used)]

mod common;

use common::planner::{
    chained, complete_on_every_rank, hashes, sched_groups as sched, step_groups as step,
    GroupSched as Sched, BS,
};
use offload_core::{
    BlockHash, BlockKey, GroupKind, KvEvent, PlanError, Planner, PlannerConfig, ScheduleKind,
    StepPlan,
};

/// vLLM's null block id: what a sliding-window group's table holds where it freed a block.
const NULL: u32 = 0;

/// A full-attention group and a sliding-window group whose window spans 2 blocks: a hit
/// ending at block `n` needs the sliding-window blocks `n - 2` and `n - 1`.
const HYBRID: [GroupKind; 2] = [
    GroupKind::FullAttention,
    GroupKind::SlidingWindow {
        window: 2 * BS as u32 + 1,
    },
];

fn hybrid(blocks: u32, after_forward: bool) -> Planner {
    Planner::new(
        PlannerConfig::new(BS as u32, blocks)
            .with_events(true)
            .with_stores_after_forward(after_forward),
        &HYBRID,
    )
}

/// Group tables of a request with `n` blocks: full attention from `full`, sliding window
/// from `sliding`, the first `nulls` sliding positions freed.
fn tables(n: u32, full: u32, sliding: u32, nulls: u32) -> [Vec<u32>; 2] {
    let sw = (0..n)
        .map(|i| if i < nulls { NULL } else { sliding + i })
        .collect();
    [(full..full + n).collect(), sw]
}

/// Prompt `h` (a whole number of blocks) computed by `req` in one step after its forward
/// pass, then finished: every group's blocks are stored (the request held them all).
fn store_in_one_step(p: &mut Planner, req: &str, h: &[BlockHash], full: u32, sliding: u32) {
    let n = h.len() as u32 + 1;
    let [f, s] = tables(n, full, sliding, 0);
    let tokens = h.len() * BS;
    assert_eq!(p.lookup(req, h, tokens + 1, 0).unwrap(), 0);
    p.on_alloc(req, &[&f, &s], 0, 0).unwrap();
    let plan = step(p, [sched(req, ScheduleKind::New, 0, tokens, &[&f, &s], h)]);
    let store = plan.store.expect("the prompt's blocks");
    assert_eq!(store.groups.len(), 2 * h.len());
    assert!(
        plan.held_gpu_blocks.is_empty(),
        "stores after the forward hold nothing"
    );
    complete_on_every_rank(p, store.id);
    assert!(!p.request_finished(req, h, tokens).unwrap());
}

/// Prompt `h` (5 blocks) stored by "a", then "b" with the same prompt hits all of it and
/// is allocated the full-attention blocks 50.. and the sliding-window blocks 73 and 74
/// (the window of its 80 tokens): the step that issues "b"'s load.
fn load_whole_hit(p: &mut Planner, h: &[BlockHash]) -> StepPlan {
    store_in_one_step(p, "a", h, 10, 30);
    assert_eq!(p.lookup("b", h, 5 * BS + 1, 0).unwrap(), 5 * BS);
    let [f, s] = tables(6, 50, 70, 3);
    p.on_alloc("b", &[&f, &s], 0, 5 * BS).unwrap();
    step(p, [sched("b", ScheduleKind::New, 5 * BS, 1, &[&f, &s], h)])
}

#[test]
fn a_running_request_stores_only_the_sliding_blocks_it_still_holds_and_holds_them() {
    let mut p = hybrid(64, false);
    let h = hashes(1, 5);
    let [f, s] = tables(6, 10, 30, 0);
    p.lookup("a", &h, 5 * BS + 1, 0).unwrap();
    p.on_alloc("a", &[&f, &s], 0, 0).unwrap();
    assert!(step(&mut p, [sched("a", ScheduleKind::New, 0, 0, &[&f, &s], &h)]).is_empty());
    // Next step: 80 tokens computed; vLLM's allocation freed the sliding blocks before the
    // window of token 80 (blocks 0..3).
    let plan = step(
        &mut p,
        [sched(
            "a",
            ScheduleKind::Running,
            5 * BS,
            1,
            &[&[], &[]],
            &h,
        )],
    );
    let store = plan.store.expect("confirmed blocks");
    assert_eq!(store.gpu_blocks, vec![10, 11, 12, 13, 14, 33, 34]);
    assert_eq!(store.groups, vec![0, 0, 0, 0, 0, 1, 1]);
    // The server frees sliding blocks from a running request: the caller keeps them.
    assert_eq!(plan.held_gpu_blocks, vec![33, 34]);
    complete_on_every_rank(&mut p, store.id);
    assert_eq!(p.take_completions().released_gpu_blocks, vec![33, 34]);
}

#[test]
fn a_finished_request_stores_only_the_sliding_blocks_vllm_kept_at_its_finish() {
    let mut p = hybrid(64, false);
    let h = hashes(1, 5);
    let [f, s] = tables(6, 10, 30, 0);
    p.lookup("a", &h, 5 * BS + 1, 0).unwrap();
    p.on_alloc("a", &[&f, &s], 0, 0).unwrap();
    // The whole prompt in one step, then finished by the token it sampled: before it
    // hands the table over, vLLM frees the sliding blocks before the window of the 81
    // computed tokens (blocks 0..3), which the next step may allocate to anyone.
    let plan = step(
        &mut p,
        [sched("a", ScheduleKind::New, 0, 5 * BS + 1, &[&f, &s], &h)],
    );
    assert!(plan.is_empty());
    assert!(p.request_finished("a", &h, 5 * BS + 1).unwrap());
    let plan = step(&mut p, []);
    let store = plan.store.expect("the finished request's blocks");
    assert_eq!(store.gpu_blocks, vec![10, 11, 12, 13, 14, 33, 34]);
    assert_eq!(store.groups, vec![0, 0, 0, 0, 0, 1, 1]);
}

#[test]
fn a_hit_loads_every_full_block_and_the_sliding_window_into_the_non_null_blocks() {
    let mut p = hybrid(64, true);
    let h = hashes(1, 5);
    // vLLM allocates the sliding group only inside the window of the 80 hit tokens.
    let plan = load_whole_hit(&mut p, &h);
    let load = &plan.loads[0];
    assert!(load.valid);
    assert_eq!(load.gpu_blocks, vec![50, 51, 52, 53, 54, 73, 74]);
    assert!(!load.gpu_blocks.contains(&NULL));
    for (&cpu, (i, g)) in
        load.cpu_blocks
            .iter()
            .zip([(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (3, 1), (4, 1)])
    {
        let key = p.cache().pool().key(cpu).unwrap();
        assert_eq!((key.group, key.hash), (g, h[i]));
    }
}

#[test]
fn the_hit_is_the_longest_one_every_group_can_serve() {
    let mut p = hybrid(64, false);
    let h = chained(None, 0..5);
    // Async stores: the first step of a new request stores nothing, the next one only the
    // sliding blocks still in the window (3 and 4).
    let [f, s] = tables(6, 10, 30, 0);
    p.lookup("a", &h, 5 * BS + 1, 0).unwrap();
    p.on_alloc("a", &[&f, &s], 0, 0).unwrap();
    step(&mut p, [sched("a", ScheduleKind::New, 0, 0, &[&f, &s], &h)]);
    let plan = step(
        &mut p,
        [sched(
            "a",
            ScheduleKind::Running,
            5 * BS,
            1,
            &[&[], &[]],
            &h,
        )],
    );
    complete_on_every_rank(&mut p, plan.store.unwrap().id);
    // "b" shares the first 4 blocks: full attention has all 4, but a hit of 4 blocks needs
    // sliding blocks 2 and 3, and a shorter one blocks before 3: no hit serves every group.
    let mut b = h[..4].to_vec();
    b.extend(chained(Some(h[3]), 100..102));
    assert_eq!(p.lookup("b", &b, 6 * BS + 1, 0).unwrap(), 0);
    // The same prompt as "a" ends where its sliding blocks are.
    assert_eq!(p.lookup("c", &h, 5 * BS + 1, 0).unwrap(), 5 * BS);
    // With the whole prompt stored in one step, "b" hits its 4 shared blocks.
    let mut q = hybrid(64, true);
    store_in_one_step(&mut q, "a", &h, 10, 30);
    assert_eq!(q.lookup("b", &b, 6 * BS + 1, 0).unwrap(), 4 * BS);
}

#[test]
fn a_sliding_only_model_hits_on_its_window() {
    let window = GroupKind::SlidingWindow {
        window: 2 * BS as u32 + 1,
    };
    let mut p = Planner::new(
        PlannerConfig::new(BS as u32, 64).with_stores_after_forward(true),
        &[window],
    );
    let h = hashes(1, 4);
    let sw: Vec<u32> = (20..25).collect();
    p.lookup("a", &h, 4 * BS + 1, 0).unwrap();
    let plan = step(
        &mut p,
        [sched("a", ScheduleKind::New, 0, 4 * BS, &[&sw], &h)],
    );
    let store = plan.store.unwrap();
    complete_on_every_rank(&mut p, store.id);
    p.request_finished("a", &h, 4 * BS).unwrap();
    assert_eq!(p.lookup("b", &h, 4 * BS + 1, 0).unwrap(), 4 * BS);
    let table = [NULL, NULL, 42, 43, 44];
    p.on_alloc("b", &[&table], 0, 4 * BS).unwrap();
    let plan = step(
        &mut p,
        [sched("b", ScheduleKind::New, 4 * BS, 1, &[&table], &h)],
    );
    assert_eq!(plan.loads[0].gpu_blocks, vec![42, 43]);
}

#[test]
fn accepting_less_than_offered_moves_the_window_off_the_pins_and_fails_the_load() {
    let mut p = hybrid(64, true);
    let h = hashes(1, 5);
    // Only the last two sliding blocks of "a" are on CPU: a request with 80 tokens
    // computed when it was scheduled holds no earlier one.
    let [f, s] = tables(6, 10, 30, 3);
    p.lookup("a", &h, 5 * BS + 1, 0).unwrap();
    p.on_alloc("a", &[&f, &s], 0, 0).unwrap();
    let plan = step(
        &mut p,
        [sched("a", ScheduleKind::New, 5 * BS, 0, &[&f, &s], &h)],
    );
    let store = plan.store.unwrap();
    assert_eq!(store.gpu_blocks, vec![10, 11, 12, 13, 14, 33, 34]);
    complete_on_every_rank(&mut p, store.id);
    p.request_finished("a", &h, 5 * BS).unwrap();
    assert_eq!(p.lookup("b", &h, 5 * BS + 1, 0).unwrap(), 5 * BS);
    // The scheduler takes 3 blocks: the window of 48 tokens is blocks 1 and 2, not on CPU.
    let [f, s] = tables(6, 50, 70, 1);
    p.on_alloc("b", &[&f, &s], 0, 3 * BS).unwrap();
    let plan = step(
        &mut p,
        [sched("b", ScheduleKind::New, 3 * BS, 1, &[&f, &s], &h)],
    );
    let load = &plan.loads[0];
    assert!(!load.valid);
    complete_on_every_rank(&mut p, load.id);
    let errors = p.take_completions().load_error_blocks;
    assert_eq!(errors, vec![50, 51, 52, 71, 72]);
    // What stays pinned is the step's store of "b"'s own sliding blocks 1 and 2.
    let store = plan.store.as_ref().unwrap();
    assert_eq!(store.gpu_blocks, vec![71, 72]);
    complete_on_every_rank(&mut p, store.id);
    assert_eq!(common::planner::pinned(&p), 0);
}

#[test]
fn stored_events_name_each_block_group() {
    let mut p = hybrid(64, true);
    let h = chained(None, 0..3);
    store_in_one_step(&mut p, "a", &h, 10, 30);
    let groups: Vec<(u32, Vec<BlockHash>)> = p
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::Stored { group, hashes, .. } => Some((group, hashes)),
            _ => None,
        })
        .collect();
    assert_eq!(groups, vec![(0, h.clone()), (1, h)]);
}

#[test]
fn block_tables_for_another_number_of_groups_are_refused_naming_the_request() {
    let mut p = hybrid(64, true);
    let h = hashes(1, 2);
    p.lookup("a", &h, 2 * BS + 1, 0).unwrap();
    let only_full: [&[u32]; 1] = [&[1, 2, 3]];
    let err = p
        .schedule([sched("a", ScheduleKind::New, 0, 32, &only_full, &h)], [])
        .unwrap_err();
    assert_eq!(
        err,
        PlanError::GroupMismatch {
            req_id: "a".into(),
            expected: 2,
            got: 1
        }
    );
    assert!(err.to_string().contains("`a`"));
    let err = p.on_alloc("a", &only_full, 0, 16).unwrap_err();
    assert!(matches!(err, PlanError::GroupMismatch { .. }));
    // A plain table is one group's.
    let one = offload_core::ScheduledRequest {
        req_id: "a",
        kind: ScheduleKind::New,
        num_computed_tokens: 0,
        num_scheduled_tokens: 32,
        gpu_blocks: vec![1, 2, 3],
        hashes: &h[..],
    };
    let err = p.schedule([one], []).unwrap_err();
    assert!(matches!(err, PlanError::GroupMismatch { got: 1, .. }));
}

#[test]
fn a_dense_model_is_one_full_attention_group() {
    let p = Planner::new(PlannerConfig::new(16, 8), &[GroupKind::FullAttention]);
    assert_eq!(p.groups(), &[GroupKind::FullAttention]);
    let mut p = p;
    let h = hashes(1, 2);
    let full: [&[u32]; 1] = [&[1, 2, 3]];
    p.lookup("a", &h, 2 * BS + 1, 0).unwrap();
    p.on_alloc("a", &full, 0, 0).unwrap();
    step(&mut p, [sched("a", ScheduleKind::New, 0, 0, &full, &h)]);
    let plan = step(
        &mut p,
        [sched("a", ScheduleKind::Running, 2 * BS, 1, &[&[]], &h)],
    );
    let store = plan.store.unwrap();
    assert_eq!(store.gpu_blocks, vec![1, 2]);
    assert!(store.groups.is_empty());
}

#[test]
fn lazy_candidates_are_stored_under_their_own_group() {
    let mut p = Planner::new(
        PlannerConfig::new(BS as u32, 64)
            .with_lazy(true)
            .with_events(true),
        &HYBRID,
    );
    let h = chained(None, 0..2);
    // A freed block of each group, offered when vLLM reports the step, and one more
    // candidate of the sliding-window group in the next plan's walk.
    let held = p.offer_lazy([(7, BlockKey::new(0, h[0])), (8, BlockKey::new(1, h[0]))]);
    assert_eq!(held, vec![7, 8]);
    let plan = p
        .schedule(
            std::iter::empty::<Sched<'_>>(),
            [(9, BlockKey::new(1, h[1]))],
        )
        .unwrap();
    let store = plan.store.unwrap();
    assert_eq!(store.gpu_blocks, vec![7, 8, 9]);
    assert_eq!(store.groups, vec![0, 1, 1]);
    complete_on_every_rank(&mut p, store.id);
    assert_eq!(p.take_completions().released_gpu_blocks, vec![7, 8, 9]);
    let stored: Vec<(u32, Vec<BlockHash>)> = p
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::Stored { group, hashes, .. } => Some((group, hashes)),
            _ => None,
        })
        .collect();
    assert_eq!(
        stored,
        vec![(0, vec![h[0]]), (1, vec![h[0]]), (1, vec![h[1]])]
    );
}

#[test]
fn a_failed_load_drops_its_blocks_of_every_group() {
    let mut p = hybrid(64, true);
    let h = hashes(1, 5);
    let plan = load_whole_hit(&mut p, &h);
    let load = &plan.loads[0];
    p.complete(load.id, false).unwrap();
    let errors = p.take_completions().load_error_blocks;
    assert_eq!(errors, vec![50, 51, 52, 53, 54, 73, 74]);
    // The same hit is not offered again (vLLM would ask for it forever).
    assert_eq!(p.lookup("c", &h, 5 * BS + 1, 0).unwrap(), 0);
}

/// A full-attention group and a Mamba group (vLLM's `mamba_cache_mode="align"`).
const SSM_HYBRID: [GroupKind; 2] = [GroupKind::FullAttention, GroupKind::Mamba];

fn ssm_hybrid(after_forward: bool) -> Planner {
    Planner::new(
        PlannerConfig::new(BS as u32, 64).with_stores_after_forward(after_forward),
        &SSM_HYBRID,
    )
}

/// "a" computes a prompt of 5 blocks and 4 tokens the way vLLM's align mode chunks it:
/// 48 tokens, then 32 (to the last block boundary), then the 4-token tail. Its Mamba
/// table holds a state block only where a chunk ended on a block boundary (blocks 2 and
/// 4), the null block elsewhere. Copies outlive the step (stores before the forward).
/// Returns the stores' (GPU block, group) pairs, each store completed.
fn ssm_prompt_before_forward(p: &mut Planner, h: &[BlockHash]) -> Vec<(u32, u32)> {
    let tokens = 5 * BS + 4;
    let mut stored = Vec::new();
    let mut record = |p: &mut Planner, plan: StepPlan, held: &[u32]| {
        assert_eq!(
            plan.held_gpu_blocks, held,
            "Mamba states vLLM frees are held"
        );
        if let Some(store) = plan.store {
            stored.extend(store.gpu_blocks.iter().copied().zip(store.groups.clone()));
            complete_on_every_rank(p, store.id);
        }
    };
    p.lookup("a", h, tokens + 1, 0).unwrap();
    let (f, m): (&[u32], &[u32]) = (&[10, 11, 12], &[NULL, NULL, 32]);
    p.on_alloc("a", &[f, m], 0, 0).unwrap();
    let plan = step(p, [sched("a", ScheduleKind::New, 0, 3 * BS, &[f, m], h)]);
    record(p, plan, &[]);
    let added: [&[u32]; 2] = [&[13, 14], &[NULL, 34]];
    let plan = step(
        p,
        [sched("a", ScheduleKind::Running, 3 * BS, 2 * BS, &added, h)],
    );
    record(p, plan, &[32]);
    let added: [&[u32]; 2] = [&[15], &[35]];
    let plan = step(p, [sched("a", ScheduleKind::Running, 5 * BS, 4, &added, h)]);
    record(p, plan, &[34]);
    // Finished mid-block: block 5 holds a running state, never stored.
    p.request_finished("a", h, tokens + 1).unwrap();
    let plan = step(p, std::iter::empty::<Sched<'_>>());
    record(p, plan, &[]);
    stored
}

#[test]
fn a_mamba_group_stores_only_the_states_where_chunks_ended_on_a_block_boundary() {
    let mut p = ssm_hybrid(false);
    let h = chained(None, 0..5);
    let stored = ssm_prompt_before_forward(&mut p, &h);
    assert_eq!(
        stored,
        vec![
            (10, 0),
            (11, 0),
            (12, 0),
            (32, 1),
            (13, 0),
            (14, 0),
            (34, 1)
        ]
    );
}

#[test]
fn a_mamba_hit_needs_only_the_state_at_its_end_and_loads_it_where_vllm_allocated_it() {
    let mut p = ssm_hybrid(false);
    let h = chained(None, 0..5);
    ssm_prompt_before_forward(&mut p, &h);
    // "c" shares 4 blocks: full attention has them all, but the state after 4 blocks was
    // never written (a chunk ran past it); the state after 3 blocks was.
    let mut c = h[..4].to_vec();
    c.extend(chained(Some(h[3]), 100..102));
    assert_eq!(p.lookup("c", &c, 6 * BS + 1, 0).unwrap(), 3 * BS);
    // The same prompt hits all 5 blocks. vLLM allocates the Mamba group one block, the
    // one ending at the hit, and nulls the rest: the load fills that block only.
    assert_eq!(p.lookup("b", &h, 5 * BS + 5, 0).unwrap(), 5 * BS);
    let (f, m): (&[u32], &[u32]) = (&[50, 51, 52, 53, 54], &[NULL, NULL, NULL, NULL, 74]);
    p.on_alloc("b", &[f, m], 0, 5 * BS).unwrap();
    let plan = step(
        &mut p,
        [sched("b", ScheduleKind::New, 5 * BS, 0, &[f, m], &h)],
    );
    let load = &plan.loads[0];
    assert!(load.valid);
    assert_eq!(load.gpu_blocks, vec![50, 51, 52, 53, 54, 74]);
    let key = p.cache().pool().key(load.cpu_blocks[5]).unwrap();
    assert_eq!((key.group, key.hash), (1, h[4]));
}

#[test]
fn stores_after_the_forward_take_the_state_where_the_step_s_chunk_ended() {
    let mut p = ssm_hybrid(true);
    let h = chained(None, 0..5);
    // A 48-token chunk: after its forward, block 2 holds the state at 48 and blocks 0
    // and 1 are null.
    let (f, m): (&[u32], &[u32]) = (&[10, 11, 12], &[NULL, NULL, 32]);
    p.lookup("a", &h, 5 * BS + 5, 0).unwrap();
    p.on_alloc("a", &[f, m], 0, 0).unwrap();
    let plan = step(
        &mut p,
        [sched("a", ScheduleKind::New, 0, 3 * BS, &[f, m], &h)],
    );
    let store = plan.store.unwrap();
    assert_eq!(store.gpu_blocks, vec![10, 11, 12, 32]);
    assert_eq!(store.groups, vec![0, 0, 0, 1]);
    // The last chunk runs from 48 past the boundary at 80 to 84: block 4 is null (no
    // chunk ended at 80) and block 5 a running state; neither is stored.
    let added: [&[u32]; 2] = [&[13, 14, 15], &[NULL, NULL, 35]];
    let plan = step(
        &mut p,
        [sched(
            "a",
            ScheduleKind::Running,
            3 * BS,
            2 * BS + 4,
            &added,
            &h,
        )],
    );
    let store = plan.store.unwrap();
    assert_eq!(store.gpu_blocks, vec![13, 14]);
    assert_eq!(store.groups, vec![0, 0]);
}

#[test]
fn a_mamba_only_model_hits_on_the_state_at_the_boundary() {
    let mut p = Planner::new(
        PlannerConfig::new(BS as u32, 64).with_stores_after_forward(true),
        &[GroupKind::Mamba],
    );
    let h = hashes(1, 4);
    let m: &[u32] = &[NULL, NULL, NULL, 23];
    p.lookup("a", &h, 4 * BS + 1, 0).unwrap();
    let plan = step(&mut p, [sched("a", ScheduleKind::New, 0, 4 * BS, &[m], &h)]);
    let store = plan.store.unwrap();
    assert_eq!(store.gpu_blocks, vec![23]);
    complete_on_every_rank(&mut p, store.id);
    p.request_finished("a", &h, 4 * BS).unwrap();
    assert_eq!(p.lookup("b", &h, 4 * BS + 1, 0).unwrap(), 4 * BS);
    // A shorter prompt sharing 3 blocks finds no state after 3 blocks.
    assert_eq!(p.lookup("c", &h[..3], 3 * BS + 1, 0).unwrap(), 0);
    let table: &[u32] = &[NULL, NULL, NULL, 43];
    p.on_alloc("b", &[table], 0, 4 * BS).unwrap();
    let plan = step(
        &mut p,
        [sched("b", ScheduleKind::New, 4 * BS, 1, &[table], &h)],
    );
    assert_eq!(plan.loads[0].gpu_blocks, vec![43]);
}
