//! The transfer engine when things go wrong: backend failures, panics, a failed attach,
//! wait events, an asynchronous backend, shutdown, a stuck device, and waits that time out.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use offload_core::transfer::{
    BackendError, BlockAccessError, CopyBackend, CopyRun, Direction, HostCopyBackend, JobError,
    ShutdownError, SubmitError, Ticket, TransferConfig, TransferEngine,
};

use common::rng::Rng;
use common::transfer::{config, drain, job, run_one, Clock, FakeGpu, SlowDevice, WAIT};

/// A host backend with scripted faults and an asynchronous completion model.
#[derive(Default)]
struct ScriptedBackend {
    inner: HostCopyBackend,
    submits: usize,
    queries: usize,
    /// (submit index, fatal)
    fail_submit: Option<(usize, bool)>,
    panic_submit: Option<usize>,
    fail_query: Option<usize>,
    /// `query` answers `false` this many times per ticket before `true`.
    polls_needed: u32,
    polls: HashMap<u64, u32>,
    delay: Duration,
    attach_fails: bool,
}

impl CopyBackend for ScriptedBackend {
    fn name(&self) -> &'static str {
        "scripted"
    }

    fn attach(&mut self, _host_base: u64, _host_len: usize) -> Result<(), BackendError> {
        if self.attach_fails {
            return Err(BackendError::fatal("no driver"));
        }
        Ok(())
    }

    unsafe fn submit(
        &mut self,
        direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError> {
        let n = self.submits;
        self.submits += 1;
        std::thread::sleep(self.delay);
        if self.panic_submit == Some(n) {
            panic!("scripted panic in submit {n}");
        }
        if let Some((at, fatal)) = self.fail_submit {
            if at == n {
                let msg = format!("scripted failure of submit {n}");
                return Err(if fatal {
                    BackendError::fatal(msg)
                } else {
                    BackendError::job(msg)
                });
            }
        }
        // SAFETY: forwarded from our caller.
        unsafe { self.inner.submit(direction, runs) }
    }

    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
        let polls = self.polls.entry(ticket.0).or_insert(0);
        if *polls < self.polls_needed {
            *polls += 1;
            return Ok(false);
        }
        let n = self.queries;
        self.queries += 1;
        if self.fail_query == Some(n) {
            return Err(BackendError::job(format!("scripted query failure {n}")));
        }
        Ok(true)
    }
}

fn scripted_engine(buf: &FakeGpu, backend: ScriptedBackend) -> TransferEngine {
    TransferEngine::with_backend(vec![buf.region(16, 8, 8)], 16, config(), backend).unwrap()
}

