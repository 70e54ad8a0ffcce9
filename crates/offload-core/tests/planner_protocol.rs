//! The planner's step protocol, scenario by scenario, through its public API only:
//! lookups and pinning, accepted and refused hits, eager and lazy store selection,
//! per-rank completions, finishes with transfers in flight, reset, and KV events.

#![allow(clippy::unwrap_used)]

mod common;

use common::planner::{
    complete_on_every_rank, hashes, idle_step, key, new_req, pinned, planner, resumed, running,
    step, store_keys, store_prompt, Sched, BS,
};
use offload_core::GroupKind;
use offload_core::{BlockHash, KvEvent, PlanError, Planner, PlannerConfig};

#[test]
fn last_token_is_always_recomputed() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 4);
    store_prompt(&mut p, "a", &h, 0);
    // 64 tokens = exactly 4 blocks: the 4th block holds the last token, so 3 hit.
    assert_eq!(p.lookup("b", &h, 64, 0), Ok(48));
    assert_eq!(p.lookup("b", &h, 65, 0), Ok(64));
}

#[test]
fn hit_starts_after_the_gpu_prefix() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 4);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("b", &h, 65, 32), Ok(32));
    let gpu = [7, 8, 9, 10, 11];
    p.on_alloc("b", &[&gpu], 32, 32).unwrap();
    let load = step(&mut p, [new_req("b", 32, &gpu, &h)]).loads.remove(0);
    assert_eq!(load.gpu_blocks, vec![9, 10]);
    assert_eq!(load.cpu_blocks.len(), 2);
    assert!(load.valid && !load.sync);
    // A GPU prefix that is not block aligned gets no CPU hit.
    assert_eq!(p.lookup("c", &h, 65, 20), Ok(0));
}

#[test]
fn repeated_lookups_are_cached_until_the_index_grows() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 4);
    store_prompt(&mut p, "a", &h[..2], 0);
    assert_eq!(p.lookup("b", &h, 65, 0), Ok(32));
    assert_eq!(p.lookup("b", &h, 65, 0), Ok(32));
    assert_eq!(p.stats().cached_lookups, 1);
    // Pins are not taken twice for one request.
    let b0 = p.cache().get_ready(&key(h[0])).unwrap();
    assert_eq!(p.cache().pool().ref_count(b0), Some(1));
    store_prompt(&mut p, "c", &h, 10);
    assert_eq!(p.lookup("b", &h, 65, 0), Ok(64));
    assert_eq!(p.cache().pool().ref_count(b0), Some(1));
    assert_eq!(pinned(&p), 4);
}

#[test]
fn a_grown_gpu_hit_reuses_the_pinned_run() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 4);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("b", &h, 65, 0), Ok(64));
    // The GPU now caches the first two blocks: only the last two come from CPU.
    assert_eq!(p.lookup("b", &h, 65, 32), Ok(32));
    assert_eq!(pinned(&p), 2);
    // It shrinks again: a fresh lookup from the new start.
    assert_eq!(p.lookup("b", &h, 65, 16), Ok(48));
    assert_eq!(pinned(&p), 3);
    p.on_alloc("b", &[[9, 9, 9, 9, 9]], 16, 48).unwrap();
    let load = idle_step(&mut p).loads.remove(0);
    assert_eq!(load.cpu_blocks.len(), 3);
}

#[test]
fn partially_accepted_hit_unpins_the_rest() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 4);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("b", &h, 65, 0), Ok(64));
    p.on_alloc("b", &[[20, 21, 22, 23, 24]], 0, 16).unwrap();
    let load = idle_step(&mut p).loads.remove(0);
    assert_eq!(load.cpu_blocks.len(), 1);
    assert_eq!(load.gpu_blocks, vec![20]);
    assert_eq!(pinned(&p), 1);
    p.complete(load.id, true).unwrap();
    assert_eq!(pinned(&p), 0);
}

#[test]
fn refused_hit_unpins_everything() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 4);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("b", &h, 65, 0), Ok(64));
    p.on_alloc("b", &[[20, 21, 22, 23, 24]], 0, 0).unwrap();
    assert_eq!(pinned(&p), 0);
    assert!(idle_step(&mut p).is_empty());
}

