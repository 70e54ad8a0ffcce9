//! The transfer engine through its public API with the host backend: round trips through
//! contiguous and strided regions, ordering, fences, validation, construction and the
//! bounded queue.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};
use offload_core::transfer::{
    BackendError, BlockAccessError, BlockSide, CopyBackend, CopyRun, Direction, HostCopyBackend,
    JobError, RegionSpec, SubmitError, Ticket, TransferConfig, TransferEngine,
};

use common::rng::Rng;
use common::transfer::{config, drain, job, run_one, FakeGpu, WAIT};

#[test]
fn engine_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<TransferEngine>();
}

#[test]
fn round_trip_through_contiguous_and_strided_regions() {
    let gpu_blocks = 32;
    let bufs = [
        FakeGpu::new(32 * 64),
        FakeGpu::new(31 * 80 + 48),
        FakeGpu::new(32 * 16),
    ];
    let specs = [
        bufs[0].region(gpu_blocks, 64, 64),
        bufs[1].region(gpu_blocks, 48, 80),
        bufs[2].region(gpu_blocks, 16, 16),
    ];
    let mut rng = Rng::new(7);
    for buf in &bufs {
        rng.fill(buf.bytes_mut());
    }
    let originals: Vec<Vec<u8>> = bufs.iter().map(|b| b.bytes().to_vec()).collect();
    let mut engine = TransferEngine::new(specs.to_vec(), 40, config()).unwrap();
    assert_eq!(engine.cpu_block_bytes(), 64 + 48 + 16);
    assert_eq!(engine.host_bytes(), 40 * (64 + 48 + 16));

    let stored = [(0, 5), (1, 6), (2, 7), (10, 0), (20, 39), (21, 38), (31, 1)];
    let done = run_one(&engine, job(1, Direction::Store, &stored));
    assert_eq!(done.result, Ok(()));
    assert_eq!(done.bytes, 7 * 128);
    for (r, (spec, buf)) in specs.iter().zip(&bufs).enumerate() {
        for &(g, c) in &stored {
            assert_eq!(engine.cpu_block_slice(r, c).unwrap(), buf.block(spec, g));
        }
    }

    for buf in &bufs {
        buf.bytes_mut().fill(0);
    }
    let moved = |g: u32| (g + 1) % gpu_blocks;
    let loads: Vec<(u32, u32)> = stored.iter().map(|&(g, c)| (moved(g), c)).collect();
    let done = run_one(&engine, job(2, Direction::Load, &loads));
    assert_eq!(done.result, Ok(()));
    for (r, (spec, buf)) in specs.iter().zip(&bufs).enumerate() {
        // Whole-buffer comparison: loaded blocks hold the originals, and everything else,
        // the strided region's gaps included, is untouched.
        let mut expected = vec![0u8; buf.len()];
        for &(g, _) in &stored {
            let (src, dst) = (
                g as usize * spec.block_stride(),
                moved(g) as usize * spec.block_stride(),
            );
            expected[dst..dst + spec.block_bytes()]
                .copy_from_slice(&originals[r][src..src + spec.block_bytes()]);
        }
        assert_eq!(buf.bytes(), &expected[..], "region {r}");
    }

    let stats = engine.stats();
    assert_eq!(stats.jobs_submitted, 2);
    assert_eq!(stats.jobs_succeeded, 2);
    assert_eq!(stats.blocks_stored, 7);
    assert_eq!(stats.blocks_loaded, 7);
    assert_eq!(stats.bytes_stored, 7 * 128);
    assert_eq!(stats.bytes_loaded, 7 * 128);
    // Store: runs {0-2}, {10}, {20}, {21}, {31} = 5 per contiguous region, 7 strided.
    // Load: {1-3}, {11}, {21}, {22}, {0} = 5, 5, 7 again.
    assert_eq!(stats.runs_submitted, 2 * (5 + 7 + 5));
}

