//! The CUDA backend against a fake driver (`common::fake_cuda`), so the loader, the
//! copy-path choice, readiness, coalescing and ordering run on machines without a GPU.
//! Failure paths: `cuda_fake_driver_failures.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::fake_cuda::{
    assert_released, config, engine, round_trip, store, Fake, CUDA_ERROR_INVALID_VALUE, SCATTERED,
};
use common::transfer::{run_one, FakeGpu, WAIT};
use offload_core::transfer::{
    BatchApi, CopyBackend, CudaCopyBackend, CudaDriver, CudaError, CudaOptions, ReadyError,
    TransferEngine, MAX_BATCH_COPIES,
};

// ---- copy-path choice ----------------------------------------------------------------------

fn check_path(fake: &Fake, version: i32, expected: BatchApi, log_token: &str) {
    fake.set("fake_set_version", version);
    let backend = fake.backend(CudaOptions::default());
    assert_eq!(backend.batch_api(), expected);
    let gpu = FakeGpu::new(16 * 256);
    gpu.fill_random(u64::from(version.unsigned_abs()));
    let engine = engine(vec![gpu.region(16, 256, 256)], 16, backend);
    round_trip(&engine, &gpu, 256, SCATTERED);
    let log = fake.log();
    assert!(log.contains(log_token), "{log}");
    if expected == BatchApi::Unavailable {
        assert_eq!(fake.get("fake_batch_calls"), 0, "{log}");
        assert!(fake.get("fake_memcpy_calls") > 0, "{log}");
    } else {
        assert_eq!(fake.get("fake_memcpy_calls"), 0, "{log}");
        assert_eq!(fake.get("fake_batch_calls"), 2, "{log}");
        // Stores must read their source in stream order (after the waited-on event).
        assert_eq!(fake.get_int("fake_last_batch_src_order"), 1);
    }
    assert_eq!(
        fake.get("fake_unpinned_copies"),
        0,
        "a copy touched unpinned memory"
    );
    drop(engine);
    assert_released(fake);
}

#[test]
fn cuda_13_uses_the_v2_batch_symbol() {
    let fake = Fake::full();
    check_path(&fake, 13000, BatchApi::Cuda13, "batch2:");
}

#[test]
fn cuda_12_8_uses_the_original_batch_symbol() {
    let fake = Fake::full();
    check_path(&fake, 12080, BatchApi::Cuda12_8, "batch1:");
}

#[test]
fn cuda_13_without_v2_falls_back_to_the_12_8_signature() {
    let fake = Fake::new(&["-DNO_BATCH_V2"]);
    check_path(&fake, 13010, BatchApi::Cuda12_8, "batch1:");
}

#[test]
fn missing_batch_symbols_fall_back_to_a_memcpy_loop() {
    let fake = Fake::new(&["-DNO_BATCH_V1", "-DNO_BATCH_V2"]);
    check_path(&fake, 13000, BatchApi::Unavailable, "copy");
}

#[test]
fn a_driver_older_than_12_8_uses_the_loop_even_if_the_symbol_exists() {
    let fake = Fake::full();
    check_path(&fake, 12040, BatchApi::Unavailable, "copy");
}

#[test]
fn the_batch_api_can_be_disabled() {
    let fake = Fake::full();
    let backend = fake.backend(CudaOptions {
        allow_batch: false,
        ..CudaOptions::default()
    });
    assert_eq!(backend.batch_api(), BatchApi::Unavailable);
    assert_eq!(backend.driver().batch_api(), BatchApi::Cuda13);
    assert!(
        backend.describe().contains("cuMemcpyAsync loop"),
        "{}",
        backend.describe()
    );
}