#[test]
fn load_without_a_hit_is_reported_failed_not_stranded() {
    let mut p = planner(16, 1, false);
    assert_eq!(p.lookup("b", &hashes(1, 4), 65, 0), Ok(0));
    p.on_alloc("b", &[[5, 6, 7, 8, 9]], 0, 32).unwrap();
    let load = idle_step(&mut p).loads.remove(0);
    assert!(!load.valid);
    assert_eq!(load.gpu_blocks, vec![5, 6]);
    p.complete(load.id, false).unwrap();
    let c = p.take_completions();
    assert_eq!(c.finished_recving, vec!["b".to_string()]);
    assert_eq!(c.load_error_blocks, vec![5, 6]);
    assert_eq!(p.stats().failed_loads, 1);
}

/// vLLM looks a request up again when the first block of its asynchronous load failed.
/// Offering the same blocks again would fail the same way, forever: a failed load's
/// blocks are never served again, and the ones a concurrent load still holds are freed
/// when it lets go.
#[test]
fn a_failed_load_is_not_offered_again() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 4);
    store_prompt(&mut p, "a", &h, 0);
    p.take_events();
    assert_eq!(p.lookup("b", &h, 65, 0), Ok(64));
    assert_eq!(p.lookup("c", &h[..2], 33, 0), Ok(32));
    p.on_alloc("b", &[[20, 21, 22, 23, 24]], 0, 64).unwrap();
    p.on_alloc("c", &[[30, 31, 32]], 0, 32).unwrap();
    let loads = idle_step(&mut p).loads;
    assert_eq!(loads.len(), 2);
    p.complete(loads[0].id, false).unwrap();
    assert_eq!(p.take_completions().load_error_blocks, vec![20, 21, 22, 23]);

    assert_eq!(p.lookup("b", &h, 65, 0), Ok(0));
    assert_eq!(p.cache().ready_prefix(0, &h), 0);
    assert!(p.take_events().contains(&KvEvent::Removed {
        group: 0,
        hashes: h.clone(),
    }));
    // "c" still reads its two blocks; they go back to the free list when it is done.
    assert_eq!(p.cache().pool().num_free(), 14);
    p.complete(loads[1].id, true).unwrap();
    assert_eq!(p.cache().pool().num_free(), 16);
    assert_eq!(pinned(&p), 0);
    p.cache().check_invariants().unwrap();
}

#[test]
fn load_for_a_request_never_looked_up_is_an_error_only_if_it_moves_tokens() {
    let mut p = planner(16, 1, false);
    p.on_alloc("x", &[[1, 2]], 0, 0).unwrap();
    assert_eq!(
        p.on_alloc("x", &[[1, 2]], 0, 16),
        Err(PlanError::UnknownRequest("x".into()))
    );
    assert!(!p.has_work_in_flight());
}

#[test]
fn prefix_hit_blocks_of_a_new_request_wait_one_step() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 2);
    // Its 32 computed tokens are a GPU hit on blocks computed in this same step.
    assert!(step(&mut p, [new_req("a", 32, &[0, 1, 2], &h)])
        .store
        .is_none());
    let store = step(&mut p, [running("a", 40, &[], &h)]).store.unwrap();
    assert_eq!(store.gpu_blocks, vec![0, 1]);
    assert_eq!(store.req_ids, vec!["a".to_string()]);
}

#[test]
fn hashes_are_read_when_blocks_are_confirmed_and_the_rest_once_the_list_grows() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 3);
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h[..1])]);
    // Decoding filled blocks 1 and 2, but the server's list holds one hash so far: only
    // what has a hash is stored.
    let first = step(&mut p, [running("a", 48, &[], &h[..1])])
        .store
        .unwrap();
    assert_eq!(first.gpu_blocks, vec![0]);
    assert_eq!(store_keys(&p, &first), vec![h[0]]);
    let rest = step(&mut p, [running("a", 48, &[], &h)]).store.unwrap();
    assert_eq!(rest.gpu_blocks, vec![1, 2]);
    assert_eq!(store_keys(&p, &rest), h[1..].to_vec());
    assert!(step(&mut p, [running("a", 48, &[], &h)]).store.is_none());
}

#[test]
fn blocks_added_while_running_are_stored_from_the_extended_table() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 3);
    step(&mut p, [new_req("a", 0, &[4, 5], &h)]);
    assert_eq!(
        step(&mut p, [running("a", 32, &[6], &h)])
            .store
            .unwrap()
            .gpu_blocks,
        vec![4, 5]
    );
    assert_eq!(
        step(&mut p, [running("a", 48, &[], &h)])
            .store
            .unwrap()
            .gpu_blocks,
        vec![6]
    );
}