#[test]
fn completions_of_each_direction_arrive_in_submission_order() {
    let buf = FakeGpu::new(16 * 8);
    let engine = TransferEngine::new(vec![buf.region(16, 8, 8)], 16, config()).unwrap();
    for id in 0..20u64 {
        let pairs = [((id % 16) as u32, ((id * 3) % 16) as u32)];
        let direction = if id % 2 == 0 {
            Direction::Store
        } else {
            Direction::Load
        };
        engine.submit(job(id, direction, &pairs)).unwrap();
    }
    let done = drain(&engine, 20);
    for (direction, first) in [(Direction::Store, 0), (Direction::Load, 1)] {
        let ids: Vec<u64> = done
            .iter()
            .filter(|c| c.direction == direction)
            .map(|c| c.id)
            .collect();
        assert_eq!(
            ids,
            (first..20).step_by(2).collect::<Vec<_>>(),
            "{direction}"
        );
    }
    assert!(done.iter().all(|c| c.result.is_ok() && c.bytes == 8));
    let mut more = Vec::new();
    engine.poll_completions(&mut more);
    assert!(more.is_empty());
}

#[test]
fn wait_for_returns_its_jobs_and_keeps_the_others() {
    let buf = FakeGpu::new(16 * 8);
    let engine = TransferEngine::new(vec![buf.region(16, 8, 8)], 16, config()).unwrap();
    for id in 1..=5u64 {
        engine
            .submit(job(id, Direction::Store, &[(id as u32, id as u32)]))
            .unwrap();
    }
    let mut got = engine.wait_for(&[4, 2, 2], WAIT).unwrap();
    got.sort_by_key(|c| c.id);
    assert_eq!(got.iter().map(|c| c.id).collect::<Vec<_>>(), [2, 4]);
    let rest = drain(&engine, 3);
    assert_eq!(rest.iter().map(|c| c.id).collect::<Vec<_>>(), [1, 3, 5]);
    // Already-reported and never-submitted ids are fenced trivially.
    assert_eq!(
        engine.wait_for(&[1, 2, 99], Duration::ZERO).unwrap(),
        vec![]
    );
}

