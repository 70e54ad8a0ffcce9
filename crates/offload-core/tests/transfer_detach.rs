//! Detaching the device regions (a server releasing its KV memory, e.g. vLLM's sleep
//! mode) and attaching them again: no copy is ever submitted against detached memory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use offload_core::transfer::{
    AttachError, DetachError, Direction, JobError, SubmitError, TransferConfig, TransferEngine,
};

use common::transfer::{config, drain, job, run_one, Clock, FakeGpu, SlowDevice, WAIT};

/// Blocks of 8 bytes, 8 of them.
const BLOCK: usize = 8;

fn slow_engine(
    gpu: &FakeGpu,
    clock: &Clock,
) -> (TransferEngine, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    let device = SlowDevice::new(clock.clone(), 1);
    let accepted = device.accepted();
    let cfg = TransferConfig {
        max_in_flight: 1,
        ..config()
    };
    let engine =
        TransferEngine::with_backend(vec![gpu.region(8, BLOCK, BLOCK)], 4, cfg, device).unwrap();
    (engine, accepted)
}

#[test]
fn a_detach_waits_for_running_copies_fails_queued_ones_and_refuses_new_ones() {
    let gpu = FakeGpu::new(8 * BLOCK);
    gpu.fill_random(7);
    let before = gpu.bytes().to_vec();
    let clock = Clock::default();
    let (engine, accepted) = slow_engine(&gpu, &clock);
    // Store 1 runs on the device; store 2 waits in its lane (one job in flight per lane).
    engine.submit(job(1, Direction::Store, &[(2, 0)])).unwrap();
    engine.submit(job(2, Direction::Store, &[(3, 1)])).unwrap();
    let deadline = Instant::now() + WAIT;
    while accepted.load(Ordering::Acquire) < 1 {
        assert!(
            Instant::now() < deadline,
            "store 1 never reached the device"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let finished = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            finished.store(true, Ordering::Release);
            clock.advance(1);
        });
        engine.detach_regions(WAIT).unwrap();
        // Not before the running copy ended.
        assert!(finished.load(Ordering::Acquire));
    });
    assert!(!engine.is_attached());
    let mut done = drain(&engine, 2);
    done.sort_by_key(|c| c.id);
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(done[1].result, Err(JobError::Detached { id: 2 }));
    // Only the store that ran reached the device (the queued one never did).
    assert_eq!(accepted.load(Ordering::Acquire), 1);
    assert_eq!(
        engine.submit(job(3, Direction::Load, &[(5, 0)])),
        Err(SubmitError::Detached { id: 3 })
    );
    clock.advance(10);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(gpu.bytes(), &before[..], "a detached region was written");
    // Idempotent.
    engine.detach_regions(WAIT).unwrap();
}

#[test]
fn attach_resumes_copies_into_the_new_regions_of_the_same_shape() {
    let old = FakeGpu::new(8 * BLOCK);
    old.fill_random(1);
    let engine = TransferEngine::new(vec![old.region(8, BLOCK, BLOCK)], 4, config()).unwrap();
    assert_eq!(
        run_one(&engine, job(1, Direction::Store, &[(4, 0)])).result,
        Ok(())
    );
    let stored = old.read(4 * BLOCK, BLOCK);
    let old_target = old.read(6 * BLOCK, BLOCK);
    engine.detach_regions(WAIT).unwrap();

    let new = FakeGpu::new(16 * BLOCK);
    let wrong = [
        (vec![new.region(7, BLOCK, BLOCK)], "num_blocks"),
        (vec![new.region(8, 2 * BLOCK, 2 * BLOCK)], "block_bytes"),
        (vec![new.region(8, BLOCK, 2 * BLOCK)], "block_stride"),
        (vec![new.region(8, BLOCK, BLOCK); 2], "regions"),
    ];
    for (regions, what) in wrong {
        // SAFETY: refused before any copy could use them.
        let err = unsafe { engine.attach_regions(regions) }.unwrap_err();
        assert!(
            matches!(err, AttachError::Mismatch { field, .. } if field == what),
            "{err}"
        );
        assert!(!engine.is_attached());
    }
    // SAFETY: `new` outlives the engine and is untouched while jobs are in flight.
    unsafe { engine.attach_regions(vec![new.region(8, BLOCK, BLOCK)]) }.unwrap();
    assert!(engine.is_attached());
    assert_eq!(
        run_one(&engine, job(2, Direction::Load, &[(6, 0)])).result,
        Ok(())
    );
    assert_eq!(new.read(6 * BLOCK, BLOCK), stored);
    assert_eq!(
        old.read(6 * BLOCK, BLOCK),
        old_target,
        "the old region was written"
    );
}

#[test]
fn a_detach_that_times_out_stops_the_engine() {
    let gpu = FakeGpu::new(8 * BLOCK);
    let clock = Clock::default();
    let (engine, accepted) = slow_engine(&gpu, &clock);
    engine.submit(job(1, Direction::Load, &[(2, 0)])).unwrap();
    let deadline = Instant::now() + WAIT;
    while accepted.load(Ordering::Acquire) < 1 {
        assert!(
            Instant::now() < deadline,
            "the load never reached the device"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let err = engine
        .detach_regions(Duration::from_millis(20))
        .unwrap_err();
    assert!(
        matches!(
            err,
            DetachError::Timeout {
                unfinished: 1,
                timeout_ms: 20
            }
        ),
        "{err}"
    );
    let reason = engine.stopped().expect("stopped").to_owned();
    assert!(reason.contains("unregistered"), "{reason}");
    // SAFETY: refused: the engine stopped.
    let err = unsafe { engine.attach_regions(vec![gpu.region(8, BLOCK, BLOCK)]) }.unwrap_err();
    assert!(matches!(err, AttachError::Stopped { .. }), "{err}");
    // The late copy is reported failed once it ended.
    clock.advance(1);
    let done = engine.wait_for(&[1], WAIT).unwrap();
    assert!(matches!(done[0].result, Err(JobError::Stopped { .. })));
}