#[test]
fn resumed_request_stores_from_its_new_block_table() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 3);
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h)]);
    let first = step(&mut p, [running("a", 16, &[], &h)]).store.unwrap();
    assert_eq!(first.gpu_blocks, vec![0]);
    complete_on_every_rank(&mut p, first.id);
    // Preempted, then resumed into other GPU blocks with its first block as GPU hit.
    assert!(step(&mut p, [resumed("a", 16, &[5, 6, 7], &h)]).is_empty());
    let rest = step(&mut p, [running("a", 48, &[], &h)]).store.unwrap();
    assert_eq!(rest.gpu_blocks, vec![6, 7]);
    assert_eq!(store_keys(&p, &rest), h[1..].to_vec());
}

fn with_scheduled(mut s: Sched<'_>, tokens: usize) -> Sched<'_> {
    s.num_scheduled_tokens = tokens;
    s
}

#[test]
fn after_forward_stores_take_the_blocks_a_step_fills_first_step_included() {
    let mut p = Planner::new(
        PlannerConfig::new(BS as u32, 16).with_stores_after_forward(true),
        &[GroupKind::FullAttention],
    );
    let h = hashes(1, 3);
    // The prompt's 40 tokens are computed by this step's forward: 2 full blocks.
    let store = step(
        &mut p,
        [with_scheduled(new_req("a", 0, &[0, 1, 2], &h), 40)],
    )
    .store
    .unwrap();
    assert_eq!(store.gpu_blocks, vec![0, 1]);
    // Resumed into a new table, it stores what that step fills (already stored: none).
    let plan = step(
        &mut p,
        [with_scheduled(resumed("a", 0, &[5, 6, 7], &h), 48)],
    );
    assert_eq!(plan.store.unwrap().gpu_blocks, vec![7]);
}

#[test]
fn shared_prefix_is_stored_once() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 2);
    step(
        &mut p,
        [
            new_req("a", 0, &[0, 1, 2], &h),
            new_req("b", 0, &[3, 4, 5], &h),
        ],
    );
    let store = step(
        &mut p,
        [running("a", 32, &[], &h), running("b", 32, &[], &h)],
    )
    .store
    .unwrap();
    assert_eq!(store.gpu_blocks, vec![0, 1]);
    assert_eq!(store.req_ids, vec!["a".to_string()]);
    assert_eq!(p.stats().dedup_skipped, 2);
}

#[test]
fn stores_publish_only_after_every_rank() {
    let mut p = planner(16, 2, false);
    let h = hashes(1, 2);
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h)]);
    let store = step(&mut p, [running("a", 32, &[], &h)]).store.unwrap();
    p.complete(store.id, true).unwrap();
    assert_eq!(p.cache().ready_prefix(0, &h), 0);
    p.complete(store.id, true).unwrap();
    assert_eq!(p.cache().ready_prefix(0, &h), 2);
    assert_eq!(
        p.complete(store.id, true),
        Err(PlanError::UnknownTransfer(store.id))
    );
}

#[test]
fn loads_retire_only_after_every_rank() {
    let mut p = planner(16, 2, false);
    let h = hashes(1, 2);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("b", &h, 33, 0), Ok(32));
    p.on_alloc("b", &[[5, 6, 7]], 0, 32).unwrap();
    let load = idle_step(&mut p).loads.remove(0);
    p.complete(load.id, true).unwrap();
    assert!(p.take_completions().finished_recving.is_empty());
    assert_eq!(pinned(&p), 2);
    p.complete(load.id, true).unwrap();
    assert_eq!(p.take_completions().finished_recving, vec!["b".to_string()]);
    assert_eq!(pinned(&p), 0);
}

#[test]
fn store_failed_on_one_rank_is_never_published() {
    let mut p = planner(16, 2, false);
    let h = hashes(1, 2);
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h)]);
    let store = step(&mut p, [running("a", 32, &[], &h)]).store.unwrap();
    p.complete(store.id, false).unwrap();
    p.complete(store.id, true).unwrap();
    assert_eq!(p.cache().ready_prefix(0, &h), 0);
    assert_eq!(p.cache().pool().num_free(), 16);
    assert_eq!(p.stats().failed_stores, 1);
    assert!(p.take_events().is_empty());
}