#[test]
fn invalid_jobs_fail_whole_and_copy_nothing() {
    let buf = FakeGpu::new(8 * 4);
    buf.bytes_mut().fill(0xEE);
    let mut engine = TransferEngine::new(vec![buf.region(8, 4, 4)], 6, config()).unwrap();
    type Case = (Direction, &'static [(u32, u32)], JobError);
    let cases: [Case; 4] = [
        (
            Direction::Store,
            &[(0, 0), (8, 1)],
            JobError::InvalidBlock {
                side: BlockSide::Gpu,
                id: 8,
                limit: 8,
            },
        ),
        (
            Direction::Store,
            &[(0, 0), (1, 6)],
            JobError::InvalidBlock {
                side: BlockSide::Cpu,
                id: 6,
                limit: 6,
            },
        ),
        (
            Direction::Store,
            &[(0, 0), (1, 2), (2, 2)],
            JobError::DuplicateDestination {
                side: BlockSide::Cpu,
                id: 2,
            },
        ),
        (
            Direction::Load,
            &[(3, 0), (4, 1), (3, 2)],
            JobError::DuplicateDestination {
                side: BlockSide::Gpu,
                id: 3,
            },
        ),
    ];
    for (i, (direction, pairs, expected)) in cases.into_iter().enumerate() {
        let done = run_one(&engine, job(i as u64, direction, pairs));
        assert_eq!(done.bytes, 0);
        let err = done.result.unwrap_err();
        let named = match &expected {
            JobError::InvalidBlock { id, .. } | JobError::DuplicateDestination { id, .. } => {
                id.to_string()
            }
            _ => unreachable!(),
        };
        assert!(err.to_string().contains(&named), "{err}");
        assert_eq!(err, expected);
    }
    for c in 0..6 {
        assert!(engine
            .cpu_block_slice(0, c)
            .unwrap()
            .iter()
            .all(|&b| b == 0));
    }
    assert!(buf.bytes().iter().all(|&b| b == 0xEE));
    // One device block stored to two CPU blocks is two reads: allowed.
    let done = run_one(&engine, job(9, Direction::Store, &[(5, 0), (5, 1)]));
    assert_eq!(done.result, Ok(()));
    assert_eq!(engine.cpu_block_slice(0, 1).unwrap(), [0xEE; 4]);
    let stats = engine.stats();
    assert_eq!((stats.jobs_failed, stats.jobs_succeeded), (4, 1));
    // An empty job succeeds without touching the backend.
    let done = run_one(&engine, job(10, Direction::Load, &[]));
    assert_eq!((done.result, done.bytes), (Ok(()), 0));
}

#[test]
fn bad_construction_is_refused_with_the_value() {
    let buf = FakeGpu::new(64);
    let spec = buf.region(8, 8, 8);
    let err = TransferEngine::new(vec![spec], 0, config()).unwrap_err();
    assert!(err.to_string().contains("num_cpu_blocks = 0"), "{err}");
    let err = TransferEngine::new(vec![], 4, config()).unwrap_err();
    assert!(err.to_string().contains("regions"), "{err}");
    let bad = TransferConfig {
        queue_capacity: 0,
        ..config()
    };
    let err = TransferEngine::new(vec![spec], 4, bad).unwrap_err();
    assert!(err.to_string().contains("queue_capacity = 0"), "{err}");
    let bad = TransferConfig {
        max_in_flight: 0,
        ..config()
    };
    let err = TransferEngine::new(vec![spec], 4, bad).unwrap_err();
    assert!(err.to_string().contains("max_in_flight = 0"), "{err}");
    let huge = vec![spec; 3];
    let err = TransferEngine::new(huge, u32::MAX, config());
    // 3 * 8 * 4G = 96 GiB does not fit in a test machine; either refusal names a value.
    if let Err(err) = err {
        assert!(
            err.to_string().contains("bytes") || err.to_string().contains("usize"),
            "{err}"
        );
    }
}

#[test]
fn cpu_block_slice_checks_region_and_id() {
    let buf = FakeGpu::new(64);
    let mut engine = TransferEngine::new(vec![buf.region(8, 8, 8)], 4, config()).unwrap();
    assert_eq!(
        engine.cpu_block_slice(1, 0).unwrap_err(),
        BlockAccessError::NoSuchRegion {
            region: 1,
            count: 1
        }
    );
    assert_eq!(
        engine.cpu_block_slice(0, 4).unwrap_err(),
        BlockAccessError::InvalidBlock { id: 4, limit: 4 }
    );
    engine.cpu_block_slice_mut(0, 3).unwrap().fill(9);
    let done = run_one(&engine, job(1, Direction::Load, &[(7, 3)]));
    assert_eq!(done.result, Ok(()));
    assert_eq!(&buf.bytes()[56..64], [9; 8]);
}

/// Wraps the host backend; the first submit signals `entered` and then waits for
/// `release`, so a test can hold the copy thread still.
struct GateBackend {
    inner: HostCopyBackend,
    entered: Sender<()>,
    release: Receiver<()>,
    gated: bool,
}

impl CopyBackend for GateBackend {
    fn name(&self) -> &'static str {
        "gate"
    }

    unsafe fn submit(
        &mut self,
        direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError> {
        if !self.gated {
            self.gated = true;
            let _ = self.entered.send(());
            let _ = self.release.recv();
        }
        // SAFETY: forwarded from our caller.
        unsafe { self.inner.submit(direction, runs) }
    }

    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
        self.inner.query(ticket)
    }
}

