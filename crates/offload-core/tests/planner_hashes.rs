//! A request's block hashes rewritten under the same request id, as vLLM's streaming
//! sessions do (`_update_request_as_session`: `del block_hashes[num_computed_tokens //
//! block_size:]`, then the hashes of the next chunk are appended).
//!
//! Each test lets the planner read the list past the point where it is later truncated,
//! regrows it with other content, and checks that no GPU block is stored under a key
//! whose content changed (the store job's keys, the published index, the KV events) and
//! that no request is served such a key. Also: hashes that cannot be read, and how many
//! hashes a step reads.

#![allow(clippy::unwrap_used)]

mod common;

use std::cell::Cell;

use common::planner::{
    complete_on_every_rank, hashes, idle_step, new_req, pinned, planner, resumed, running, step,
    store_keys, store_prompt, stored_event_hashes, BS,
};
use offload_core::{
    BlockHash, HashError, HashSource, KvEvent, PlanError, Planner, ScheduleKind, ScheduledRequest,
};

/// The session's list before the rewrite: four blocks of family 1.
fn old_list() -> Vec<BlockHash> {
    hashes(1, 4)
}

/// The same list after the server truncated it to two blocks and appended two blocks of
/// other content.
fn new_list() -> Vec<BlockHash> {
    let mut h = old_list();
    h.truncate(2);
    h.extend(&hashes(2, 4)[2..]);
    h
}

/// Another request carrying the dropped content: it must never be served the session's
/// rewritten blocks.
fn assert_old_content_not_served(p: &mut Planner) {
    let old = old_list();
    let hit = p.lookup("other", &old, old.len() * BS + 1, 0).unwrap();
    assert_eq!(hit, 2 * BS, "only the common prefix holds the old content");
    p.on_alloc("other", &[Vec::<u32>::new()], 0, 0).unwrap();
    assert!(!p.request_finished("other", &old, 0).unwrap());
}

/// The session's blocks 2 and 3 are on CPU under their new keys, and the events say so
/// with the right parent.
fn assert_new_content_published(p: &mut Planner) {
    let new = new_list();
    assert_eq!(p.cache().ready_prefix(0, &new), 4);
    assert_eq!(p.cache().ready_prefix(0, &old_list()), 2);
    let events = p.take_events();
    let stored = stored_event_hashes(&events);
    assert!(
        !stored.contains(&old_list()[2]) && !stored.contains(&old_list()[3]),
        "stale keys announced: {events:?}"
    );
    assert!(events.contains(&KvEvent::Stored {
        group: 0,
        hashes: new[2..].to_vec(),
        parent: Some(new[1]),
        block_size: BS as u32,
    }));
}

/// The planner read the session's third hash during a lookup (blocks 0 and 1 were on CPU,
/// so it read at least up to the first miss), then the list was truncated to two blocks
/// and regrown. Computing the new blocks must store them under their new keys.
#[test]
fn hash_read_by_a_lookup_then_rewritten_is_never_stored_or_served() {
    let mut p = planner(16, 1, false);
    let (old, new) = (old_list(), new_list());
    store_prompt(&mut p, "a", &old[..2], 0);
    p.take_events();
    assert_eq!(p.lookup("s", &old, 65, 0), Ok(32));
    let gpu = [10, 11, 12, 13, 14];
    p.on_alloc("s", &[&gpu], 0, 32).unwrap();
    let load = idle_step(&mut p).loads.remove(0);
    p.complete(load.id, true).unwrap();
    step(&mut p, [new_req("s", 32, &gpu, &old)]);

    let store = step(&mut p, [running("s", 64, &[], &new)]).store.unwrap();
    assert_eq!(store.gpu_blocks, vec![12, 13]);
    assert_eq!(store_keys(&p, &store), new[2..].to_vec());
    complete_on_every_rank(&mut p, store.id);
    assert_new_content_published(&mut p);
    assert_old_content_not_served(&mut p);
    assert_eq!(p.stats().rewritten_hash_lists, 1);
}