#[test]
fn a_failed_submit_fails_only_its_job() {
    let buf = FakeGpu::new(16 * 8);
    buf.bytes_mut().fill(3);
    let backend = ScriptedBackend {
        fail_submit: Some((2, false)),
        ..Default::default()
    };
    let mut engine = scripted_engine(&buf, backend);
    for id in 0..6u64 {
        engine
            .submit(job(id, Direction::Store, &[(id as u32, id as u32)]))
            .unwrap();
    }
    let done = drain(&engine, 6);
    for c in &done {
        if c.id == 2 {
            let err = c.result.clone().unwrap_err();
            assert!(
                matches!(err, JobError::Backend { fatal: false, .. }),
                "{err:?}"
            );
            assert!(err.to_string().contains("submit 2"), "{err}");
        } else {
            assert_eq!(c.result, Ok(()), "job {}", c.id);
        }
    }
    assert_eq!(engine.stopped(), None);
    assert!(engine
        .cpu_block_slice(0, 2)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    assert_eq!(engine.cpu_block_slice(0, 3).unwrap(), [3; 8]);
    assert_eq!(
        run_one(&engine, job(10, Direction::Store, &[(2, 2)])).result,
        Ok(())
    );
}

#[test]
fn a_failed_query_fails_only_its_job() {
    let buf = FakeGpu::new(16 * 8);
    let backend = ScriptedBackend {
        fail_query: Some(1),
        polls_needed: 2,
        ..Default::default()
    };
    let engine = scripted_engine(&buf, backend);
    for id in 0..4u64 {
        engine
            .submit(job(id, Direction::Store, &[(id as u32, id as u32)]))
            .unwrap();
    }
    let done = drain(&engine, 4);
    let failed: Vec<u64> = done
        .iter()
        .filter(|c| c.result.is_err())
        .map(|c| c.id)
        .collect();
    assert_eq!(failed, [1]);
    assert_eq!(done.iter().map(|c| c.id).collect::<Vec<_>>(), [0, 1, 2, 3]);
}

#[test]
fn a_fatal_error_is_sticky_and_named() {
    let buf = FakeGpu::new(16 * 8);
    let backend = ScriptedBackend {
        fail_submit: Some((1, true)),
        ..Default::default()
    };
    let engine = scripted_engine(&buf, backend);
    for id in 0..4u64 {
        engine
            .submit(job(id, Direction::Store, &[(id as u32, id as u32)]))
            .unwrap();
    }
    let done = drain(&engine, 4);
    assert_eq!(done[0].result, Ok(()));
    assert!(matches!(
        done[1].result,
        Err(JobError::Backend { fatal: true, .. })
    ));
    for c in &done[2..] {
        let err = c.result.clone().unwrap_err();
        assert!(
            err.to_string().contains("scripted failure of submit 1"),
            "{err}"
        );
    }
    let err = engine
        .submit(job(9, Direction::Load, &[(0, 0)]))
        .unwrap_err();
    assert!(matches!(err, SubmitError::Stopped { id: 9, .. }), "{err:?}");
    assert!(
        err.to_string().contains("scripted failure of submit 1"),
        "{err}"
    );
    assert!(engine.stopped().unwrap().contains("submit 1"));
}

#[test]
fn a_panicking_backend_fails_the_engine_not_the_thread() {
    let buf = FakeGpu::new(16 * 8);
    let backend = ScriptedBackend {
        panic_submit: Some(0),
        ..Default::default()
    };
    let mut engine = scripted_engine(&buf, backend);
    engine.submit(job(0, Direction::Store, &[(0, 0)])).unwrap();
    engine.submit(job(1, Direction::Store, &[(1, 1)])).unwrap();
    let done = drain(&engine, 2);
    assert!(done[0]
        .result
        .clone()
        .unwrap_err()
        .to_string()
        .contains("scripted panic"));
    assert!(matches!(done[1].result, Err(JobError::Stopped { .. })));
    assert_eq!(engine.shutdown(WAIT), Ok(()));
}

#[test]
fn a_failed_attach_is_fatal() {
    let buf = FakeGpu::new(16 * 8);
    let backend = ScriptedBackend {
        attach_fails: true,
        ..Default::default()
    };
    let engine = scripted_engine(&buf, backend);
    let err = engine.wait_ready(WAIT).unwrap_err();
    assert!(err.to_string().contains("no driver"), "{err}");
    assert!(!engine.is_ready());
    // The attach runs on the copy thread; the job queued meanwhile fails either way.
    match engine.submit(job(0, Direction::Store, &[(0, 0)])) {
        Ok(()) => {
            let done = engine.wait_for(&[0], WAIT).unwrap();
            assert!(done[0]
                .result
                .clone()
                .unwrap_err()
                .to_string()
                .contains("no driver"));
        }
        Err(err) => assert!(err.to_string().contains("no driver"), "{err}"),
    }
}

#[test]
fn the_host_backend_is_ready_at_once_and_refuses_wait_events() {
    let buf = FakeGpu::new(16 * 8);
    let engine = TransferEngine::new(vec![buf.region(16, 8, 8)], 16, config()).unwrap();
    engine.wait_ready(WAIT).unwrap();
    assert!(engine.is_ready());
    assert_eq!(engine.backend_detail(), "host");
    let done = run_one(
        &engine,
        job(1, Direction::Store, &[(0, 0)]).with_wait_event(0x1234),
    );
    let err = done.result.unwrap_err();
    assert!(
        matches!(err, JobError::Backend { fatal: false, .. }),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("cannot wait on device event 0x1234"),
        "{err}"
    );
    assert_eq!(
        run_one(&engine, job(2, Direction::Store, &[(0, 0)])).result,
        Ok(())
    );
}

/// Records the order of backend calls.
struct OrderBackend {
    inner: HostCopyBackend,
    calls: Arc<Mutex<Vec<String>>>,
}

impl CopyBackend for OrderBackend {
    fn name(&self) -> &'static str {
        "order"
    }

    fn wait_event(&mut self, event: u64) -> Result<(), BackendError> {
        self.calls.lock().unwrap().push(format!("wait {event}"));
        if event == 666 {
            return Err(BackendError::fatal("device lost"));
        }
        Ok(())
    }

    unsafe fn submit(
        &mut self,
        direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError> {
        self.calls.lock().unwrap().push(format!("{direction}"));
        // SAFETY: forwarded from our caller.
        unsafe { self.inner.submit(direction, runs) }
    }

    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
        self.inner.query(ticket)
    }
}

