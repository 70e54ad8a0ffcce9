//! The remote tier wired into the planner and a worker's host memory, on an in-process
//! store: a prefix one engine wrote is fetched into CPU blocks by another and served as a
//! hit; a failed or corrupt fetch ends in recomputation, never in the same fetch offered
//! again; lookups never block on the store.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{
    FetchRequest, KeySpace, LayoutFingerprint, MemoryStore, ProbeQueue, RemoteTier, TierStats,
    WorkerTier,
};
use offload_core::transfer::{Direction, RegionSpec, TransferConfig, TransferEngine, TransferJob};
use offload_core::{
    BlockHash, BlockKey, GroupKind, KvEvent, LookupOutcome, Planner, PlannerConfig,
};

const BS: u32 = 16;
const FP: LayoutFingerprint = LayoutFingerprint(0x5eed);

fn chain(n: u128) -> Vec<BlockHash> {
    (1..=n).map(|i| BlockHash(i * 7919)).collect()
}

fn key_bytes(h: BlockHash) -> [u8; 16] {
    h.0.to_le_bytes()
}

fn tier(store: &MemoryStore, stats: &Arc<TierStats>) -> RemoteTier {
    let keys = KeySpace::new("t", FP).unwrap();
    RemoteTier::new(Box::new(store.clone()), keys, Arc::clone(stats))
}

fn planner(store: &MemoryStore, cpu_blocks: u32) -> Planner {
    let mut p = Planner::new(
        PlannerConfig::new(BS, cpu_blocks).with_events(true),
        &[GroupKind::FullAttention],
    );
    let stats = Arc::new(TierStats::default());
    p.attach_remote(ProbeQueue::spawn(tier(store, &stats)).unwrap(), stats);
    p
}