/// The planner read all four hashes to store the session's blocks; then the server rolled
/// the session back to two computed blocks and regrew the list. Asked for the session's
/// next chunk, the planner must not offer its old blocks 2 and 3 (they hold the dropped
/// content), and must store the recomputed blocks.
#[test]
fn hashes_read_by_store_selection_then_rewritten_are_not_served_to_the_session() {
    let mut p = planner(16, 1, false);
    let (old, new) = (old_list(), new_list());
    let gpu = [0, 1, 2, 3, 4];
    step(&mut p, [new_req("s", 0, &gpu, &old)]);
    let first = step(&mut p, [running("s", 64, &[], &old)]).store.unwrap();
    assert_eq!(store_keys(&p, &first), old);
    complete_on_every_rank(&mut p, first.id);
    p.take_events();

    // The session waits for its next chunk with its first two blocks on the GPU.
    assert_eq!(p.lookup("s", &new, 65, 32), Ok(0));
    p.on_alloc("s", &[&gpu], 32, 0).unwrap();
    step(&mut p, [resumed("s", 32, &gpu, &new)]);
    let store = step(&mut p, [running("s", 64, &[], &new)]).store.unwrap();
    assert_eq!(store.gpu_blocks, vec![2, 3]);
    assert_eq!(store_keys(&p, &store), new[2..].to_vec());
    complete_on_every_rank(&mut p, store.id);
    assert_eq!(p.cache().ready_prefix(0, &new), 4);
    assert!(p.take_events().contains(&KvEvent::Stored {
        group: 0,
        hashes: new[2..].to_vec(),
        parent: Some(new[1]),
        block_size: BS as u32,
    }));
}

/// The rewritten list is first used by the request's final flush.
#[test]
fn stale_hash_is_caught_by_the_flush_at_request_finished() {
    let mut p = planner(16, 1, false);
    let (old, new) = (old_list(), new_list());
    store_prompt(&mut p, "a", &old[..2], 0);
    p.take_events();
    assert_eq!(p.lookup("s", &old, 65, 0), Ok(32));
    let gpu = [10, 11, 12, 13, 14];
    p.on_alloc("s", &[&gpu], 0, 0).unwrap();
    step(&mut p, [new_req("s", 0, &gpu, &old)]);

    assert!(p.request_finished("s", &new, 64).unwrap());
    let flush = idle_step(&mut p).store.unwrap();
    assert_eq!(flush.flush_req_ids, vec!["s".to_string()]);
    assert_eq!(flush.gpu_blocks, vec![12, 13]);
    assert_eq!(store_keys(&p, &flush), new[2..].to_vec());
    complete_on_every_rank(&mut p, flush.id);
    assert_eq!(p.take_completions().finished_sending, vec!["s".to_string()]);
    assert_new_content_published(&mut p);
    assert_old_content_not_served(&mut p);
}

/// A pinned hit past the truncation point is dropped, not loaded, when the rewrite is
/// seen by the request's next lookup.
#[test]
fn pinned_hit_past_the_truncation_point_is_released() {
    let mut p = planner(16, 1, false);
    let (old, new) = (old_list(), new_list());
    store_prompt(&mut p, "a", &old, 0);
    assert_eq!(p.lookup("s", &old, 65, 0), Ok(64));
    assert_eq!(pinned(&p), 4);
    assert_eq!(p.lookup("s", &new, 65, 0), Ok(32));
    assert_eq!(pinned(&p), 2);
    p.on_alloc("s", &[[10, 11, 12, 13, 14]], 0, 32).unwrap();
    let load = idle_step(&mut p).loads.remove(0);
    assert!(load.valid);
    assert_eq!(load.cpu_blocks.len(), 2);
    p.complete(load.id, true).unwrap();
    assert_eq!(pinned(&p), 0);
}

