//! The CUDA backend against a fake driver (`tests/fake_cuda/fake_cuda.c`), compiled here
//! with the system C compiler (`$CC`, default `cc`), so the loader, the copy-path choice,
//! coalescing, ordering and error paths run on machines without a GPU.
//!
//! Each test opens its own copy of the fake library: `dlopen` of a distinct file gives it
//! its own global state, so tests can run in parallel.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::transfer::{run_one, FakeGpu, WAIT};
use offload_core::transfer::{
    BatchApi, CopyBackend, CudaCopyBackend, CudaDriver, CudaError, CudaOptions, Direction,
    JobError, ReadyError, RegionSpec, SubmitError, TransferConfig, TransferEngine, TransferJob,
};

const CUDA_ERROR_INVALID_VALUE: i32 = 1;
const CUDA_ERROR_ILLEGAL_ADDRESS: i32 = 700;

// ---- the fake library ----------------------------------------------------------------------

/// Compiles `fake_cuda.c` with `defines` once per process and returns the built library.
fn built(defines: &[&str]) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let key = if defines.is_empty() {
        "full".to_owned()
    } else {
        defines.join("_").replace("-D", "").to_lowercase()
    };
    let mut cache = BUILT
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(path) = cache.get(&key) {
        return path.clone();
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake_cuda");
    std::fs::create_dir_all(&dir).unwrap();
    // Built under a private name, then renamed: concurrent test processes never see a
    // half-written library.
    let pid = std::process::id();
    let tmp = dir.join(format!("libfakecuda-{key}.{pid}.tmp"));
    let out = dir.join(format!("libfakecuda-{key}.so"));
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/fake_cuda.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let status = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror"])
        .args(defines)
        .arg("-o")
        .arg(&tmp)
        .arg(&source)
        .arg("-lpthread")
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "these tests compile a fake CUDA driver with a C compiler, but `{cc}` could \
                 not run ({e}); install gcc/clang or set CC"
            )
        });
    assert!(
        status.success(),
        "{cc} failed to build the fake CUDA driver"
    );
    std::fs::rename(&tmp, &out).unwrap();
    cache.insert(key, out.clone());
    out
}

/// One test's private instance of the fake driver.
struct Fake {
    path: PathBuf,
    lib: libloading::Library,
}

