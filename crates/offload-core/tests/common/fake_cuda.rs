//! The fake CUDA driver (`tests/fake_cuda/fake_cuda.c`): built once per process with the
//! system C compiler (`$CC`, default `cc`), one private copy opened per test (`dlopen` of
//! a distinct file gives it its own global state, so tests run in parallel), and the
//! engines the CUDA tests run on it.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use offload_core::transfer::{
    CudaCopyBackend, CudaDriver, CudaError, CudaOptions, Direction, RegionSpec, TransferConfig,
    TransferEngine, TransferJob,
};

use super::transfer::{run_one, FakeGpu, WAIT};

pub const CUDA_ERROR_INVALID_VALUE: i32 = 1;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: i32 = 700;

// ---- the fake library ----------------------------------------------------------------------

/// Compiles `fake_cuda.c` with `defines` once per process and returns the built library.
pub fn built(defines: &[&str]) -> PathBuf {
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
pub struct Fake {
    pub path: PathBuf,
    lib: libloading::Library,
}

impl Fake {
    pub fn new(defines: &[&str]) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let shared = built(defines);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = shared.with_extension(format!("{}-{n}.so", std::process::id()));
        std::fs::copy(&shared, &path).unwrap();
        // SAFETY: the fake's initialisers do nothing.
        let lib = unsafe { libloading::Library::new(&path) }.unwrap();
        Self { path, lib }
    }

    pub fn full() -> Self {
        Self::new(&[])
    }

    pub fn set(&self, name: &str, value: i32) {
        // SAFETY: every `fake_set_*` / `fake_fail_next_query` takes one int.
        let f = unsafe { self.lib.get::<unsafe extern "C" fn(i32)>(name.as_bytes()) }.unwrap();
        // SAFETY: plain C function with no preconditions.
        unsafe { f(value) }
    }

    /// A `long` (or `unsigned long long`) counter.
    pub fn get(&self, name: &str) -> i64 {
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
    pub fn get_int(&self, name: &str) -> i32 {
        // SAFETY: `int` getters.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn() -> i32>(name.as_bytes())
        }
        .unwrap();
        // SAFETY: no preconditions.
        unsafe { f() }
    }

    pub fn fail_copy_at(&self, index: i64, code: i32) {
        // SAFETY: `void fake_fail_copy_at(long, int)`.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn(i64, i32)>(b"fake_fail_copy_at")
        }
        .unwrap();
        // SAFETY: no preconditions.
        unsafe { f(index, code) }
    }

    pub fn log(&self) -> String {
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

    pub fn clear_log(&self) {
        // SAFETY: `void fake_log_clear(void)`.
        let f = unsafe { self.lib.get::<unsafe extern "C" fn()>(b"fake_log_clear") }.unwrap();
        // SAFETY: no preconditions.
        unsafe { f() }
    }

    pub fn user_event(&self) -> u64 {
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

    pub fn user_event_call(&self, name: &[u8], event: u64) {
        // SAFETY: `void fake_user_event_{complete,destroy}(void *)`.
        let f = unsafe { self.lib.get::<unsafe extern "C" fn(*mut c_void)>(name) }.unwrap();
        // SAFETY: `event` came from `fake_user_event_create`.
        unsafe { f(event as *mut c_void) }
    }

    pub fn driver(&self) -> Result<Arc<CudaDriver>, CudaError> {
        CudaDriver::load_from(&self.path).map(Arc::new)
    }

    pub fn backend(&self, options: CudaOptions) -> CudaCopyBackend {
        CudaCopyBackend::new(self.driver().unwrap(), options).unwrap()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

// ---- engines -----------------------------------------------------------

pub fn config() -> TransferConfig {
    TransferConfig {
        poll_interval: Duration::from_micros(20),
        ..super::transfer::config()
    }
}

pub fn engine(
    regions: Vec<RegionSpec>,
    cpu_blocks: u32,
    backend: CudaCopyBackend,
) -> TransferEngine {
    let engine = TransferEngine::with_backend(regions, cpu_blocks, config(), backend).unwrap();
    engine.wait_ready(WAIT).unwrap();
    engine
}

pub fn store(id: u64, pairs: &[(u32, u32)]) -> TransferJob {
    TransferJob::new(id, Direction::Store, pairs.to_vec())
}

pub fn load(id: u64, pairs: &[(u32, u32)]) -> TransferJob {
    TransferJob::new(id, Direction::Load, pairs.to_vec())
}

/// Stores `pairs`, wipes the device, loads the CPU blocks back to `dst` device ids, and
/// checks every byte.
pub fn round_trip(engine: &TransferEngine, gpu: &FakeGpu, block: usize, pairs: &[(u32, u32)]) {
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
pub fn assert_released(fake: &Fake) {
    assert_eq!(fake.get_int("fake_ctx_refs"), 0, "primary context retained");
    assert_eq!(
        fake.get_int("fake_registrations"),
        0,
        "host memory still pinned"
    );
    assert_eq!(fake.get_int("fake_live_events"), 0, "events leaked");
    assert_eq!(fake.get_int("fake_live_streams"), 0, "streams leaked");
}

pub const SCATTERED: &[(u32, u32)] = &[(0, 3), (1, 4), (2, 5), (9, 0), (12, 13), (13, 14), (7, 1)];