#[test]
fn full_queue_refuses_without_blocking() {
    let buf = FakeGpu::new(16 * 8);
    let (entered_tx, entered_rx) = bounded(1);
    let (release_tx, release_rx) = bounded(1);
    let backend = GateBackend {
        inner: HostCopyBackend::new(),
        entered: entered_tx,
        release: release_rx,
        gated: false,
    };
    let cfg = TransferConfig {
        queue_capacity: 4,
        ..config()
    };
    let engine =
        TransferEngine::with_backend(vec![buf.region(16, 8, 8)], 16, cfg, backend).unwrap();
    assert_eq!(engine.backend_name(), "gate");
    engine.submit(job(0, Direction::Store, &[(0, 0)])).unwrap();
    entered_rx.recv_timeout(WAIT).unwrap();
    for id in 1..=4 {
        engine
            .submit(job(id, Direction::Store, &[(id as u32, id as u32)]))
            .unwrap();
    }
    let err = engine
        .submit(job(5, Direction::Store, &[(5, 5)]))
        .unwrap_err();
    assert_eq!(err, SubmitError::QueueFull { id: 5, capacity: 4 });
    assert!(err.to_string().contains("job 5"), "{err}");
    let err = engine
        .submit(job(3, Direction::Store, &[(6, 6)]))
        .unwrap_err();
    assert_eq!(err, SubmitError::DuplicateJobId { id: 3 });
    release_tx.send(()).unwrap();
    let done = engine.wait_for(&[0, 1, 2, 3, 4], WAIT).unwrap();
    assert_eq!(done.len(), 5);
    assert!(done.iter().all(|c| c.result.is_ok()));
    // The refused id was never in flight, so it can be reused.
    assert_eq!(
        run_one(&engine, job(5, Direction::Store, &[(5, 5)])).result,
        Ok(())
    );
    assert_eq!(engine.stats().jobs_submitted, 6);
}