#[test]
fn finished_request_waits_for_its_stores() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 3);
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h)]);
    let first = step(&mut p, [running("a", 32, &[], &h)]).store.unwrap();
    assert!(first.flush_req_ids.is_empty());
    // Finishing flushes block 2 too; the server must keep the GPU blocks meanwhile.
    assert!(p.request_finished("a", &h, 48).unwrap());
    assert!(p.has_pending_plan());
    let flush = idle_step(&mut p).store.unwrap();
    assert_eq!(flush.gpu_blocks, vec![2]);
    assert_eq!(flush.flush_req_ids, vec!["a".to_string()]);
    p.complete(first.id, true).unwrap();
    assert!(p.take_completions().finished_sending.is_empty());
    p.complete(flush.id, true).unwrap();
    assert_eq!(p.take_completions().finished_sending, vec!["a".to_string()]);
    assert_eq!(p.num_requests(), 0);
    assert!(!p.has_work_in_flight());
}

#[test]
fn a_request_id_reused_while_the_old_flush_runs_is_a_new_request() {
    let mut p = planner(16, 1, false);
    let shared = hashes(1, 2);
    store_prompt(&mut p, "src", &shared, 0);
    // "r" finishes with its flush in flight; the server reuses the id at once.
    let h = hashes(2, 2);
    step(&mut p, [new_req("r", 0, &[10, 11, 12], &h)]);
    assert!(p.request_finished("r", &h, 32).unwrap());
    let flush = idle_step(&mut p).store.unwrap();
    assert_eq!(p.lookup("r", &shared, 33, 0).unwrap(), 32);
    // The old flush retires: the old "r" is reported, the new one keeps its hit.
    p.complete(flush.id, true).unwrap();
    assert_eq!(p.take_completions().finished_sending, vec!["r".to_string()]);
    assert_eq!(pinned(&p), 2);
    p.on_alloc("r", &[[20, 21, 22]], 0, 32).unwrap();
    let load = step(&mut p, [new_req("r", 0, &[20, 21, 22], &shared)])
        .loads
        .remove(0);
    assert_eq!(load.gpu_blocks, vec![20, 21]);
    p.complete(load.id, true).unwrap();
    assert_eq!(p.take_completions().finished_recving, vec!["r".to_string()]);
    assert!(!p.request_finished("r", &shared, 33).unwrap());
    assert_eq!((pinned(&p), p.num_requests()), (0, 0));
}

#[test]
fn request_aborted_while_loading_is_reported_by_recving_only() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 2);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("b", &h, 33, 0), Ok(32));
    p.on_alloc("b", &[[5, 6, 7]], 0, 32).unwrap();
    let load = idle_step(&mut p).loads.remove(0);
    // The server delays the free of a loading request itself.
    assert!(!p.request_finished("b", &h, 0).unwrap());
    assert!(p.take_completions().finished_recving.is_empty());
    assert_eq!(
        p.complete_all([(load.id, true), (9999, true)]),
        Err(PlanError::UnknownTransfer(9999))
    );
    let c = p.take_completions();
    assert_eq!(c.finished_recving, vec!["b".to_string()]);
    assert!(c.finished_sending.is_empty());
    assert_eq!(p.num_requests(), 0);
    assert_eq!(pinned(&p), 0);
}

#[test]
fn sync_loads_are_not_reported_as_received() {
    let mut p = Planner::new(
        PlannerConfig::new(BS as u32, 16).with_sync_loads(true),
        &[GroupKind::FullAttention],
    );
    let h = hashes(1, 2);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("b", &h, 33, 0), Ok(32));
    p.on_alloc("b", &[[5, 6, 7]], 0, 32).unwrap();
    let load = step(&mut p, [new_req("b", 32, &[5, 6, 7], &h)])
        .loads
        .remove(0);
    assert!(load.sync);
    // It finishes in the step of its load: the server frees its blocks right away.
    assert!(!p.request_finished("b", &h, 33).unwrap());
    p.complete(load.id, true).unwrap();
    let c = p.take_completions();
    assert!(c.finished_recving.is_empty() && c.finished_sending.is_empty());
    assert_eq!(pinned(&p), 0);
}

#[test]
fn request_without_transfers_is_freed_at_once() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 1);
    assert_eq!(p.lookup("a", &h, 9, 0), Ok(0));
    assert_eq!(p.num_requests(), 1);
    assert!(!p.request_finished("a", &h, 8).unwrap());
    assert!(!p.request_finished("never-seen", &h, 8).unwrap());
    assert_eq!(p.num_requests(), 0);
}