#[test]
fn the_stream_is_non_blocking_at_the_lowest_priority_on_the_primary_context() {
    let fake = Fake::full();
    let backend = fake.backend(CudaOptions::default());
    assert_eq!(
        backend.describe(),
        "cuda (driver 13.0, device 0, cuMemcpyBatchAsync_v2)"
    );
    let gpu = FakeGpu::new(4 * 64);
    let engine = engine(vec![gpu.region(4, 64, 64)], 4, backend);
    assert_eq!(engine.backend_name(), "cuda");
    assert!(engine.backend_detail().contains("driver 13.0"));
    assert_eq!(fake.get_int("fake_last_stream_flags"), 1); // CU_STREAM_NON_BLOCKING
    assert_eq!(fake.get_int("fake_last_stream_priority"), 0); // the least priority
    assert_eq!(fake.get_int("fake_ctx_refs"), 1);
    assert_eq!(fake.get_int("fake_registrations"), 1);
    let log = fake.log();
    // A load stream one priority step above the store stream, which has the least.
    assert!(
        log.starts_with("retain stream:-1 stream:0 register"),
        "{log}"
    );
    drop(engine);
    assert_released(&fake);
    assert!(fake.log().contains("unregister release"), "{}", fake.log());
}

#[test]
fn optional_symbols_may_be_missing() {
    let fake = Fake::new(&["-DNO_ERROR_NAME", "-DNO_PRIORITY_RANGE"]);
    let gpu = FakeGpu::new(16 * 64);
    gpu.fill_random(5);
    let engine = engine(
        vec![gpu.region(16, 64, 64)],
        16,
        fake.backend(CudaOptions::default()),
    );
    round_trip(&engine, &gpu, 64, SCATTERED);
    // Without cuGetErrorName the built-in names still name the code.
    fake.fail_copy_at(0, CUDA_ERROR_INVALID_VALUE);
    let err = run_one(&engine, store(1, &[(0, 0)])).result.unwrap_err();
    assert!(
        err.to_string().contains("CUDA_ERROR_INVALID_VALUE (1)"),
        "{err}"
    );
}

// ---- loader errors -------------------------------------------------------------------------