impl Fake {
    fn new(defines: &[&str]) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let shared = built(defines);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = shared.with_extension(format!("{}-{n}.so", std::process::id()));
        std::fs::copy(&shared, &path).unwrap();
        // SAFETY: the fake's initialisers do nothing.
        let lib = unsafe { libloading::Library::new(&path) }.unwrap();
        Self { path, lib }
    }

    fn full() -> Self {
        Self::new(&[])
    }

    fn set(&self, name: &str, value: i32) {
        // SAFETY: every `fake_set_*` / `fake_fail_next_query` takes one int.
        let f = unsafe { self.lib.get::<unsafe extern "C" fn(i32)>(name.as_bytes()) }.unwrap();
        // SAFETY: plain C function with no preconditions.
        unsafe { f(value) }
    }

    /// A `long` (or `unsigned long long`) counter.
    fn get(&self, name: &str) -> i64 {
        // SAFETY: the named getter returns a 64-bit integer and takes nothing.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn() -> i64>(name.as_bytes())
        }
        .unwrap();
        // SAFETY: no preconditions.
        unsafe { f() }
    }

    /// An `int` counter.
    fn get_int(&self, name: &str) -> i32 {
        // SAFETY: `int` getters.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn() -> i32>(name.as_bytes())
        }
        .unwrap();
        // SAFETY: no preconditions.
        unsafe { f() }
    }

    fn fail_copy_at(&self, index: i64, code: i32) {
        // SAFETY: `void fake_fail_copy_at(long, int)`.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn(i64, i32)>(b"fake_fail_copy_at")
        }
        .unwrap();
        // SAFETY: no preconditions.
        unsafe { f(index, code) }
    }

    fn log(&self) -> String {
        // SAFETY: `size_t fake_log(char *, size_t)`.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn(*mut u8, usize) -> usize>(b"fake_log")
        }
        .unwrap();
        let mut buf = vec![0u8; 1 << 16];
        // SAFETY: `buf` has the capacity passed.
        let n = unsafe { f(buf.as_mut_ptr(), buf.len()) };
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    fn clear_log(&self) {
        // SAFETY: `void fake_log_clear(void)`.
        let f = unsafe { self.lib.get::<unsafe extern "C" fn()>(b"fake_log_clear") }.unwrap();
        // SAFETY: no preconditions.
        unsafe { f() }
    }

    fn user_event(&self) -> u64 {
        // SAFETY: `void *fake_user_event_create(void)`.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn() -> *mut c_void>(b"fake_user_event_create")
        }
        .unwrap();
        // SAFETY: no preconditions.
        let e = unsafe { f() };
        assert!(!e.is_null());
        e as u64
    }

    fn user_event_call(&self, name: &[u8], event: u64) {
        // SAFETY: `void fake_user_event_{complete,destroy}(void *)`.
        let f = unsafe { self.lib.get::<unsafe extern "C" fn(*mut c_void)>(name) }.unwrap();
        // SAFETY: `event` came from `fake_user_event_create`.
        unsafe { f(event as *mut c_void) }
    }

    fn driver(&self) -> Result<Arc<CudaDriver>, CudaError> {
        CudaDriver::load_from(&self.path).map(Arc::new)
    }

    fn backend(&self, options: CudaOptions) -> CudaCopyBackend {
        CudaCopyBackend::new(self.driver().unwrap(), options).unwrap()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

// ---- engines -----------------------------------------------------------

fn config() -> TransferConfig {
    TransferConfig {
        poll_interval: Duration::from_micros(20),
        ..common::transfer::config()
    }
}

fn engine(regions: Vec<RegionSpec>, cpu_blocks: u32, backend: CudaCopyBackend) -> TransferEngine {
    let engine = TransferEngine::with_backend(regions, cpu_blocks, config(), backend).unwrap();
    engine.wait_ready(WAIT).unwrap();
    engine
}

fn store(id: u64, pairs: &[(u32, u32)]) -> TransferJob {
    TransferJob::new(id, Direction::Store, pairs.to_vec())
}

fn load(id: u64, pairs: &[(u32, u32)]) -> TransferJob {
    TransferJob::new(id, Direction::Load, pairs.to_vec())
}

/// Stores `pairs`, wipes the device, loads the CPU blocks back to `dst` device ids, and
/// checks every byte.
fn round_trip(engine: &TransferEngine, gpu: &FakeGpu, block: usize, pairs: &[(u32, u32)]) {
    let original = gpu.bytes().to_vec();
    assert_eq!(run_one(engine, store(1_000, pairs)).result, Ok(()));
    gpu.bytes_mut().fill(0);
    assert_eq!(run_one(engine, load(1_001, pairs)).result, Ok(()));
    for &(g, _) in pairs {
        let at = g as usize * block;
        assert_eq!(gpu.read(at, block), &original[at..at + block], "block {g}");
    }
}

/// Everything the backend acquired was released.
fn assert_released(fake: &Fake) {
    assert_eq!(fake.get_int("fake_ctx_refs"), 0, "primary context retained");
    assert_eq!(
        fake.get_int("fake_registrations"),
        0,
        "host memory still pinned"
    );
    assert_eq!(fake.get_int("fake_live_events"), 0, "events leaked");
    assert_eq!(fake.get_int("fake_live_streams"), 0, "streams leaked");
}

const SCATTERED: &[(u32, u32)] = &[(0, 3), (1, 4), (2, 5), (9, 0), (12, 13), (13, 14), (7, 1)];

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