#[test]
fn a_wait_event_is_passed_before_its_copies_and_its_failure_fails_the_job() {
    let buf = FakeGpu::new(16 * 8);
    let calls = Arc::new(Mutex::new(Vec::new()));
    let backend = OrderBackend {
        inner: HostCopyBackend::new(),
        calls: Arc::clone(&calls),
    };
    let engine =
        TransferEngine::with_backend(vec![buf.region(16, 8, 8)], 16, config(), backend).unwrap();
    let store = job(1, Direction::Store, &[(0, 0)]).with_wait_event(7);
    assert_eq!(store.wait_event, Some(7));
    assert_eq!(run_one(&engine, store).result, Ok(()));
    assert_eq!(
        run_one(&engine, job(2, Direction::Load, &[(0, 0)])).result,
        Ok(())
    );
    // An empty job copies nothing and waits for nothing.
    let empty = job(3, Direction::Store, &[]).with_wait_event(8);
    assert_eq!(run_one(&engine, empty).result, Ok(()));
    assert_eq!(*calls.lock().unwrap(), ["wait 7", "store", "load"]);
    let failed = run_one(
        &engine,
        job(4, Direction::Store, &[(1, 1)]).with_wait_event(666),
    );
    assert!(matches!(
        failed.result,
        Err(JobError::Backend { fatal: true, .. })
    ));
    assert_eq!(calls.lock().unwrap().last().unwrap(), "wait 666");
    assert!(engine.stopped().unwrap().contains("device lost"));
}

#[test]
fn asynchronous_backend_with_bounded_in_flight() {
    let buf = FakeGpu::new(16 * 8);
    let mut rng = Rng::new(99);
    rng.fill(buf.bytes_mut());
    let backend = ScriptedBackend {
        polls_needed: 3,
        ..Default::default()
    };
    let cfg = TransferConfig {
        max_in_flight: 2,
        poll_interval: Duration::from_micros(10),
        ..config()
    };
    let mut engine =
        TransferEngine::with_backend(vec![buf.region(16, 8, 8)], 16, cfg, backend).unwrap();
    for id in 0..16u64 {
        engine
            .submit(job(id, Direction::Store, &[(id as u32, 15 - id as u32)]))
            .unwrap();
    }
    let done = drain(&engine, 16);
    assert_eq!(
        done.iter().map(|c| c.id).collect::<Vec<_>>(),
        (0..16).collect::<Vec<_>>()
    );
    for g in 0..16u32 {
        let start = g as usize * 8;
        let expected = buf.bytes()[start..start + 8].to_vec();
        assert_eq!(engine.cpu_block_slice(0, 15 - g).unwrap(), &expected[..]);
    }
}

