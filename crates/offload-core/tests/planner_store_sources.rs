//! What a store job tells its caller for KV events: where each stored block comes from
//! (so the caller can snapshot the request's tokens while it still has the request) and
//! when the job retired (so the caller can drop the snapshots of a failed one).

#![allow(clippy::unwrap_used)]

mod common;

use common::planner::{
    complete_on_every_rank, hashes, new_req, planner, running, step, stored_event_hashes,
    stored_event_keys,
};
use offload_core::{BlockKey, GroupKind, Planner, PlannerConfig};

#[test]
fn eager_store_names_each_blocks_request_and_position() {
    let mut p = planner(16, 1, false);
    let (ha, hb) = (hashes(1, 3), hashes(2, 2));
    step(
        &mut p,
        [
            new_req("a", 0, &[0, 1, 2, 3], &ha),
            new_req("b", 0, &[4, 5, 6], &hb),
        ],
    );
    // a has 2 blocks computed, b 1: the step after stores those.
    let store = step(
        &mut p,
        [running("a", 32, &[], &ha), running("b", 16, &[], &hb)],
    )
    .store
    .unwrap();
    let sources: Vec<_> = store
        .sources
        .iter()
        .map(|s| s.map(|(r, i)| (store.req_ids[r as usize].as_str(), i)))
        .collect();
    assert_eq!(
        sources,
        vec![Some(("a", 0)), Some(("a", 1)), Some(("b", 0))]
    );
    assert_eq!(store.gpu_blocks, vec![0, 1, 4]);
}

#[test]
fn each_source_is_the_request_block_its_gpu_block_holds() {
    // With stores after the forward pass a new request is listed again as running, so
    // one step selects blocks of several requests in turns.
    let mut p = planner(16, 1, false);
    let (ha, hb) = (hashes(1, 3), hashes(2, 2));
    let (a_gpu, b_gpu) = ([0, 1, 2, 3], [4, 5, 6]);
    step(&mut p, [new_req("b", 0, &b_gpu, &hb)]);
    let store = step(
        &mut p,
        [
            new_req("a", 16, &a_gpu, &ha),
            running("b", 16, &[], &hb),
            running("a", 48, &[], &ha),
        ],
    )
    .store
    .unwrap();
    let mut seen = Vec::new();
    for (j, src) in store.sources.iter().enumerate() {
        let (r, i) = src.unwrap();
        let req = store.req_ids[r as usize].as_str();
        let table: &[u32] = if req == "a" { &a_gpu } else { &b_gpu };
        assert_eq!(store.gpu_blocks[j], table[i as usize], "{req} block {i}");
        seen.push((req, i));
    }
    seen.sort_unstable();
    assert_eq!(seen, vec![("a", 0), ("a", 1), ("a", 2), ("b", 0)]);
}

#[test]
fn lazy_blocks_have_no_source() {
    let mut p = planner(16, 1, true);
    let h = hashes(1, 2);
    let store = p
        .schedule(
            Vec::<common::planner::Sched<'_>>::new(),
            [
                (7, common::planner::key(h[0])),
                (8, common::planner::key(h[1])),
            ],
        )
        .unwrap()
        .store
        .unwrap();
    assert_eq!(store.sources, vec![None, None]);
}

#[test]
fn each_block_names_the_hash_its_stored_event_will_name() {
    // Lazy candidates of two groups sharing a hash, and an eager store: the hash each
    // block carries is the one the `Stored` event about it names.
    let kinds = [GroupKind::FullAttention, GroupKind::FullAttention];
    let mut lazy = Planner::new(
        PlannerConfig::new(16, 8).with_lazy(true).with_events(true),
        &kinds,
    );
    let h = hashes(1, 2);
    let store = lazy
        .schedule(
            Vec::<common::planner::Sched<'_>>::new(),
            [
                (7, BlockKey::new(0, h[0])),
                (8, BlockKey::new(1, h[0])),
                (9, BlockKey::new(1, h[1])),
            ],
        )
        .unwrap()
        .store
        .unwrap();
    assert_eq!(store.hashes, vec![h[0], h[0], h[1]]);
    assert_eq!(store.groups, vec![0, 1, 1]);
    complete_on_every_rank(&mut lazy, store.id);
    assert_eq!(
        stored_event_keys(lazy.take_events()),
        vec![(0, h[0]), (1, h[0]), (1, h[1])]
    );

    let mut eager = planner(16, 1, false);
    let ha = hashes(2, 3);
    step(&mut eager, [new_req("a", 0, &[0, 1, 2, 3], &ha)]);
    let store = step(&mut eager, [running("a", 48, &[], &ha)])
        .store
        .unwrap();
    assert_eq!(store.hashes, ha);
    complete_on_every_rank(&mut eager, store.id);
    assert_eq!(stored_event_hashes(&eager.take_events()), ha);
}

#[test]
fn retired_stores_are_reported_once_every_rank_reported_ok_or_not() {
    let mut p = planner(16, 2, false);
    let h = hashes(1, 2);
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h)]);
    let first = step(&mut p, [running("a", 16, &[], &h)]).store.unwrap();
    let second = step(&mut p, [running("a", 32, &[], &h)]).store.unwrap();
    p.complete(second.id, false).unwrap();
    assert!(p.take_completions().retired_stores.is_empty());
    p.complete(second.id, true).unwrap();
    complete_on_every_rank(&mut p, first.id);
    assert_eq!(
        p.take_completions().retired_stores,
        vec![second.id, first.id]
    );
}

#[test]
fn without_events_nothing_is_reported() {
    let mut p = Planner::new(PlannerConfig::new(16, 16), &[GroupKind::FullAttention]);
    let h = hashes(1, 2);
    step(&mut p, [new_req("a", 0, &[0, 1, 2], &h)]);
    let store = step(&mut p, [running("a", 32, &[], &h)]).store.unwrap();
    assert!(store.sources.is_empty());
    assert!(store.hashes.is_empty());
    p.complete(store.id, true).unwrap();
    assert!(p.take_completions().retired_stores.is_empty());
}