#[test]
fn a_missing_library_is_a_clear_error() {
    let err = CudaDriver::load_from("/nonexistent/dir/libcuda.so.1").unwrap_err();
    assert!(matches!(err, CudaError::LibraryNotFound { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("/nonexistent/dir/libcuda.so.1"), "{text}");
    assert!(text.contains("KVOFFLOAD_LIBCUDA"), "{text}");
}

#[test]
fn a_missing_required_symbol_is_named() {
    let fake = Fake::new(&["-DNO_EVENT_QUERY"]);
    let err = fake.driver().unwrap_err();
    assert_eq!(
        err,
        CudaError::MissingSymbol {
            path: fake.path.to_string_lossy().into_owned(),
            symbols: vec!["cuEventQuery"],
        }
    );
    assert!(
        err.to_string()
            .contains("lacks required symbol(s) cuEventQuery"),
        "{err}"
    );
}

#[test]
fn an_old_driver_is_refused_with_both_versions() {
    let fake = Fake::full();
    fake.set("fake_set_version", 11040);
    let err = fake.driver().unwrap_err();
    assert_eq!(
        err,
        CudaError::DriverTooOld {
            version: 11040,
            minimum: 11080
        }
    );
    assert!(err.to_string().contains("11.4 is too old"), "{err}");
    assert!(err.to_string().contains("11.8 or newer"), "{err}");
}

#[test]
fn a_failing_cu_init_is_named() {
    let fake = Fake::full();
    fake.set("fake_set_init_result", 100);
    let err = fake.driver().unwrap_err();
    assert_eq!(err.code(), Some(100));
    assert!(
        err.to_string()
            .contains("cuInit(0) failed: CUDA_ERROR_NO_DEVICE"),
        "{err}"
    );
}

#[test]
fn a_bad_device_ordinal_fails_at_construction() {
    let fake = Fake::full();
    let err = CudaCopyBackend::new(
        fake.driver().unwrap(),
        CudaOptions {
            device: 3,
            ..CudaOptions::default()
        },
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("cuDeviceGet(ordinal 3) failed: CUDA_ERROR_INVALID_DEVICE"),
        "{err}"
    );
}

#[test]
fn bad_options_are_refused() {
    let fake = Fake::full();
    let err = CudaCopyBackend::new(
        fake.driver().unwrap(),
        CudaOptions {
            pin_chunk_bytes: 1000,
            ..CudaOptions::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("pin_chunk_bytes = 1000"), "{err}");
}

#[test]
fn a_failed_attach_is_fatal_and_never_ready() {
    let fake = Fake::full();
    let backend = fake.backend(CudaOptions::default());
    // The device vanishes between construction and attach.
    fake.set("fake_set_device_count", 0);
    let gpu = FakeGpu::new(4 * 64);
    let engine =
        TransferEngine::with_backend(vec![gpu.region(4, 64, 64)], 4, config(), backend).unwrap();
    let err = engine.wait_ready(WAIT).unwrap_err();
    assert!(matches!(err, ReadyError::Stopped { .. }), "{err:?}");
    assert!(
        err.to_string().contains("cuDevicePrimaryCtxRetain"),
        "{err}"
    );
    assert!(!engine.is_ready());
    let err = engine.submit(store(1, &[(0, 0)])).unwrap_err();
    assert!(
        err.to_string().contains("CUDA_ERROR_INVALID_DEVICE"),
        "{err}"
    );
}

// ---- readiness and pinning -----------------------------------------------------------------

#[test]
fn the_engine_is_not_ready_until_pinned_and_early_jobs_wait() {
    let fake = Fake::full();
    fake.set("fake_set_register_delay_ms", 300);
    let gpu = FakeGpu::new(8 * 128);
    gpu.fill_random(77);
    let engine = TransferEngine::with_backend(
        vec![gpu.region(8, 128, 128)],
        8,
        config(),
        fake.backend(CudaOptions::default()),
    )
    .unwrap();
    assert!(!engine.is_ready());
    assert!(matches!(
        engine.wait_ready(Duration::from_millis(10)),
        Err(ReadyError::NotReady { timeout_ms: 10 })
    ));
    // Queued before the memory is pinned: it runs once it is.
    engine.submit(store(1, &[(2, 3)])).unwrap();
    let done = engine.wait_for(&[1], WAIT).unwrap();
    assert_eq!(done[0].result, Ok(()));
    assert!(engine.is_ready());
    assert_eq!(fake.get("fake_unpinned_copies"), 0);
}

#[test]
fn pinning_is_chunked_and_no_copy_spans_two_chunks() {
    let fake = Fake::full();
    // 40 CPU blocks of 1000 bytes: 40000 bytes pinned in 8192-byte chunks.
    let gpu = FakeGpu::new(40 * 1000);
    gpu.fill_random(3);
    let backend = fake.backend(CudaOptions {
        pin_chunk_bytes: 8192,
        ..CudaOptions::default()
    });
    let engine = engine(vec![gpu.region(40, 1000, 1000)], 40, backend);
    assert_eq!(fake.get_int("fake_registrations"), 5);
    assert_eq!(fake.get("fake_registered_bytes"), 40_000);
    // All 40 blocks in one run: the fake fails any copy that spans two registrations.
    let pairs: Vec<(u32, u32)> = (0..40).map(|i| (i, i)).collect();
    round_trip(&engine, &gpu, 1000, &pairs);
    assert_eq!(fake.get("fake_last_batch_count"), 5);
    drop(engine);
    assert_released(&fake);
}

// ---- coalescing ----------------------------------------------------------------------------

#[test]
fn consecutive_ids_become_one_descriptor_per_region() {
    let fake = Fake::full();
    let (a, b) = (FakeGpu::new(16 * 32), FakeGpu::new(16 * 48));
    a.fill_random(1);
    b.fill_random(2);
    let engine = engine(
        vec![a.region(16, 32, 32), b.region(16, 48, 48)],
        16,
        fake.backend(CudaOptions::default()),
    );
    // Two runs ((0..3 -> 4..7), (9 -> 1)) in two regions: four copies.
    let pairs = [(0, 4), (1, 5), (2, 6), (9, 1)];
    assert_eq!(run_one(&engine, store(1, &pairs)).result, Ok(()));
    assert_eq!(fake.get("fake_last_batch_count"), 4);
    assert_eq!(engine.stats().runs_submitted, 4);
    // Fully scattered: one copy per block and region.
    let pairs = [(0, 9), (5, 3), (2, 11)];
    assert_eq!(run_one(&engine, store(2, &pairs)).result, Ok(()));
    assert_eq!(fake.get("fake_last_batch_count"), 6);
}

#[test]
fn a_large_job_is_enqueued_in_bounded_batch_calls() {
    let fake = Fake::full();
    let block = 16;
    let n = MAX_BATCH_COPIES + 52;
    let gpu = FakeGpu::new(2 * n * block);
    gpu.fill_random(4);
    let engine = engine(
        vec![gpu.region(2 * n as u32, block, block)],
        n as u32,
        fake.backend(CudaOptions::default()),
    );
    // Every other device block: nothing coalesces, one copy per block.
    let pairs: Vec<(u32, u32)> = (0..n as u32).map(|i| (2 * i, i)).collect();
    round_trip(&engine, &gpu, block, &pairs);
    // Each direction: one full call and one for the rest.
    assert_eq!(fake.get("fake_batch_calls"), 4);
    assert_eq!(fake.get("fake_last_batch_count"), 52);
}

#[test]
fn the_loop_issues_one_memcpy_per_coalesced_run() {
    let fake = Fake::full();
    let gpu = FakeGpu::new(16 * 32);
    let engine = engine(
        vec![gpu.region(16, 32, 32)],
        16,
        fake.backend(CudaOptions {
            allow_batch: false,
            ..CudaOptions::default()
        }),
    );
    let pairs = [(0, 4), (1, 5), (2, 6), (9, 1), (10, 2), (14, 15)];
    assert_eq!(run_one(&engine, store(1, &pairs)).result, Ok(()));
    assert_eq!(fake.get("fake_memcpy_calls"), 3);
}

#[test]
fn a_cross_layer_region_with_megabyte_blocks_round_trips() {
    let fake = Fake::full();
    // One region for all layers: 32 layers x 2 (K, V) x 16 tokens x 8 heads x 128 x 2 bytes
    // would be 2 MiB per block; use 1 MiB blocks to keep the test light.
    let block = 1 << 20;
    let gpu = FakeGpu::new(12 * block);
    gpu.fill_random(9);
    let engine = engine(
        vec![gpu.region(12, block, block)],
        8,
        fake.backend(CudaOptions::default()),
    );
    round_trip(
        &engine,
        &gpu,
        block,
        &[(11, 0), (3, 7), (4, 1), (5, 2), (0, 6)],
    );
    assert_eq!(engine.stats().bytes_loaded, 5 * block as u64);
}

// ---- ordering ------------------------------------------------------------------------------

#[test]
fn a_store_waits_for_the_compute_event_before_reading() {
    let fake = Fake::full();
    let block = 64;
    let gpu = FakeGpu::new(8 * block);
    gpu.bytes_mut().fill(0x11);
    let mut engine = engine(
        vec![gpu.region(8, block, block)],
        8,
        fake.backend(CudaOptions::default()),
    );
    let compute_done = fake.user_event();
    fake.clear_log();

    // The forward pass is still writing block 2 when the store is submitted.
    engine
        .submit(store(1, &[(2, 5)]).with_wait_event(compute_done))
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let mut done = Vec::new();
    engine.poll_completions(&mut done);
    assert!(done.is_empty(), "the store completed before its event");
    // The forward pass finishes writing, then its event fires.
    gpu.bytes_mut()[2 * block..3 * block].fill(0x22);
    fake.user_event_call(b"fake_user_event_complete", compute_done);

    let done = engine.wait_for(&[1], WAIT).unwrap();
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(engine.cpu_block_slice(0, 5).unwrap(), &[0x22u8; 64][..]);
    let log = fake.log();
    let wait = log.find("wait").expect("no cuStreamWaitEvent");
    let copy = log.find("batch2:").expect("no copy");
    let record = log.rfind("record").expect("no record");
    assert!(wait < copy && copy < record, "{log}");
    fake.user_event_call(b"fake_user_event_destroy", compute_done);
}

#[test]
fn completion_is_polled_not_assumed() {
    let fake = Fake::full();
    fake.set("fake_set_query_delay", 5);
    let gpu = FakeGpu::new(16 * 64);
    gpu.fill_random(12);
    let engine = engine(
        vec![gpu.region(16, 64, 64)],
        16,
        fake.backend(CudaOptions::default()),
    );
    for id in 0..8u64 {
        engine.submit(store(id, &[(id as u32, id as u32)])).unwrap();
    }
    let done = engine.wait_for(&(0..8).collect::<Vec<_>>(), WAIT).unwrap();
    assert_eq!(done.len(), 8);
    assert!(done.iter().all(|c| c.result.is_ok()));
    assert_eq!(
        done.iter().map(|c| c.id).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
}