/// A hit that starts after the GPU prefix is read from there on, so the planner knows no
/// hash before it; a rewrite of the hit's blocks must still drop the pinned run.
#[test]
fn pinned_hit_after_the_gpu_prefix_is_rechecked_when_asked_again() {
    let mut p = planner(16, 1, false);
    let (old, new) = (old_list(), new_list());
    store_prompt(&mut p, "a", &old, 0);
    assert_eq!(p.lookup("s", &old, 65, 32), Ok(32));
    assert_eq!(pinned(&p), 2);
    assert_eq!(p.lookup("s", &new, 65, 32), Ok(0));
    assert_eq!(pinned(&p), 0);
    p.on_alloc("s", &[[10, 11, 12, 13, 14]], 32, 0).unwrap();
    assert!(idle_step(&mut p).is_empty());
}

/// The list only shrank (nothing regrown yet): nothing past it is stored, and what
/// regrows later is read afresh.
#[test]
fn list_that_only_shrank_forgets_the_dropped_hashes() {
    let mut p = planner(16, 1, false);
    let (old, new) = (old_list(), new_list());
    store_prompt(&mut p, "a", &old[..2], 0);
    p.take_events();
    assert_eq!(p.lookup("s", &old, 65, 0), Ok(32));
    let gpu = [10, 11, 12, 13, 14];
    p.on_alloc("s", &[&gpu], 0, 0).unwrap();
    step(&mut p, [new_req("s", 0, &gpu, &old)]);

    let shrunk = &new[..2];
    // Its three computed blocks have two hashes: the planner stores nothing it cannot
    // name (both are on CPU already).
    assert!(step(&mut p, [running("s", 48, &[], shrunk)]).is_empty());
    assert_eq!(p.lookup("s", shrunk, 33, 0), Ok(32));
    p.on_alloc("s", &[&gpu], 0, 0).unwrap();
    let store = step(&mut p, [running("s", 64, &[], &new)]).store.unwrap();
    assert_eq!(store_keys(&p, &store), new[2..].to_vec());
    complete_on_every_rank(&mut p, store.id);
    assert_new_content_published(&mut p);
    assert_old_content_not_served(&mut p);
    // A shrink is not a rewrite: nothing that remains changed.
    assert_eq!(p.stats().rewritten_hash_lists, 0);
}

/// Truncated and regrown with the same content: nothing needs forgetting, the pinned hit
/// is kept, and the blocks are stored under their (unchanged) keys.
#[test]
fn identical_regrowth_keeps_what_the_planner_knew() {
    let mut p = planner(16, 1, false);
    let old = old_list();
    store_prompt(&mut p, "a", &old[..2], 0);
    assert_eq!(p.lookup("s", &old, 65, 0), Ok(32));
    let regrown: Vec<BlockHash> = old[..2].iter().chain(&old[2..]).copied().collect();
    let cached = p.stats().cached_lookups;
    assert_eq!(p.lookup("s", &regrown, 65, 0), Ok(32));
    assert_eq!(p.stats().cached_lookups, cached + 1);
    assert_eq!(pinned(&p), 2);
    let gpu = [10, 11, 12, 13, 14];
    p.on_alloc("s", &[&gpu], 0, 32).unwrap();
    let load = step(&mut p, [new_req("s", 32, &gpu, &regrown)])
        .loads
        .remove(0);
    assert!(load.valid);
    p.complete(load.id, true).unwrap();
    let store = step(&mut p, [running("s", 64, &[], &regrown)])
        .store
        .unwrap();
    assert_eq!(store_keys(&p, &store), old[2..].to_vec());
    assert_eq!(p.stats().rewritten_hash_lists, 0);
}

#[test]
fn every_rewrite_is_counted() {
    let mut p = planner(16, 1, false);
    let gpu: Vec<u32> = (0..8).collect();
    let first = hashes(1, 4);
    step(&mut p, [new_req("s", 0, &gpu, &first)]);
    step(&mut p, [running("s", 64, &[], &first)]);
    // Rolled back to one block and regrown twice with other content.
    let mut second = first[..1].to_vec();
    second.extend(&hashes(2, 5)[1..]);
    step(&mut p, [running("s", 80, &[], &second)]);
    let mut third = second[..3].to_vec();
    third.extend(&hashes(3, 6)[3..]);
    step(&mut p, [running("s", 96, &[], &third)]);
    assert_eq!(p.stats().rewritten_hash_lists, 2);
}