/// Asks until the probe answered: a hit, or pending on a planned fetch (the probe thread
/// answers as soon as it runs).
fn settle(p: &mut Planner, req: &str, hashes: &[BlockHash], num_tokens: usize) -> LookupOutcome {
    let start = Instant::now();
    loop {
        let out = p.lookup_tiered(req, hashes, num_tokens, 0).unwrap();
        let fetching = p.remote_stats().unwrap().0.fetches > 0;
        if out != LookupOutcome::Pending || fetching {
            return out;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "never answered");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Writes blocks as another engine would have (payload = the hash's bytes repeated).
fn write_remote(store: &MemoryStore, hashes: &[BlockHash], block_bytes: usize) {
    let stats = Arc::new(TierStats::default());
    let mut t = tier(store, &stats);
    let blocks: Vec<_> = hashes
        .iter()
        .map(|h| (key_bytes(*h), vec![payload(*h, block_bytes)]))
        .collect();
    assert_eq!(t.store(&blocks).unwrap(), hashes.len());
}

fn payload(h: BlockHash, len: usize) -> Vec<u8> {
    key_bytes(h).iter().copied().cycle().take(len).collect()
}

#[test]
fn fetched_blocks_are_announced_like_stored_ones() {
    let store = MemoryStore::default();
    let h = chain(5);
    write_remote(&store, &h[1..4], 8);
    let mut p = planner(&store, 8);
    common::planner::store_prompt(&mut p, "local", &h[..1], 0);
    p.take_events();
    assert_eq!(settle(&mut p, "a", &h, 81), LookupOutcome::Pending);
    let job = p.take_fetches().remove(0);
    assert_eq!((job.first_block, &job.hashes[..]), (1, &h[1..4]));
    assert_eq!(
        job.cpu_hashes, job.hashes,
        "group 0: the remote key is the hash"
    );
    assert!(
        p.take_events().is_empty(),
        "nothing is on CPU before the fetch is done"
    );
    // Two of the three blocks came: they are on CPU, chained after the local block.
    assert!(p.complete_fetch(job.id, 2).unwrap());
    assert_eq!(
        p.take_events(),
        vec![KvEvent::Stored {
            group: 0,
            hashes: h[1..3].to_vec(),
            parent: Some(h[0]),
            block_size: BS,
        }]
    );
}

#[test]
fn without_a_remote_tier_the_lookup_is_the_local_one() {
    let mut p = Planner::new(PlannerConfig::new(BS, 8), &[GroupKind::FullAttention]);
    let h = chain(4);
    assert!(!p.has_remote());
    assert_eq!(
        p.lookup_tiered("a", &h, 65, 0).unwrap(),
        LookupOutcome::Hit {
            tokens: 0,
            remote_tokens: 0
        }
    );
    assert!(p.take_fetches().is_empty());
}

#[test]
fn a_remote_prefix_is_pending_then_fetched_then_a_hit() {
    let store = MemoryStore::default();
    let h = chain(5);
    write_remote(&store, &h[..3], 8);
    let mut p = planner(&store, 8);
    store.pause();
    assert_eq!(
        p.lookup_tiered("a", &h, 81, 0).unwrap(),
        LookupOutcome::Pending,
        "the probe is in flight; the lookup does not wait for it"
    );
    store.resume();
    assert_eq!(settle(&mut p, "a", &h, 81), LookupOutcome::Pending);
    let jobs = p.take_fetches();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].hashes, h[..3].to_vec());
    assert_eq!(
        p.lookup_tiered("a", &h, 81, 0).unwrap(),
        LookupOutcome::Pending,
        "still fetching"
    );
    p.complete_fetch(jobs[0].id, 3).unwrap();
    let hit = LookupOutcome::Hit {
        tokens: 48,
        remote_tokens: 48,
    };
    assert_eq!(p.lookup_tiered("a", &h, 81, 0).unwrap(), hit);
    assert_eq!(p.lookup_tiered("a", &h, 81, 0).unwrap(), hit, "asked again");
    let (s, _) = p.remote_stats().unwrap();
    assert_eq!((s.fetched_blocks, s.remote_hit_tokens), (3, 48));
    // The fetched blocks load like any local hit.
    p.on_alloc("a", &[[10, 11, 12, 13, 14, 15]], 0, 48).unwrap();
    let plan = p.schedule::<Vec<BlockHash>, Vec<u32>>([], []).unwrap();
    assert_eq!(plan.loads[0].cpu_blocks, jobs[0].cpu_blocks);
    // Another request finds them locally: no second fetch.
    assert_eq!(
        p.lookup_tiered("b", &h[..3], 49, 0).unwrap(),
        LookupOutcome::Hit {
            tokens: 48,
            remote_tokens: 0
        }
    );
    assert_eq!(p.remote_stats().unwrap().0.fetches, 1);
}

#[test]
fn a_failed_fetch_is_recomputed_and_never_offered_again() {
    let store = MemoryStore::default();
    let h = chain(5);
    write_remote(&store, &h[..4], 8);
    let mut p = planner(&store, 8);
    assert_eq!(settle(&mut p, "a", &h, 81), LookupOutcome::Pending);
    let jobs = p.take_fetches();
    assert_eq!(jobs[0].hashes.len(), 4);
    // The worker filled the first block only (the second was corrupt or missing).
    p.complete_fetch(jobs[0].id, 1).unwrap();
    let one = LookupOutcome::Hit {
        tokens: 16,
        remote_tokens: 16,
    };
    for _ in 0..3 {
        assert_eq!(
            p.lookup_tiered("a", &h, 81, 0).unwrap(),
            one,
            "no second wait"
        );
    }
    // vLLM re-asks after the request is dropped (a failed load): a fresh lookup cuts the
    // chain at the block that failed, without a probe.
    p.request_finished("a", &h, 0).unwrap();
    let probes = p.remote_stats().unwrap().1.probe_round_trips;
    assert_eq!(
        p.lookup_tiered("a", &h, 81, 0).unwrap(),
        LookupOutcome::Hit {
            tokens: 16,
            remote_tokens: 0
        }
    );
    let (s, t) = p.remote_stats().unwrap();
    assert_eq!(t.probe_round_trips, probes);
    assert_eq!(
        (s.fetches, s.failed_fetch_blocks, s.skipped_failed),
        (1, 3, 1)
    );
    assert!(p.take_fetches().is_empty());
}

#[test]
fn a_missing_remote_prefix_is_one_probe_then_a_miss() {
    let store = MemoryStore::default();
    let mut p = planner(&store, 8);
    let h = chain(3);
    let miss = LookupOutcome::Hit {
        tokens: 0,
        remote_tokens: 0,
    };
    let start = Instant::now();
    while p.lookup_tiered("a", &h, 49, 0).unwrap() == LookupOutcome::Pending {
        assert!(start.elapsed() < Duration::from_secs(30), "never answered");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(p.lookup_tiered("a", &h, 49, 0).unwrap(), miss);
    assert_eq!(p.remote_stats().unwrap().1.probe_round_trips, 1);
    assert!(p.take_fetches().is_empty());
}

/// A host engine of 4 CPU blocks over two regions of 8 bytes each (16-byte blocks).
fn engine(device: &mut [u8]) -> TransferEngine {
    let base = device.as_mut_ptr() as u64;
    // SAFETY: `device` outlives the engine in every test, and is not touched meanwhile.
    let regions = unsafe {
        vec![
            RegionSpec::new(base, 4, 8, 8).unwrap(),
            RegionSpec::new(base + 32, 4, 8, 8).unwrap(),
        ]
    };
    TransferEngine::new(regions, 4, TransferConfig::default()).unwrap()
}

fn wait_reports(t: &WorkerTier) -> Vec<(u64, usize)> {
    let start = Instant::now();
    loop {
        let r = t.take_reports();
        if !r.is_empty() {
            return r;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no report");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn stored_blocks_are_written_behind_and_fetched_into_another_engines_blocks() {
    let store = MemoryStore::default();
    let stats = Arc::new(TierStats::default());
    let h = chain(2);
    // Engine A stores device blocks 1 and 2 into CPU blocks 0 and 1, then writes them.
    let mut dev_a: Vec<u8> = (0..64).collect();
    let a = engine(&mut dev_a);
    a.submit(TransferJob::new(1, Direction::Store, vec![(1, 0), (2, 1)]))
        .unwrap();
    a.wait_for(&[1], Duration::from_secs(30)).unwrap();
    let mut wa = WorkerTier::spawn(
        a.host_blocks(),
        tier(&store, &stats),
        Some(tier(&store, &stats)),
        1 << 20,
    )
    .unwrap();
    // SAFETY: the store completed and nothing else uses the engine.
    let taken = unsafe { wa.write_stored(&[key_bytes(h[0]), key_bytes(h[1])], &[0, 1]) };
    assert_eq!(taken, 2);
    wa.shutdown(Duration::from_secs(30));
    assert_eq!(wa.stats().writes_done, 2);

    // Engine B fetches them into CPU blocks 3 and 2 and loads them to device blocks 0, 3.
    let mut dev_b = vec![0u8; 64];
    let b = engine(&mut dev_b);
    let stats_b = Arc::new(TierStats::default());
    let wb = WorkerTier::spawn(b.host_blocks(), tier(&store, &stats_b), None, 0).unwrap();
    let req = FetchRequest {
        id: 7,
        hashes: h.iter().map(|x| key_bytes(*x).to_vec()).collect(),
        cpu_blocks: vec![3, 2],
    };
    // SAFETY: blocks 2 and 3 are used by nothing else until the report.
    unsafe { wb.fetch(req) };
    assert_eq!(wait_reports(&wb), vec![(7, 2)]);
    b.submit(TransferJob::new(2, Direction::Load, vec![(0, 3), (3, 2)]))
        .unwrap();
    b.wait_for(&[2], Duration::from_secs(30)).unwrap();
    drop(b);
    // Region 0 is bytes 0..32, region 1 bytes 32..64; A's device block 1 -> B's block 0.
    assert_eq!(dev_b[0..8], dev_a[8..16]);
    assert_eq!(dev_b[32..40], dev_a[40..48]);
    assert_eq!(dev_b[24..32], dev_a[16..24]);
    assert_eq!(dev_b[56..64], dev_a[48..56]);
    drop(a);
}

#[test]
fn a_corrupt_or_missing_value_fills_only_the_blocks_before_it() {
    let store = MemoryStore::default();
    let h = chain(3);
    write_remote(&store, &h, 16);
    // Flip one payload byte of the second block's value.
    let key = KeySpace::new("t", FP)
        .unwrap()
        .key(&key_bytes(h[1]))
        .unwrap();
    let mut v = store.get_raw(&key).unwrap();
    let last = v.len() - 9;
    v[last] ^= 0xff;
    store.set_raw(key, v);
    let mut dev = vec![0u8; 64];
    let e = engine(&mut dev);
    let stats = Arc::new(TierStats::default());
    let w = WorkerTier::spawn(e.host_blocks(), tier(&store, &stats), None, 0).unwrap();
    let req = |id, hs: &[BlockHash]| FetchRequest {
        id,
        hashes: hs.iter().map(|x| key_bytes(*x).to_vec()).collect(),
        cpu_blocks: (0..hs.len() as u32).collect(),
    };
    // SAFETY: nothing else uses the engine's blocks.
    unsafe { w.fetch(req(1, &h)) };
    assert_eq!(wait_reports(&w), vec![(1, 1)]);
    assert_eq!(w.stats().corrupt_values, 1);
    let absent = [h[0], BlockHash(1), h[2]];
    // SAFETY: as above; the previous fetch reported.
    unsafe { w.fetch(req(2, &absent)) };
    assert_eq!(wait_reports(&w), vec![(2, 1)]);
    // A request naming one CPU block twice would fill two aliased destinations: refused.
    let twice = FetchRequest {
        id: 3,
        hashes: vec![key_bytes(h[0]).to_vec(); 2],
        cpu_blocks: vec![0, 0],
    };
    // SAFETY: as above; the previous fetch reported.
    unsafe { w.fetch(twice) };
    assert_eq!(wait_reports(&w), vec![(3, 0)]);
}

#[test]
fn a_failed_load_of_fetched_blocks_is_recomputed_not_fetched_again() {
    let store = MemoryStore::default();
    let h = chain(5);
    write_remote(&store, &h[..3], 8);
    let mut p = planner(&store, 8);
    assert_eq!(settle(&mut p, "a", &h, 81), LookupOutcome::Pending);
    let fetch = p.take_fetches().remove(0);
    p.complete_fetch(fetch.id, 3).unwrap();
    assert!(matches!(
        p.lookup_tiered("a", &h, 81, 0).unwrap(),
        LookupOutcome::Hit { tokens: 48, .. }
    ));
    p.on_alloc("a", &[[10, 11, 12, 13, 14, 15]], 0, 48).unwrap();
    let plan = p.schedule::<Vec<BlockHash>, Vec<u32>>([], []).unwrap();
    p.complete(plan.loads[0].id, false).unwrap();
    // vLLM asks again for a request whose async load failed: the failed blocks left the
    // CPU tier, and the answer is to recompute, not another round of the same fetch.
    let probes = p.remote_stats().unwrap().1.probe_round_trips;
    for _ in 0..3 {
        assert_eq!(
            p.lookup_tiered("a", &h, 81, 0).unwrap(),
            LookupOutcome::Hit {
                tokens: 0,
                remote_tokens: 0
            }
        );
    }
    assert_eq!(p.remote_stats().unwrap().1.probe_round_trips, probes);
    assert_eq!(p.remote_stats().unwrap().0.fetches, 1);
    assert!(p.take_fetches().is_empty());
}

/// A planner of a full-attention group and a 2-block sliding window, with a remote tier.
fn hybrid_planner(store: &MemoryStore) -> Planner {
    let kinds = [
        GroupKind::FullAttention,
        GroupKind::SlidingWindow { window: 2 * BS },
    ];
    let mut p = Planner::new(PlannerConfig::new(BS, 16).with_events(true), &kinds);
    let stats = Arc::new(TierStats::default());
    p.attach_remote(ProbeQueue::spawn(tier(store, &stats)).unwrap(), stats);
    p
}

#[test]
fn a_hybrid_models_remote_hit_is_what_every_group_can_serve() {
    let store = MemoryStore::default();
    let h = chain(5);
    // Another engine stored every full-attention block and the sliding blocks of the
    // prompt's last window (blocks 3 and 4 for a hit ending at block 5).
    write_remote(&store, &h, 8);
    let window: Vec<BlockHash> = h[3..]
        .iter()
        .map(|x| BlockKey::new(1, *x).remote_hash())
        .collect();
    write_remote(&store, &window, 8);
    let mut p = hybrid_planner(&store);
    assert_eq!(settle(&mut p, "a", &h, 81), LookupOutcome::Pending);
    let job = p.take_fetches().remove(0);
    let wanted = vec![(0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (0, 4), (1, 4)];
    assert_eq!(
        job.blocks, wanted,
        "each group's blocks, position by position"
    );
    assert!(p.complete_fetch(job.id, job.cpu_blocks.len()).unwrap());
    let hit = LookupOutcome::Hit {
        tokens: 80,
        remote_tokens: 80,
    };
    assert_eq!(p.lookup_tiered("a", &h, 81, 0).unwrap(), hit);
    // Fetched chains are announced per group, under the CPU hashes the fetch named
    // (not the remote keys, which differ outside group 0).
    let stored = common::planner::stored_event_keys(p.take_events());
    let mut announced: Vec<(u32, BlockHash)> = job
        .blocks
        .iter()
        .map(|&(g, _)| g)
        .zip(job.cpu_hashes.iter().copied())
        .collect();
    assert_ne!(job.cpu_hashes, job.hashes);
    announced.sort_unstable();
    assert_eq!(stored, announced);
    // The load fills every full-attention block and the window's sliding blocks.
    let tables = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]];
    p.on_alloc("a", &tables, 0, 80).unwrap();
    let plan = p.schedule::<Vec<BlockHash>, Vec<u32>>([], []).unwrap();
    assert_eq!(plan.loads[0].gpu_blocks, vec![10, 11, 12, 13, 14, 23, 24]);
}

#[test]
fn a_hybrid_remote_prefix_without_its_window_is_no_hit() {
    let store = MemoryStore::default();
    let h = chain(5);
    // Only the full-attention blocks: no hit ending anywhere has its sliding window.
    write_remote(&store, &h, 8);
    let mut p = hybrid_planner(&store);
    assert_eq!(settle(&mut p, "a", &h, 81), LookupOutcome::Pending);
    let job = p.take_fetches().remove(0);
    assert!(p.complete_fetch(job.id, job.cpu_blocks.len()).unwrap());
    assert_eq!(
        p.lookup_tiered("a", &h, 81, 0).unwrap(),
        LookupOutcome::Hit {
            tokens: 0,
            remote_tokens: 0
        }
    );
}