#[test]
fn shutdown_skips_queued_jobs_and_returns_promptly() {
    let buf = FakeGpu::new(16 * 8);
    // 200 jobs at 50 ms each would take 10 s; shutdown must not wait for them.
    let backend = ScriptedBackend {
        delay: Duration::from_millis(50),
        ..Default::default()
    };
    let mut engine = scripted_engine(&buf, backend);
    for id in 0..200u64 {
        engine
            .submit(job(
                id,
                Direction::Store,
                &[((id % 16) as u32, (id % 16) as u32)],
            ))
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(engine.shutdown(Duration::from_secs(5)), Ok(()));
    let mut done = Vec::new();
    engine.poll_completions(&mut done);
    assert_eq!(done.len(), 200);
    assert_eq!(
        done.iter().map(|c| c.id).collect::<Vec<_>>(),
        (0..200).collect::<Vec<_>>()
    );
    let skipped = done
        .iter()
        .filter(|c| c.result == Err(JobError::Shutdown { id: c.id }))
        .count();
    assert!(skipped > 100, "only {skipped} skipped");
    assert_eq!(
        engine.submit(job(500, Direction::Store, &[(0, 0)])),
        Err(SubmitError::Shutdown { id: 500 })
    );
    assert_eq!(engine.shutdown(Duration::ZERO), Ok(()));
}

#[test]
fn drop_with_queued_jobs_does_not_hang() {
    let buf = FakeGpu::new(16 * 8);
    let backend = ScriptedBackend {
        delay: Duration::from_millis(50),
        ..Default::default()
    };
    let engine = scripted_engine(&buf, backend);
    for id in 0..200u64 {
        engine.submit(job(id, Direction::Load, &[(0, 0)])).unwrap();
    }
    drop(engine);
}

#[test]
fn shutdown_times_out_on_a_stuck_device_and_keeps_the_memory_until_the_copy_ends() {
    let buf = FakeGpu::new(16 * 8);
    buf.fill_random(4);
    let clock = Clock::default();
    let mut engine = TransferEngine::with_backend(
        vec![buf.region(16, 8, 8)],
        16,
        config(),
        SlowDevice::new(clock.clone(), 1),
    )
    .unwrap();
    engine.submit(job(1, Direction::Store, &[(2, 0)])).unwrap();
    wait_until_on_device(&engine, 1);
    assert!(matches!(
        engine.cpu_block_slice(0, 0),
        Err(BlockAccessError::Busy { unfinished: 1 })
    ));
    let err = engine.shutdown(Duration::from_millis(20)).unwrap_err();
    assert_eq!(
        err,
        ShutdownError {
            timeout_ms: 20,
            unfinished: 1
        }
    );
    assert!(!engine.copy_thread_exited());
    // The detached thread still finishes the copy into the memory it kept, reports it and
    // only then exits.
    clock.advance(1);
    let done = engine.wait_for(&[1], WAIT).unwrap();
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(engine.cpu_block_slice(0, 0).unwrap(), &buf.bytes()[16..24]);
    let deadline = std::time::Instant::now() + WAIT;
    while !engine.copy_thread_exited() {
        assert!(
            std::time::Instant::now() < deadline,
            "copy thread never exited"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until the backend was handed `jobs` jobs.
fn wait_until_on_device(engine: &TransferEngine, jobs: u64) {
    let deadline = std::time::Instant::now() + WAIT;
    while engine.stats().runs_submitted < jobs {
        assert!(
            std::time::Instant::now() < deadline,
            "jobs never reached the device"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs `wait` on this thread while another thread completes the device's running copy:
/// once the engine says it stopped (the wait timed out), or after two seconds if it never
/// does. What `wait` observes right after its wait returned is what the caller would see.
fn wait_while_the_device_finishes_late<T>(
    engine: &TransferEngine,
    clock: &Clock,
    wait: impl FnOnce() -> T,
) -> T {
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while engine.stopped().is_none() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            clock.advance(1);
        });
        wait()
    })
}

#[test]
fn a_timed_out_wait_reports_the_load_only_after_its_copy_ended_and_stops_the_engine() {
    let gpu = FakeGpu::new(8 * 16);
    let clock = Clock::default();
    let cfg = TransferConfig {
        max_in_flight: 1,
        ..config()
    };
    let mut engine = TransferEngine::with_backend(
        vec![gpu.region(8, 16, 16)],
        4,
        cfg,
        SlowDevice::new(clock.clone(), 1),
    )
    .unwrap();
    engine.cpu_block_slice_mut(0, 0).unwrap().fill(0xAB);
    engine.cpu_block_slice_mut(0, 1).unwrap().fill(0xCD);
    // Load 1 is on the device; load 2 and store 3 wait in the queue behind it.
    engine.submit(job(1, Direction::Load, &[(3, 0)])).unwrap();
    engine.submit(job(2, Direction::Load, &[(4, 1)])).unwrap();
    engine.submit(job(3, Direction::Store, &[(5, 2)])).unwrap();

    let (done, at_report) = wait_while_the_device_finishes_late(&engine, &clock, || {
        let done = engine.wait_for(&[1], Duration::from_millis(10)).unwrap();
        // The moment the failure is reported, the late copy has already landed: from here
        // on nothing writes the block, so the caller may hand it to someone else.
        (done, gpu.read(3 * 16, 16))
    });
    assert_eq!(done.len(), 1);
    let err = done[0].result.clone().unwrap_err();
    assert!(matches!(err, JobError::Stopped { .. }), "{err:?}");
    assert!(err.to_string().contains("timed out after 10 ms"), "{err}");
    assert_eq!(at_report, [0xAB; 16]);

    // The queued jobs fail without copying; later submits are refused.
    let rest = engine.wait_for(&[2, 3], WAIT).unwrap();
    assert_eq!(rest.len(), 2);
    assert!(rest
        .iter()
        .all(|c| matches!(c.result, Err(JobError::Stopped { .. }))));
    let err = engine
        .submit(job(4, Direction::Load, &[(6, 0)]))
        .unwrap_err();
    assert!(matches!(err, SubmitError::Stopped { id: 4, .. }), "{err:?}");
    assert_eq!(gpu.read(3 * 16, 16), at_report);
    assert_eq!(gpu.read(4 * 16, 16), [0; 16], "a queued load copied");
    assert_eq!(engine.cpu_block_slice(0, 2).unwrap(), [0; 16]);
    assert_eq!(engine.stats().jobs_succeeded, 0);
}

#[test]
fn a_timed_out_fence_on_a_store_returns_after_the_store_read_its_source() {
    let gpu = FakeGpu::new(8 * 16);
    gpu.fill_random(8);
    let clock = Clock::default();
    let mut engine = TransferEngine::with_backend(
        vec![gpu.region(8, 16, 16)],
        4,
        config(),
        SlowDevice::new(clock.clone(), 1),
    )
    .unwrap();
    let source = gpu.read(2 * 16, 16);
    engine.submit(job(1, Direction::Store, &[(2, 0)])).unwrap();
    let done = wait_while_the_device_finishes_late(&engine, &clock, || {
        let done = engine.wait_for(&[1], Duration::from_millis(5)).unwrap();
        // The server may now overwrite the source block (the next forward pass): the store
        // must have read it already.
        gpu.write(2 * 16, &[0xEE; 16]);
        done
    });
    assert!(matches!(done[0].result, Err(JobError::Stopped { .. })));
    assert_eq!(engine.cpu_block_slice(0, 0).unwrap(), &source[..]);
    assert!(engine.stopped().unwrap().contains("timed out"));
}

#[test]
fn a_wait_that_completes_in_time_does_not_stop_the_engine() {
    let gpu = FakeGpu::new(8 * 16);
    let clock = Clock::default();
    let engine = TransferEngine::with_backend(
        vec![gpu.region(8, 16, 16)],
        4,
        config(),
        SlowDevice::new(clock.clone(), 0),
    )
    .unwrap();
    let done = run_one(&engine, job(1, Direction::Store, &[(2, 0)]));
    assert_eq!(done.result, Ok(()));
    assert_eq!(engine.stopped(), None);
    // A fence on nothing in flight returns at once, even with a zero timeout.
    assert_eq!(engine.wait_for(&[1, 7], Duration::ZERO).unwrap(), vec![]);
    assert_eq!(engine.stopped(), None);
}