/// A server-side list that fails to convert some entries (or any at all).
#[derive(Debug, Clone)]
struct Flaky {
    hashes: Vec<BlockHash>,
    bad_index: Option<usize>,
    unreadable: bool,
}

impl Flaky {
    fn good(hashes: &[BlockHash]) -> Self {
        Self {
            hashes: hashes.to_vec(),
            bad_index: None,
            unreadable: false,
        }
    }

    fn bad_at(hashes: &[BlockHash], index: usize) -> Self {
        Self {
            bad_index: Some(index),
            ..Self::good(hashes)
        }
    }
}

impl HashSource for Flaky {
    fn num_hashes(&self) -> Result<usize, HashError> {
        if self.unreadable {
            return Err(HashError {
                index: 0,
                reason: "not a list".into(),
            });
        }
        Ok(self.hashes.len())
    }

    fn hash(&self, index: usize) -> Result<BlockHash, HashError> {
        if self.bad_index == Some(index) {
            return Err(HashError {
                index,
                reason: "expected bytes".into(),
            });
        }
        self.hashes.as_slice().hash(index)
    }
}

fn flaky_step<'a>(
    p: &mut Planner,
    reqs: impl IntoIterator<Item = (&'a str, ScheduleKind, usize, Vec<u32>, &'a Flaky)>,
) -> Result<offload_core::StepPlan, PlanError> {
    let reqs: Vec<_> = reqs
        .into_iter()
        .map(
            |(req_id, kind, computed, gpu_blocks, hashes)| ScheduledRequest {
                req_id,
                kind,
                num_computed_tokens: computed,
                num_scheduled_tokens: 0,
                gpu_blocks,
                hashes,
            },
        )
        .collect();
    p.schedule(reqs, [])
}

fn bad_hash(req: &str, index: usize) -> impl Fn(&PlanError) -> bool + '_ {
    move |e| matches!(e, PlanError::BadHash { req_id, source } if req_id == req && source.index == index)
}

#[test]
fn unreadable_hash_in_a_lookup_names_request_and_index_and_leaks_nothing() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 3);
    store_prompt(&mut p, "a", &h, 0);
    assert_eq!(p.lookup("s", &h, 49, 0), Ok(48));
    let err = p.lookup("s", &Flaky::bad_at(&h, 2), 49, 0).unwrap_err();
    assert!(bad_hash("s", 2)(&err), "{err}");
    assert!(err.to_string().contains("`s`") && err.to_string().contains("[2]"));
    let unreadable = Flaky {
        unreadable: true,
        ..Flaky::good(&h)
    };
    assert!(p.lookup("t", &unreadable, 49, 0).is_err());
    // The request can still be dropped, and its pins go with it.
    assert!(!p.request_finished("s", &h, 0).unwrap());
    assert!(!p.request_finished("t", &h, 0).unwrap());
    assert_eq!(pinned(&p), 0);
    assert_eq!(p.num_requests(), 0);
    assert_eq!(p.lookup("u", &h, 49, 0), Ok(48));
}