#[test]
fn reset_hides_everything_stored_before_it() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 2);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("b", &h, 33, 0), Ok(32));
    // A store in flight across the reset.
    let c = hashes(2, 1);
    step(&mut p, [new_req("c", 0, &[9, 10], &c)]);
    let late = step(&mut p, [running("c", 16, &[], &c)]).store.unwrap();
    p.reset();
    p.complete(late.id, true).unwrap();
    assert_eq!(p.lookup("b", &h, 33, 0), Ok(0));
    assert_eq!(p.cache().ready_prefix(0, &c), 0);
    assert_eq!(p.cache().pool().num_free(), 16);
    p.cache().check_invariants().unwrap();
}

#[test]
fn load_accepted_across_a_reset_is_reported_failed() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 2);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("b", &h, 33, 0), Ok(32));
    p.reset();
    p.on_alloc("b", &[[5, 6, 7]], 0, 32).unwrap();
    let load = idle_step(&mut p).loads.remove(0);
    assert!(!load.valid);
    assert_eq!(load.gpu_blocks, vec![5, 6]);
    p.complete(load.id, false).unwrap();
    assert_eq!(p.take_completions().load_error_blocks, vec![5, 6]);
    assert_eq!(pinned(&p), 0);
}

#[test]
fn lazy_mode_stores_only_candidates_and_releases_them() {
    let mut p = planner(4, 1, true);
    let h = hashes(1, 2);
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h)]);
    assert!(step(&mut p, [running("a", 32, &[], &h)]).is_empty());
    let k = |h| key(BlockHash(h));
    let plan = p
        .schedule(
            Vec::<common::planner::Sched<'_>>::new(),
            [(7, k(1)), (8, k(2)), (9, k(1))],
        )
        .unwrap();
    assert_eq!(plan.held_gpu_blocks, vec![7, 8]);
    let store = plan.store.unwrap();
    assert!(store.req_ids.is_empty());
    assert_eq!(store.gpu_blocks, vec![7, 8]);
    p.complete(store.id, true).unwrap();
    assert_eq!(p.take_completions().released_gpu_blocks, vec![7, 8]);
    let again = p
        .schedule(Vec::<common::planner::Sched<'_>>::new(), [(7, k(1))])
        .unwrap();
    assert!(again.held_gpu_blocks.is_empty() && again.store.is_none());
    // A finished request is not flushed in lazy mode: its blocks come as candidates.
    assert!(!p.request_finished("a", &h, 32).unwrap());
    assert!(!p.has_pending_plan());
}

#[test]
fn a_prefix_stored_in_free_order_is_hit_whole() {
    // vLLM frees a request's blocks last first, so a lazy store puts its prefix in
    // descending CPU blocks, down to block 0; a lookup follows it to the end.
    let none = Vec::<common::planner::Sched<'_>>::new;
    let mut p = planner(4, 1, true);
    let h = hashes(1, 4);
    let freed: Vec<_> = (0..4u32)
        .rev()
        .map(|i| (20 + i, key(h[i as usize])))
        .collect();
    let store = p.schedule(none(), freed).unwrap().store.unwrap();
    assert_eq!(store.cpu_blocks, vec![0, 1, 2, 3]);
    complete_on_every_rank(&mut p, store.id);
    assert_eq!(p.lookup("b", &h, 65, 0), Ok(64));
    let gpu = [7, 8, 9, 10, 11];
    p.on_alloc("b", &[&gpu], 0, 64).unwrap();
    let load = step(&mut p, [new_req("b", 0, &gpu, &h)]).loads.remove(0);
    assert_eq!(load.gpu_blocks, vec![7, 8, 9, 10]);
    assert_eq!(load.cpu_blocks, vec![3, 2, 1, 0]);
}

#[test]
fn lazy_blocks_offered_between_steps_join_the_next_store() {
    let k = |h| key(BlockHash(h));
    let none = Vec::<common::planner::Sched<'_>>::new;
    let mut eager = planner(4, 1, false);
    assert!(eager.offer_lazy([(7, k(1))]).is_empty());
    assert!(!eager.has_pending_plan());

    let mut p = planner(4, 1, true);
    // Freed after the plan was built: offered now, held by the caller from now on.
    assert_eq!(p.offer_lazy([(7, k(1)), (8, k(2))]), vec![7, 8]);
    assert!(p.has_pending_plan());
    let plan = p.schedule(none(), [(9, k(3)), (7, k(1))]).unwrap();
    // Only this step's own candidate is handed to the caller to hold.
    assert_eq!(plan.held_gpu_blocks, vec![9]);
    let store = plan.store.unwrap();
    assert_eq!(store.gpu_blocks, vec![7, 8, 9]);
    p.complete(store.id, true).unwrap();
    // Every held block is released once the store retires.
    assert_eq!(p.take_completions().released_gpu_blocks, vec![7, 8, 9]);
}