/// Builds random regions and jobs from `seed`, stores to CPU, wipes the device buffers,
/// loads into other device ids, and checks every byte of every buffer.
fn round_trip(
    seed: u64,
    shapes: &[(usize, usize)],
    gpu_blocks: &[u32],
    num_cpu: u32,
    count: usize,
) {
    let mut rng = Rng::new(seed);
    let bufs: Vec<FakeGpu> = shapes
        .iter()
        .zip(gpu_blocks)
        .map(|(&(bytes, stride), &n)| FakeGpu::new((n as usize - 1) * stride + bytes))
        .collect();
    let specs: Vec<RegionSpec> = shapes
        .iter()
        .zip(gpu_blocks)
        .zip(&bufs)
        .map(|((&(bytes, stride), &n), buf)| buf.region(n, bytes, stride))
        .collect();
    for buf in &bufs {
        rng.fill(buf.bytes_mut());
    }
    let originals: Vec<Vec<u8>> = bufs.iter().map(|b| b.bytes().to_vec()).collect();
    let gpu_limit = *gpu_blocks.iter().min().unwrap();
    let count = count.min(gpu_limit as usize).min(num_cpu as usize);

    // Pairs with distinct ids on both sides, often in consecutive runs.
    let distinct = |rng: &mut Rng, limit: u32| -> Vec<u32> {
        let mut used = vec![false; limit as usize];
        let mut out: Vec<u32> = Vec::with_capacity(count);
        while out.len() < count {
            let next = match out.last() {
                Some(&last)
                    if rng.below(4) != 0 && last + 1 < limit && !used[last as usize + 1] =>
                {
                    last + 1
                }
                _ => rng.below_u32(limit),
            };
            if !used[next as usize] {
                used[next as usize] = true;
                out.push(next);
            }
        }
        out
    };
    let src_gpu = distinct(&mut rng, gpu_limit);
    let cpu = distinct(&mut rng, num_cpu);
    let dst_gpu = distinct(&mut rng, gpu_limit);
    let stores: Vec<(u32, u32)> = src_gpu.iter().copied().zip(cpu.iter().copied()).collect();
    let loads: Vec<(u32, u32)> = dst_gpu.iter().copied().zip(cpu.iter().copied()).collect();

    let engine = TransferEngine::new(specs.clone(), num_cpu, config()).unwrap();
    let done = run_one(&engine, job(1, Direction::Store, &stores));
    assert_eq!(done.result, Ok(()));
    assert_eq!(done.bytes, (count * engine.cpu_block_bytes()) as u64);
    for buf in &bufs {
        buf.bytes_mut().fill(0);
    }
    let done = run_one(&engine, job(2, Direction::Load, &loads));
    assert_eq!(done.result, Ok(()));
    for (r, (spec, buf)) in specs.iter().zip(&bufs).enumerate() {
        let mut expected = vec![0u8; buf.len()];
        for (&src, &dst) in src_gpu.iter().zip(&dst_gpu) {
            let (s, d) = (
                src as usize * spec.block_stride(),
                dst as usize * spec.block_stride(),
            );
            expected[d..d + spec.block_bytes()]
                .copy_from_slice(&originals[r][s..s + spec.block_bytes()]);
        }
        assert_eq!(buf.bytes(), &expected[..], "region {r}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    #[test]
    fn random_jobs_round_trip_exactly(
        seed: u64,
        shapes in proptest::collection::vec((1usize..=40, 0usize..=2, 1usize..=24), 1..=3),
        gpu_blocks in proptest::collection::vec(1u32..=48, 3),
        num_cpu in 1u32..=64,
        count in 0usize..=64,
    ) {
        // Stride: contiguous, or padded by 1..=24 bytes.
        let shapes: Vec<(usize, usize)> = shapes
            .iter()
            .map(|&(bytes, kind, pad)| (bytes, if kind == 0 { bytes + pad } else { bytes }))
            .collect();
        round_trip(seed, &shapes, &gpu_blocks[..shapes.len()], num_cpu, count);
    }
}

/// Copies at once, but holds every store's completion until released, as a device busy
/// with a long backlog of stores would; notes whether a load finished meanwhile.
struct SlowStores {
    inner: HostCopyBackend,
    released: Arc<AtomicBool>,
    stores: HashSet<u64>,
    load_done_while_stores_held: Arc<AtomicBool>,
}

impl CopyBackend for SlowStores {
    fn name(&self) -> &'static str {
        "slow-stores"
    }

    unsafe fn submit(
        &mut self,
        direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError> {
        // SAFETY: forwarded from our caller.
        let ticket = unsafe { self.inner.submit(direction, runs) }?;
        if direction == Direction::Store {
            self.stores.insert(ticket.0);
        } else if !self.released.load(Ordering::Acquire) {
            self.load_done_while_stores_held
                .store(true, Ordering::Release);
        }
        Ok(ticket)
    }

    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
        Ok(!self.stores.contains(&ticket.0) || self.released.load(Ordering::Acquire))
    }
}

#[test]
fn a_load_behind_a_hundred_slow_stores_completes_first() {
    let buf = FakeGpu::new(16 * 8);
    let released = Arc::new(AtomicBool::new(false));
    let load_first = Arc::new(AtomicBool::new(false));
    let backend = SlowStores {
        inner: HostCopyBackend::new(),
        released: Arc::clone(&released),
        stores: HashSet::new(),
        load_done_while_stores_held: Arc::clone(&load_first),
    };
    let engine =
        TransferEngine::with_backend(vec![buf.region(16, 8, 8)], 16, config(), backend).unwrap();
    for id in 0..100u64 {
        let block = (id % 8) as u32;
        engine
            .submit(job(id, Direction::Store, &[(block, block)]))
            .unwrap();
    }
    engine
        .submit(job(100, Direction::Load, &[(12, 9)]))
        .unwrap();
    let (release_tx, release_rx) = bounded::<()>(1);
    let done = std::thread::scope(|scope| {
        scope.spawn(|| {
            // A backstop for an engine that makes the load wait for the stores.
            let _ = release_rx.recv_timeout(Duration::from_secs(2));
            released.store(true, Ordering::Release);
        });
        let done = engine.wait_for(&[100], WAIT).unwrap();
        let _ = release_tx.send(());
        done
    });
    assert_eq!(done[0].result, Ok(()));
    assert!(
        load_first.load(Ordering::Acquire),
        "the load waited for the stores"
    );
    let stores = engine
        .wait_for(&(0..100).collect::<Vec<_>>(), WAIT)
        .unwrap();
    assert_eq!(stores.len(), 100);
    assert!(stores.iter().all(|c| c.result.is_ok()));
}
