//! The CUDA backend's failure paths against the fake driver (`common::fake_cuda`): a failed
//! copy fails only its job and is never left hanging, asynchronous and sticky errors, bad
//! wait events, and a load that does not queue behind a store on the device.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::fake_cuda::{
    assert_released, engine, load, round_trip, store, Fake, CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_INVALID_VALUE, SCATTERED,
};
use common::transfer::{run_one, FakeGpu, WAIT};
use offload_core::transfer::{CudaOptions, JobError, SubmitError};

// ---- failures ------------------------------------------------------------------------------

fn failed_copy_fails_only_its_job(options: CudaOptions, fail_at: i64) {
    let fake = Fake::full();
    let gpu = FakeGpu::new(16 * 64);
    gpu.fill_random(21);
    let engine = engine(vec![gpu.region(16, 64, 64)], 16, fake.backend(options));
    // Job 1 copies three runs; its copy call number `fail_at` fails.
    fake.fail_copy_at(fail_at, CUDA_ERROR_INVALID_VALUE);
    let started = Instant::now();
    let done = run_one(&engine, store(1, &[(0, 0), (3, 1), (6, 2)]));
    assert!(started.elapsed() < WAIT);
    let err = done.result.unwrap_err();
    assert!(
        matches!(err, JobError::Backend { fatal: false, .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("CUDA_ERROR_INVALID_VALUE"),
        "{err}"
    );
    assert_eq!(done.bytes, 0);
    assert_eq!(engine.stopped(), None);
    // Later jobs are unaffected.
    round_trip(&engine, &gpu, 64, SCATTERED);
    assert_eq!(engine.stats().jobs_failed, 1);
    drop(engine);
    assert_released(&fake);
}

#[test]
fn a_failed_batch_copy_is_reported_and_later_jobs_succeed() {
    failed_copy_fails_only_its_job(CudaOptions::default(), 0);
}

#[test]
fn a_failed_loop_copy_midway_is_reported_not_hung() {
    // The second of three cuMemcpyAsync calls fails after the first was enqueued.
    failed_copy_fails_only_its_job(
        CudaOptions {
            allow_batch: false,
            ..CudaOptions::default()
        },
        1,
    );
}

#[test]
fn an_asynchronous_error_fails_its_job() {
    let fake = Fake::full();
    let gpu = FakeGpu::new(4 * 64);
    let engine = engine(
        vec![gpu.region(4, 64, 64)],
        4,
        fake.backend(CudaOptions::default()),
    );
    fake.set("fake_fail_next_query", CUDA_ERROR_INVALID_VALUE);
    let err = run_one(&engine, load(1, &[(0, 0)])).result.unwrap_err();
    assert!(err.to_string().contains("cuEventQuery failed"), "{err}");
    assert_eq!(engine.stopped(), None);
    assert_eq!(run_one(&engine, load(2, &[(1, 1)])).result, Ok(()));
}

#[test]
fn a_sticky_error_is_fatal_and_named_in_every_later_call() {
    let fake = Fake::full();
    let gpu = FakeGpu::new(4 * 64);
    let engine = engine(
        vec![gpu.region(4, 64, 64)],
        4,
        fake.backend(CudaOptions::default()),
    );
    assert_eq!(run_one(&engine, store(1, &[(0, 0)])).result, Ok(()));
    // The device faults while copying job 2.
    fake.set("fake_fail_next_query", CUDA_ERROR_ILLEGAL_ADDRESS);
    let err = run_one(&engine, store(2, &[(1, 1)])).result.unwrap_err();
    assert!(
        matches!(err, JobError::Backend { fatal: true, .. }),
        "{err:?}"
    );
    let later = engine.submit(store(3, &[(2, 2)])).unwrap_err();
    assert!(matches!(later, SubmitError::Stopped { .. }), "{later:?}");
    assert!(
        later.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{later}"
    );
    assert!(engine
        .stopped()
        .unwrap()
        .contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
    // Shutting down a poisoned context must not hang or panic.
    let started = Instant::now();
    drop(engine);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_sticky_error_at_submission_is_fatal() {
    let fake = Fake::full();
    let gpu = FakeGpu::new(4 * 64);
    let engine = engine(
        vec![gpu.region(4, 64, 64)],
        4,
        fake.backend(CudaOptions::default()),
    );
    fake.fail_copy_at(0, CUDA_ERROR_ILLEGAL_ADDRESS);
    let err = run_one(&engine, store(1, &[(0, 0)])).result.unwrap_err();
    assert!(
        matches!(err, JobError::Backend { fatal: true, .. }),
        "{err:?}"
    );
    let later = engine.submit(load(2, &[(0, 0)])).unwrap_err();
    assert!(
        later.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{later}"
    );
}

#[test]
fn an_invalid_wait_event_fails_only_its_job() {
    let fake = Fake::full();
    let gpu = FakeGpu::new(4 * 64);
    let engine = engine(
        vec![gpu.region(4, 64, 64)],
        4,
        fake.backend(CudaOptions::default()),
    );
    let bogus = Box::into_raw(Box::new(0u64)) as u64;
    let err = run_one(&engine, store(1, &[(0, 0)]).with_wait_event(bogus))
        .result
        .unwrap_err();
    // SAFETY: from `Box::into_raw` above.
    drop(unsafe { Box::from_raw(bogus as *mut u64) });
    assert!(err.to_string().contains("cuStreamWaitEvent"), "{err}");
    assert!(
        err.to_string().contains("CUDA_ERROR_INVALID_HANDLE"),
        "{err}"
    );
    assert_eq!(run_one(&engine, store(2, &[(0, 0)])).result, Ok(()));
}

#[test]
fn a_failed_event_record_after_the_copies_were_enqueued_is_reported_after_they_ran() {
    let fake = Fake::full();
    let block = 64;
    let gpu = FakeGpu::new(8 * block);
    gpu.bytes_mut().fill(0x5A);
    let mut engine = engine(
        vec![gpu.region(8, block, block)],
        8,
        fake.backend(CudaOptions::default()),
    );
    // The store's copy is enqueued behind the compute event, so it cannot run yet, and then
    // recording the job's own event fails.
    let compute_done = fake.user_event();
    fake.set("fake_fail_next_record", CUDA_ERROR_INVALID_VALUE);
    engine
        .submit(store(1, &[(2, 5)]).with_wait_event(compute_done))
        .unwrap();
    let (done, at_report) = std::thread::scope(|scope| {
        scope.spawn(|| {
            // The compute stream finishes once the backend is draining its stream (or after
            // a while, for a backend that reports without draining).
            let deadline = Instant::now() + Duration::from_secs(2);
            while !fake.log().contains("sync") && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            fake.user_event_call(b"fake_user_event_complete", compute_done);
        });
        let done = engine.wait_for(&[1], WAIT).unwrap();
        // At the report, the copy that was enqueued has already written its destination.
        (done, engine.cpu_block_slice(0, 5).unwrap().to_vec())
    });
    let err = done[0].result.clone().unwrap_err();
    assert!(err.to_string().contains("cuEventRecord"), "{err}");
    assert_eq!(at_report, [0x5A; 64]);
    assert_eq!(engine.stopped(), None);
    fake.user_event_call(b"fake_user_event_destroy", compute_done);
}

#[test]
fn a_load_is_not_queued_behind_a_store_on_the_device() {
    let fake = Fake::full();
    let block = 64;
    let gpu = FakeGpu::new(8 * block);
    gpu.fill_random(6);
    let engine = engine(
        vec![gpu.region(8, block, block)],
        8,
        fake.backend(CudaOptions::default()),
    );
    // The store waits for a forward pass that is still running.
    let compute_done = fake.user_event();
    engine
        .submit(store(1, &[(2, 5)]).with_wait_event(compute_done))
        .unwrap();
    engine.submit(load(2, &[(6, 0)])).unwrap();
    let (finished_tx, finished_rx) = crossbeam_channel::bounded::<()>(1);
    let done = std::thread::scope(|scope| {
        scope.spawn(|| {
            // A backstop for a backend that puts the load behind the store.
            let _ = finished_rx.recv_timeout(Duration::from_secs(2));
            fake.user_event_call(b"fake_user_event_complete", compute_done);
        });
        let done = engine.wait_for(&[2], Duration::from_secs(1)).unwrap();
        let _ = finished_tx.send(());
        done
    });
    assert_eq!(done[0].result, Ok(()), "the load waited behind the store");
    assert_eq!(engine.wait_for(&[1], WAIT).unwrap()[0].result, Ok(()));
    fake.user_event_call(b"fake_user_event_destroy", compute_done);
}