#[test]
fn unreadable_hash_in_a_step_fails_that_request_only() {
    let mut p = planner(16, 1, false);
    let (hx, hy) = (hashes(1, 2), hashes(2, 2));
    let (good_x, bad_x, good_y) = (Flaky::good(&hx), Flaky::bad_at(&hx, 1), Flaky::good(&hy));
    flaky_step(
        &mut p,
        [
            ("x", ScheduleKind::New, 0, vec![0, 1, 2], &good_x),
            ("y", ScheduleKind::New, 0, vec![3, 4, 5], &good_y),
        ],
    )
    .unwrap();
    let err = flaky_step(
        &mut p,
        [
            ("x", ScheduleKind::Running, 32, vec![], &bad_x),
            ("y", ScheduleKind::Running, 32, vec![], &good_y),
        ],
    )
    .unwrap_err();
    assert!(bad_hash("x", 1)(&err), "{err}");
    // The other request's blocks come with the next plan; the failed one is stored once
    // its hashes can be read.
    let next = flaky_step(
        &mut p,
        [
            ("x", ScheduleKind::Running, 32, vec![], &good_x),
            ("y", ScheduleKind::Running, 32, vec![], &good_y),
        ],
    )
    .unwrap();
    let store = next.store.unwrap();
    assert_eq!(store.gpu_blocks, vec![3, 4, 0, 1]);
    assert_eq!(store_keys(&p, &store), [&hy[..], &hx[..]].concat());
    complete_on_every_rank(&mut p, store.id);
    assert!(!p.request_finished("x", &hx, 32).unwrap());
    assert!(!p.request_finished("y", &hy, 32).unwrap());
    assert_eq!(pinned(&p), 0);
    assert!(!p.has_work_in_flight());
}

#[test]
fn unreadable_hash_at_finish_still_finishes_the_request() {
    let mut p = planner(16, 1, false);
    let h = hashes(1, 3);
    store_prompt(&mut p, "a", &h[..1], 0);
    assert_eq!(p.lookup("s", &h, 49, 0), Ok(16));
    let gpu = [5, 6, 7, 8];
    p.on_alloc("s", &[&gpu], 0, 0).unwrap();
    step(&mut p, [new_req("s", 0, &gpu, &h)]);
    let err = p
        .request_finished("s", &Flaky::bad_at(&h, 2), 48)
        .unwrap_err();
    assert!(bad_hash("s", 2)(&err), "{err}");
    assert_eq!(p.num_requests(), 0);
    assert_eq!(pinned(&p), 0);
    // Nothing half-read is flushed; later requests work as before.
    assert!(idle_step(&mut p).is_empty());
    store_prompt(&mut p, "b", &h, 20);
    assert_eq!(p.cache().ready_prefix(0, &h), 3);
}

/// Counts the hashes the planner reads.
#[derive(Debug)]
struct Counting<'a> {
    hashes: &'a [BlockHash],
    reads: Cell<usize>,
}

impl HashSource for Counting<'_> {
    fn num_hashes(&self) -> Result<usize, HashError> {
        Ok(self.hashes.len())
    }

    fn hash(&self, index: usize) -> Result<BlockHash, HashError> {
        self.reads.set(self.reads.get() + 1);
        self.hashes.hash(index)
    }
}

/// A decoding request confirms one block at a time: each such step reads the new hash
/// and the one that proves the known prefix unchanged, never the whole list; a step
/// without a newly confirmed block reads nothing.
#[test]
fn a_step_reads_only_the_hashes_it_needs() {
    let mut p = planner(64, 1, false);
    let h = hashes(1, 40);
    let gpu: Vec<u32> = (0..41).collect();
    step(&mut p, [new_req("s", 0, &gpu, &h)]);
    for blocks in 1..=40 {
        for computed in [blocks * BS - 1, blocks * BS] {
            let src = Counting {
                hashes: &h,
                reads: Cell::new(0),
            };
            let plan = p
                .schedule(
                    [ScheduledRequest {
                        req_id: "s",
                        kind: ScheduleKind::Running,
                        num_computed_tokens: computed,
                        num_scheduled_tokens: 0,
                        gpu_blocks: Vec::<u32>::new(),
                        hashes: &src,
                    }],
                    [],
                )
                .unwrap();
            let reads = src.reads.get();
            if computed % BS == 0 {
                assert!(plan.store.is_some());
                assert!(reads <= 2, "block {blocks}: {reads} hashes read");
            } else {
                assert!(plan.is_empty());
                assert_eq!(reads, 0, "block {blocks}: {reads} hashes read");
            }
        }
    }
}