#[test]
fn lazy_candidates_the_cpu_tier_has_are_filtered_out_in_order() {
    let k = |h| key(BlockHash(h));
    let none = Vec::<common::planner::Sched<'_>>::new;
    let mut eager = planner(4, 1, false);
    let mut all = vec![(7, k(1))];
    eager.retain_unstored(&mut all, |c| &c.1);
    assert!(all.is_empty());

    let mut p = planner(4, 1, true);
    // One key stored and retired, one in the next store: both dropped, counted as the
    // duplicates `offer_lazy` would have skipped; the rest keep the queue's order.
    let store = p.schedule(none(), [(7, k(1))]).unwrap().store.unwrap();
    p.complete(store.id, true).unwrap();
    assert_eq!(p.offer_lazy([(8, k(2))]), vec![8]);
    let mut freed = vec![(9, k(3)), (8, k(2)), (7, k(1)), (6, k(4))];
    p.retain_unstored(&mut freed, |c| &c.1);
    assert_eq!(freed, vec![(9, k(3)), (6, k(4))]);
    assert_eq!(p.stats().dedup_skipped, 2);
    assert_eq!(p.offer_lazy(freed), vec![9, 6]);
}

#[test]
fn lazy_stores_copied_within_the_step_hold_no_block() {
    let k = |h| key(BlockHash(h));
    let none = Vec::<common::planner::Sched<'_>>::new;
    let mut p = Planner::new(
        PlannerConfig::new(BS as u32, 4)
            .with_lazy(true)
            .with_stores_after_forward(true),
        &[GroupKind::FullAttention],
    );
    // Freed between steps, the next step may allocate them, but its store is copied
    // before its forward pass, the first that may write them: selected, never held.
    assert!(p.offer_lazy([(7, k(1))]).is_empty());
    assert!(p.has_pending_plan());
    // Free while this step is planned: the same store copies them.
    let plan = p.schedule(none(), [(9, k(3)), (10, k(4))]).unwrap();
    assert!(plan.held_gpu_blocks.is_empty());
    let store = plan.store.unwrap();
    assert_eq!(store.gpu_blocks, vec![7, 9, 10]);
    p.complete(store.id, true).unwrap();
    assert!(p.take_completions().released_gpu_blocks.is_empty());
    let stats = p.stats();
    assert_eq!(stats.stored_blocks, 3);
}

#[test]
fn stored_events_chain_parents_and_removals_follow_evictions() {
    let mut p = planner(2, 1, false);
    let h = hashes(1, 2);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(
        p.take_events(),
        vec![KvEvent::Stored {
            group: 0,
            hashes: h.clone(),
            parent: None,
            block_size: BS as u32
        }]
    );
    store_prompt(&mut p, "b", &hashes(2, 1), 10);
    let events = p.take_events();
    assert_eq!(
        events[0],
        KvEvent::Removed {
            group: 0,
            hashes: vec![h[0]]
        }
    );
    assert_eq!(p.stats().evicted_blocks, 1);
}

#[test]
fn stores_continuing_a_request_name_their_parent() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 3);
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h)]);
    let first = step(&mut p, [running("a", 16, &[], &h)]).store.unwrap();
    complete_on_every_rank(&mut p, first.id);
    let rest = step(&mut p, [running("a", 48, &[], &h)]).store.unwrap();
    complete_on_every_rank(&mut p, rest.id);
    assert_eq!(
        p.take_events(),
        vec![
            KvEvent::Stored {
                group: 0,
                hashes: vec![h[0]],
                parent: None,
                block_size: BS as u32
            },
            KvEvent::Stored {
                group: 0,
                hashes: h[1..].to_vec(),
                parent: Some(h[0]),
                block_size: BS as u32
            },
        ]
    );
}

#[test]
fn a_planner_without_cpu_blocks_never_hits_or_stores() {
    let mut p = planner(0, 1, false);
    let h = hashes(1, 2);
    assert_eq!(p.lookup("a", &h, 33, 0), Ok(0));
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h)]);
    assert!(step(&mut p, [running("a", 32, &[], &h)]).is_empty());
    assert!(!p.request_finished("a", &h, 32).unwrap());
    assert_eq!(p.stats().no_space_skipped, 2);
}
