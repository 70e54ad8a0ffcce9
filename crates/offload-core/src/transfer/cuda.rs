//! CUDA backend: copies between device regions and pinned host memory with the CUDA
//! driver API, loaded at run time.
//!
//! Nothing links against CUDA. [`CudaDriver::load`] opens `libcuda.so.1` (or the file named
//! by `KVOFFLOAD_LIBCUDA`) with `dlopen`, resolves every driver function as optional, and
//! refuses with a typed [`CudaError`] when a required one is missing, the library is absent,
//! or the driver is older than [`MIN_DRIVER_VERSION`]. The driver version also picks the copy
//! path ([`BatchApi`]): one `cuMemcpyBatchAsync` per job when the driver has it (CUDA 12.8
//! and 13.x export it with different signatures), else a loop of `cuMemcpyAsync`.
//!
//! [`CudaCopyBackend`] runs on the engine's copy thread. Its `attach` retains the device's
//! primary context (the one PyTorch uses), makes it current on the copy thread, creates a
//! non-blocking stream at the lowest priority (so copies yield to compute), and pins the
//! engine's host memory with `cuMemHostRegister` in chunks of at most
//! [`CudaOptions::pin_chunk_bytes`]. Each job: an optional `cuStreamWaitEvent` on the
//! caller's event (stores wait for the compute stream), the copies, and an event record;
//! completion is polled with `cuEventQuery`. Errors that poison the context (illegal address
//! and the like) are fatal to the engine; others fail only their job. On drop the backend
//! drains its stream, destroys its events and stream, unpins the memory and releases the
//! context.

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr, OsStr, OsString};
use std::sync::Arc;
use std::time::Instant;

use libloading::Library;

use super::cuda_sys::{self as sys, CUresult};
use super::{BackendError, CopyBackend, CopyRun, Direction, Ticket};

/// The library opened by [`CudaDriver::load`] unless [`LIBRARY_ENV`] names another.
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

/// Environment variable naming the driver library to open instead of [`DEFAULT_LIBRARY`].
pub const LIBRARY_ENV: &str = "KVOFFLOAD_LIBCUDA";

/// The oldest driver accepted (CUDA 11.8, as `cuDriverGetVersion` reports it): every function
/// the backend requires exists there with the signature used here.
pub const MIN_DRIVER_VERSION: i32 = 11080;

/// First driver with `cuMemcpyBatchAsync` (CUDA 12.8, 9 parameters, exported unversioned).
pub const BATCH_V1_MIN_VERSION: i32 = 12080;

/// First driver with the CUDA 13 `cuMemcpyBatchAsync` (8 parameters, no `failIdx`),
/// exported as `cuMemcpyBatchAsync_v2`.
pub const BATCH_V2_MIN_VERSION: i32 = 13000;

/// Default upper bound on one `cuMemHostRegister` call.
pub const DEFAULT_PIN_CHUNK_BYTES: usize = 64 << 30;

/// Alignment required of [`CudaOptions::pin_chunk_bytes`] (a page; registrations start on
/// page boundaries).
pub const PIN_CHUNK_ALIGN: usize = 4096;

/// Errors of the CUDA driver and backend. Each message names the library, symbol, version
/// or call at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// `dlopen` failed: no NVIDIA driver installed, or the path is wrong.
    #[error(
        "cannot load the CUDA driver library {path}: {reason} (is the NVIDIA driver \
         installed? set {LIBRARY_ENV} to its path if it is not on the loader path)"
    )]
    LibraryNotFound {
        /// The path or name given to `dlopen`.
        path: String,
        /// The loader's message.
        reason: String,
    },
    /// The library lacks functions the backend cannot work without.
    #[error("the CUDA driver library {path} lacks required symbol(s) {}", .symbols.join(", "))]
    MissingSymbol {
        /// The library.
        path: String,
        /// Every missing required symbol.
        symbols: Vec<&'static str>,
    },
    /// The driver is older than [`MIN_DRIVER_VERSION`].
    #[error(
        "CUDA driver version {} is too old: kvoffload needs {} or newer; upgrade the NVIDIA \
         driver",
        version_text(*.version),
        version_text(*.minimum)
    )]
    DriverTooOld {
        /// What `cuDriverGetVersion` reported (e.g. 12040 for 12.4).
        version: i32,
        /// The minimum.
        minimum: i32,
    },
    /// A driver call returned an error.
    #[error("{call} failed: {name} ({code}): {description}")]
    Call {
        /// The call, with its arguments where they help.
        call: String,
        /// The `CUresult`.
        code: i32,
        /// Its name from `cuGetErrorName` (e.g. `CUDA_ERROR_ILLEGAL_ADDRESS`).
        name: String,
        /// Its description from `cuGetErrorString`.
        description: String,
    },
    /// A [`CudaOptions`] value is invalid.
    #[error("invalid CUDA option {field} = {value}: {reason}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// Its value.
        value: String,
        /// Why it is refused.
        reason: &'static str,
    },
}

impl CudaError {
    /// The `CUresult` of a failed call, if this is one.
    pub fn code(&self) -> Option<i32> {
        match self {
            Self::Call { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the error leaves the CUDA context unusable (a "sticky" error such as
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`): the engine must stop using the device.
    pub fn is_sticky(&self) -> bool {
        self.code().is_some_and(sys::is_sticky)
    }
}

impl From<CudaError> for BackendError {
    fn from(err: CudaError) -> Self {
        if err.is_sticky() {
            BackendError::fatal(err.to_string())
        } else {
            BackendError::job(err.to_string())
        }
    }
}

/// `12080` -> `"12.8"`, as NVIDIA writes driver API versions.
fn version_text(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// Which `cuMemcpyBatchAsync` the driver offers, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchApi {
    /// No batch API (driver older than 12.8, symbol missing, or disabled): one
    /// `cuMemcpyAsync` per copy.
    Unavailable,
    /// CUDA 12.8's `cuMemcpyBatchAsync` (with `failIdx`).
    Cuda12_8,
    /// CUDA 13's `cuMemcpyBatchAsync_v2` (without `failIdx`).
    Cuda13,
}

impl BatchApi {
    /// The exported symbol used, or the fallback's.
    pub fn symbol(self) -> &'static str {
        match self {
            Self::Unavailable => "cuMemcpyAsync loop",
            Self::Cuda12_8 => "cuMemcpyBatchAsync",
            Self::Cuda13 => "cuMemcpyBatchAsync_v2",
        }
    }
}

/// Every driver function the backend uses; optional ones stay `Option`.
#[derive(Clone, Copy)]
struct Api {
    init: sys::cuInit_t,
    device_get: sys::cuDeviceGet_t,
    primary_ctx_retain: sys::cuDevicePrimaryCtxRetain_t,
    primary_ctx_release: sys::cuDevicePrimaryCtxRelease_t,
    ctx_set_current: sys::cuCtxSetCurrent_t,
    stream_create_with_priority: sys::cuStreamCreateWithPriority_t,
    stream_destroy: sys::cuStreamDestroy_t,
    stream_synchronize: sys::cuStreamSynchronize_t,
    stream_wait_event: sys::cuStreamWaitEvent_t,
    event_create: sys::cuEventCreate_t,
    event_record: sys::cuEventRecord_t,
    event_query: sys::cuEventQuery_t,
    event_destroy: sys::cuEventDestroy_t,
    memcpy_async: sys::cuMemcpyAsync_t,
    mem_host_register: sys::cuMemHostRegister_t,
    mem_host_unregister: sys::cuMemHostUnregister_t,
    ctx_get_stream_priority_range: Option<sys::cuCtxGetStreamPriorityRange_t>,
    get_error_name: Option<sys::cuGetErrorName_t>,
    get_error_string: Option<sys::cuGetErrorString_t>,
    memcpy_batch_v1: Option<sys::cuMemcpyBatchAsync_v1_t>,
    memcpy_batch_v2: Option<sys::cuMemcpyBatchAsync_v2_t>,
}

/// Resolves `name` from `lib` as a `T`, or `None` when the library does not export it.
///
/// # Safety
///
/// `T` must be the function-pointer type of the exported symbol `name`.
unsafe fn symbol<T: Copy>(lib: &Library, name: &str) -> Option<T> {
    // SAFETY: the caller guarantees `T` matches the symbol's real type.
    unsafe { lib.get::<T>(name.as_bytes()) }.ok().map(|s| *s)
}

/// A loaded CUDA driver library with its functions resolved and its version checked.
///
/// Cheap to share (`Arc`): every [`CudaCopyBackend`] holds one, and the library stays
/// loaded while any does.
pub struct CudaDriver {
    path: String,
    version: i32,
    batch: BatchApi,
    api: Api,
    /// Keeps the function pointers in `api` valid. Dropped last.
    _library: Library,
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDriver")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl CudaDriver {
    /// Loads the driver named by [`LIBRARY_ENV`], or [`DEFAULT_LIBRARY`].
    pub fn load() -> Result<Self, CudaError> {
        Self::load_from(library_path(std::env::var_os(LIBRARY_ENV)))
    }

    /// Loads the driver library at `path` (a path, or a name the loader searches for),
    /// resolves its functions, checks its version and calls `cuInit(0)`.
    pub fn load_from(path: impl AsRef<OsStr>) -> Result<Self, CudaError> {
        let path_ref = path.as_ref();
        let shown = path_ref.to_string_lossy().into_owned();
        // SAFETY: loading a shared library runs its initialisers; libcuda's (and a test
        // fake's) have no preconditions on the caller.
        let library =
            unsafe { Library::new(path_ref) }.map_err(|e| CudaError::LibraryNotFound {
                path: shown.clone(),
                reason: e.to_string(),
            })?;
        let missing = |symbols: Vec<&'static str>| CudaError::MissingSymbol {
            path: shown.clone(),
            symbols,
        };

        // The version first: an old driver lacking newer symbols should say "too old".
        // SAFETY: the type is `cuDriverGetVersion`'s signature from cuda.h.
        let get_version: sys::cuDriverGetVersion_t =
            unsafe { symbol(&library, "cuDriverGetVersion") }
                .ok_or_else(|| missing(vec!["cuDriverGetVersion"]))?;
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid out-pointer for the duration of the call.
        let rc = unsafe { get_version(&mut version) };

        let mut absent = Vec::new();
        macro_rules! required {
            ($name:literal) => {{
                // SAFETY: each call site's inferred type is that symbol's cuda.h signature
                // (see `cuda_sys`).
                let f = unsafe { symbol(&library, $name) };
                if f.is_none() {
                    absent.push($name);
                }
                f
            }};
        }
        macro_rules! optional {
            ($name:literal) => {{
                // SAFETY: as in `required!`.
                unsafe { symbol(&library, $name) }
            }};
        }
        let init = required!("cuInit");
        let device_get = required!("cuDeviceGet");
        let primary_ctx_retain = required!("cuDevicePrimaryCtxRetain");
        let primary_ctx_release = required!("cuDevicePrimaryCtxRelease_v2");
        let ctx_set_current = required!("cuCtxSetCurrent");
        let stream_create_with_priority = required!("cuStreamCreateWithPriority");
        let stream_destroy = required!("cuStreamDestroy_v2");
        let stream_synchronize = required!("cuStreamSynchronize");
        let stream_wait_event = required!("cuStreamWaitEvent");
        let event_create = required!("cuEventCreate");
        let event_record = required!("cuEventRecord");
        let event_query = required!("cuEventQuery");
        let event_destroy = required!("cuEventDestroy_v2");
        let memcpy_async = required!("cuMemcpyAsync");
        let mem_host_register = required!("cuMemHostRegister_v2");
        let mem_host_unregister = required!("cuMemHostUnregister");
        let get_error_name: Option<sys::cuGetErrorName_t> = optional!("cuGetErrorName");
        let get_error_string: Option<sys::cuGetErrorString_t> = optional!("cuGetErrorString");

        let describe = |call: &str, code: CUresult| {
            describe_error(get_error_name, get_error_string, call.to_owned(), code)
        };
        if rc != sys::CUDA_SUCCESS {
            return Err(describe("cuDriverGetVersion", rc));
        }
        if version < MIN_DRIVER_VERSION {
            return Err(CudaError::DriverTooOld {
                version,
                minimum: MIN_DRIVER_VERSION,
            });
        }
        let (
            Some(init),
            Some(device_get),
            Some(primary_ctx_retain),
            Some(primary_ctx_release),
            Some(ctx_set_current),
            Some(stream_create_with_priority),
            Some(stream_destroy),
            Some(stream_synchronize),
            Some(stream_wait_event),
            Some(event_create),
            Some(event_record),
            Some(event_query),
            Some(event_destroy),
            Some(memcpy_async),
            Some(mem_host_register),
            Some(mem_host_unregister),
        ) = (
            init,
            device_get,
            primary_ctx_retain,
            primary_ctx_release,
            ctx_set_current,
            stream_create_with_priority,
            stream_destroy,
            stream_synchronize,
            stream_wait_event,
            event_create,
            event_record,
            event_query,
            event_destroy,
            memcpy_async,
            mem_host_register,
            mem_host_unregister,
        )
        else {
            return Err(missing(absent));
        };
        let api = Api {
            init,
            device_get,
            primary_ctx_retain,
            primary_ctx_release,
            ctx_set_current,
            stream_create_with_priority,
            stream_destroy,
            stream_synchronize,
            stream_wait_event,
            event_create,
            event_record,
            event_query,
            event_destroy,
            memcpy_async,
            mem_host_register,
            mem_host_unregister,
            ctx_get_stream_priority_range: optional!("cuCtxGetStreamPriorityRange"),
            get_error_name,
            get_error_string,
            memcpy_batch_v1: optional!("cuMemcpyBatchAsync"),
            memcpy_batch_v2: optional!("cuMemcpyBatchAsync_v2"),
        };
        let batch = choose_batch_api(
            version,
            api.memcpy_batch_v1.is_some(),
            api.memcpy_batch_v2.is_some(),
        );
        let driver = Self {
            path: shown,
            version,
            batch,
            api,
            _library: library,
        };
        // SAFETY: `cuInit` takes flags by value; 0 is the only valid value.
        driver.check("cuInit(0)", unsafe { (driver.api.init)(0) })?;
        log::debug!(
            "loaded CUDA driver {} (version {}), copy path {}",
            driver.path,
            version_text(version),
            batch.symbol()
        );
        Ok(driver)
    }

    /// The library path or name it was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The driver API version (`cuDriverGetVersion`, e.g. 12080 for 12.8).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// The batch copy API this driver offers.
    pub fn batch_api(&self) -> BatchApi {
        self.batch
    }

    /// `Ok` for `CUDA_SUCCESS`, else the typed error naming `call` and the code.
    fn check(&self, call: &str, code: CUresult) -> Result<(), CudaError> {
        if code == sys::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call.to_owned(), code))
        }
    }

    fn error(&self, call: String, code: CUresult) -> CudaError {
        describe_error(
            self.api.get_error_name,
            self.api.get_error_string,
            call,
            code,
        )
    }
}

/// The library to open: `env` (the value of [`LIBRARY_ENV`]) when set and non-empty, else
/// [`DEFAULT_LIBRARY`].
pub fn library_path(env: Option<OsString>) -> OsString {
    env.filter(|p| !p.is_empty())
        .unwrap_or_else(|| OsString::from(DEFAULT_LIBRARY))
}

/// Which batch API to use for a driver reporting `version` and exporting the given symbols.
/// The version decides whether a symbol may be trusted to have the signature used here.
pub fn choose_batch_api(version: i32, has_v1: bool, has_v2: bool) -> BatchApi {
    if version >= BATCH_V2_MIN_VERSION && has_v2 {
        BatchApi::Cuda13
    } else if version >= BATCH_V1_MIN_VERSION && has_v1 {
        // A 13.x driver lacking `_v2` still exports the 12.8 ABI under the plain name:
        // NVIDIA never changes an exported symbol's signature.
        BatchApi::Cuda12_8
    } else {
        BatchApi::Unavailable
    }
}

fn describe_error(
    get_name: Option<sys::cuGetErrorName_t>,
    get_string: Option<sys::cuGetErrorString_t>,
    call: String,
    code: CUresult,
) -> CudaError {
    let lookup = |f: Option<sys::cuGetErrorName_t>| -> Option<String> {
        let f = f?;
        let mut out: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: `out` is a valid out-pointer; on success the driver stores a pointer to a
        // static NUL-terminated string (or leaves it null, which we check).
        let rc = unsafe { f(code, &mut out) };
        if rc != sys::CUDA_SUCCESS || out.is_null() {
            return None;
        }
        // SAFETY: non-null, NUL-terminated, static per the driver API contract.
        Some(
            unsafe { CStr::from_ptr(out) }
                .to_string_lossy()
                .into_owned(),
        )
    };
    let name = lookup(get_name)
        .or_else(|| sys::known_error_name(code).map(str::to_owned))
        .unwrap_or_else(|| format!("CUDA_ERROR_{code}"));
    let description = lookup(get_string).unwrap_or_else(|| "no description".to_owned());
    CudaError::Call {
        call,
        code,
        name,
        description,
    }
}

/// Settings of a [`CudaCopyBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Device ordinal (as PyTorch numbers it: `tensor.device.index`) whose primary context
    /// is used.
    pub device: i32,
    /// Use `cuMemcpyBatchAsync` when the driver has it; `false` forces the `cuMemcpyAsync`
    /// loop (for comparisons).
    pub allow_batch: bool,
    /// Most bytes pinned by one `cuMemHostRegister` call; a multiple of
    /// [`PIN_CHUNK_ALIGN`]. Copies never cross a chunk boundary on the host side.
    pub pin_chunk_bytes: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device: 0,
            allow_batch: true,
            pin_chunk_bytes: DEFAULT_PIN_CHUNK_BYTES,
        }
    }
}

/// A driver handle (context, stream, event) stored as an address so the backend is `Send`:
/// the handles are opaque tokens the driver accepts from any thread whose current context
/// owns them (the copy thread, once attached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Handle(usize);

impl Handle {
    fn from_ptr(p: *mut c_void) -> Self {
        Self(p as usize)
    }

    fn ptr(self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

/// What `attach` set up; torn down in `Drop`.
#[derive(Debug, Default)]
struct Attached {
    context_retained: bool,
    stream: Option<Handle>,
    /// `(base, len)` of every successful `cuMemHostRegister`.
    pinned: Vec<(u64, usize)>,
}

/// A job on the stream.
#[derive(Debug)]
struct InFlight {
    event: Handle,
    /// A copy failed after part of the job was enqueued: report it once the stream has
    /// finished with the job's memory.
    deferred: Option<BackendError>,
}

/// One copy as handed to the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Descriptor {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: usize,
}

/// A [`CopyBackend`] over the CUDA driver. See the [module docs](self).
#[derive(Debug)]
pub struct CudaCopyBackend {
    driver: Arc<CudaDriver>,
    options: CudaOptions,
    device: sys::CUdevice,
    batch: BatchApi,
    attached: Attached,
    /// `(base, len)` of the engine's host memory, once attached.
    host: Option<(u64, usize)>,
    in_flight: HashMap<u64, InFlight>,
    free_events: Vec<Handle>,
    next_ticket: u64,
    descriptors: Vec<Descriptor>,
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
}

impl CudaCopyBackend {
    /// A backend for device `options.device`. Validates the options and the ordinal
    /// (`cuDeviceGet`) now, so a bad device fails at start; touches no context until
    /// `attach` runs on the copy thread.
    pub fn new(driver: Arc<CudaDriver>, options: CudaOptions) -> Result<Self, CudaError> {
        if options.pin_chunk_bytes == 0 || options.pin_chunk_bytes % PIN_CHUNK_ALIGN != 0 {
            return Err(CudaError::InvalidOption {
                field: "pin_chunk_bytes",
                value: options.pin_chunk_bytes.to_string(),
                reason: "must be a positive multiple of 4096",
            });
        }
        if options.device < 0 {
            return Err(CudaError::InvalidOption {
                field: "device",
                value: options.device.to_string(),
                reason: "must be >= 0",
            });
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer; the ordinal is passed by value.
        let rc = unsafe { (driver.api.device_get)(&mut device, options.device) };
        driver.check(&format!("cuDeviceGet(ordinal {})", options.device), rc)?;
        let batch = if options.allow_batch {
            driver.batch_api()
        } else {
            BatchApi::Unavailable
        };
        Ok(Self {
            driver,
            options,
            device,
            batch,
            attached: Attached::default(),
            host: None,
            in_flight: HashMap::new(),
            free_events: Vec::new(),
            next_ticket: 0,
            descriptors: Vec::new(),
            dsts: Vec::new(),
            srcs: Vec::new(),
            sizes: Vec::new(),
        })
    }

    /// Loads the driver ([`CudaDriver::load`]) and builds a backend on it.
    pub fn open(options: CudaOptions) -> Result<Self, CudaError> {
        Self::new(Arc::new(CudaDriver::load()?), options)
    }

    /// The copy path jobs use.
    pub fn batch_api(&self) -> BatchApi {
        self.batch
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<CudaDriver> {
        &self.driver
    }

    fn api(&self) -> &Api {
        &self.driver.api
    }

    fn check(&self, call: &str, code: CUresult) -> Result<(), CudaError> {
        self.driver.check(call, code)
    }

    fn stream(&self) -> Result<Handle, BackendError> {
        self.attached
            .stream
            .ok_or_else(|| BackendError::job("cuda backend used before attach succeeded"))
    }

    fn attach_inner(&mut self, host_base: u64, host_len: usize) -> Result<(), CudaError> {
        let api = *self.api();
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; `device` came from `cuDeviceGet`.
        let rc = unsafe { (api.primary_ctx_retain)(&mut ctx, self.device) };
        self.check(
            &format!("cuDevicePrimaryCtxRetain(device {})", self.options.device),
            rc,
        )?;
        self.attached.context_retained = true;
        // SAFETY: `ctx` is the retained primary context, valid until we release it.
        let rc = unsafe { (api.ctx_set_current)(ctx) };
        self.check("cuCtxSetCurrent", rc)?;

        // Numerically greatest is lowest priority: copies yield to compute kernels.
        let mut least: c_int = 0;
        if let Some(range) = api.ctx_get_stream_priority_range {
            let mut greatest: c_int = 0;
            // SAFETY: both are valid out-pointers.
            let rc = unsafe { range(&mut least, &mut greatest) };
            self.check("cuCtxGetStreamPriorityRange", rc)?;
        }
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer; flags and priority are by value.
        let rc = unsafe {
            (api.stream_create_with_priority)(&mut stream, sys::CU_STREAM_NON_BLOCKING, least)
        };
        self.check(
            &format!("cuStreamCreateWithPriority(CU_STREAM_NON_BLOCKING, priority {least})"),
            rc,
        )?;
        self.attached.stream = Some(Handle::from_ptr(stream));

        let started = Instant::now();
        let chunk = self.options.pin_chunk_bytes;
        let mut offset = 0usize;
        while offset < host_len {
            let len = chunk.min(host_len - offset);
            let base = host_base.wrapping_add(offset as u64);
            // SAFETY: `base..base+len` lies inside the engine's host mapping (`attach`'s
            // contract), which outlives this backend; registration only pins the pages.
            let rc = unsafe {
                (api.mem_host_register)(
                    base as usize as *mut c_void,
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            self.check(
                &format!(
                    "cuMemHostRegister(bytes {offset}..{} of {host_len})",
                    offset + len
                ),
                rc,
            )?;
            self.attached.pinned.push((base, len));
            offset += len;
        }
        self.host = Some((host_base, host_len));
        log::info!(
            "kvoffload: pinned {:.2} GiB of host memory in {} chunk(s) in {:.2} s; {}",
            host_len as f64 / f64::from(1u32 << 30),
            self.attached.pinned.len(),
            started.elapsed().as_secs_f64(),
            self.describe()
        );
        Ok(())
    }

    fn take_event(&mut self) -> Result<Handle, CudaError> {
        if let Some(event) = self.free_events.pop() {
            return Ok(event);
        }
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `event` is a valid out-pointer.
        let rc = unsafe { (self.api().event_create)(&mut event, sys::CU_EVENT_DISABLE_TIMING) };
        self.check("cuEventCreate(CU_EVENT_DISABLE_TIMING)", rc)?;
        Ok(Handle::from_ptr(event))
    }

    fn destroy_event(&self, event: Handle) {
        // SAFETY: `event` was created by `cuEventCreate` and is destroyed once.
        let rc = unsafe { (self.api().event_destroy)(event.ptr()) };
        if let Err(err) = self.check("cuEventDestroy", rc) {
            log::debug!("{err}");
        }
    }

    /// Enqueues the copies in `self.descriptors` on `stream`: one batch call, or one
    /// `cuMemcpyAsync` each. On failure, copies before the failing one may be enqueued.
    ///
    /// # Safety
    ///
    /// The descriptors must satisfy [`CopyBackend::submit`]'s contract.
    unsafe fn enqueue(&mut self, stream: Handle) -> Result<(), CudaError> {
        let api = *self.api();
        match self.batch {
            BatchApi::Unavailable => {
                for (i, d) in self.descriptors.iter().enumerate() {
                    // SAFETY: the caller vouches for the addresses; the stream is ours.
                    let rc = unsafe { (api.memcpy_async)(d.dst, d.src, d.len, stream.ptr()) };
                    if rc != sys::CUDA_SUCCESS {
                        return Err(self.driver.error(
                            format!(
                                "cuMemcpyAsync (copy {i} of {}, {} bytes)",
                                self.descriptors.len(),
                                d.len
                            ),
                            rc,
                        ));
                    }
                }
                Ok(())
            }
            BatchApi::Cuda12_8 | BatchApi::Cuda13 => {
                self.dsts.clear();
                self.srcs.clear();
                self.sizes.clear();
                for d in &self.descriptors {
                    self.dsts.push(d.dst);
                    self.srcs.push(d.src);
                    self.sizes.push(d.len);
                }
                let count = self.descriptors.len();
                let mut attrs = [sys::CUmemcpyAttributes {
                    // Stores read device blocks that the compute stream may still write
                    // until the waited-on event: the source must be read in stream order.
                    srcAccessOrder: sys::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                    srcLocHint: sys::CUmemLocation {
                        type_: sys::CU_MEM_LOCATION_TYPE_INVALID,
                        id: 0,
                    },
                    dstLocHint: sys::CUmemLocation {
                        type_: sys::CU_MEM_LOCATION_TYPE_INVALID,
                        id: 0,
                    },
                    flags: sys::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
                }];
                let mut attr_idx = [0usize];
                let mut fail_idx = usize::MAX;
                let rc = match (self.batch, api.memcpy_batch_v1, api.memcpy_batch_v2) {
                    // SAFETY: the three arrays hold `count` entries and `attrs`/`attr_idx`
                    // one each, all alive for the call (the driver copies them before
                    // returning); the caller vouches for the addresses.
                    (BatchApi::Cuda12_8, Some(f), _) => unsafe {
                        f(
                            self.dsts.as_mut_ptr(),
                            self.srcs.as_mut_ptr(),
                            self.sizes.as_mut_ptr(),
                            count,
                            attrs.as_mut_ptr(),
                            attr_idx.as_mut_ptr(),
                            1,
                            &mut fail_idx,
                            stream.ptr(),
                        )
                    },
                    // SAFETY: as above.
                    (BatchApi::Cuda13, _, Some(f)) => unsafe {
                        f(
                            self.dsts.as_mut_ptr(),
                            self.srcs.as_mut_ptr(),
                            self.sizes.as_mut_ptr(),
                            count,
                            attrs.as_mut_ptr(),
                            attr_idx.as_mut_ptr(),
                            1,
                            stream.ptr(),
                        )
                    },
                    // `choose_batch_api` only picks a variant whose symbol resolved.
                    _ => sys::CUDA_ERROR_NOT_FOUND,
                };
                if rc == sys::CUDA_SUCCESS {
                    return Ok(());
                }
                let at = if fail_idx < count {
                    format!(", failed at copy {fail_idx}")
                } else {
                    String::new()
                };
                Err(self
                    .driver
                    .error(format!("{} ({count} copies{at})", self.batch.symbol()), rc))
            }
        }
    }
}

/// Turns `runs` into driver copies: merges runs adjacent on both sides, and splits at the
/// boundaries of the host memory's pinned chunks (`host`: base, length, chunk size), since
/// one DMA must not span two registrations. Zero-length runs are dropped.
pub(crate) fn build_descriptors(
    runs: &[CopyRun],
    direction: Direction,
    host: Option<(u64, usize, usize)>,
    out: &mut Vec<Descriptor>,
) {
    out.clear();
    // Index of the pinned chunk holding host address `addr`, if it is in host memory.
    let chunk_of = |addr: u64| -> Option<u64> {
        let (base, len, chunk) = host?;
        let rel = addr.checked_sub(base)?;
        (rel < len as u64).then(|| rel / chunk.max(1) as u64)
    };
    let host_side = |d: &Descriptor| match direction {
        Direction::Store => d.dst,
        Direction::Load => d.src,
    };
    for run in runs {
        let mut done = 0usize;
        while done < run.len {
            let mut piece = Descriptor {
                src: run.src.wrapping_add(done as u64),
                dst: run.dst.wrapping_add(done as u64),
                len: run.len - done,
            };
            if let (Some((base, _, chunk)), Some(index)) = (host, chunk_of(host_side(&piece))) {
                let chunk_end = base
                    .saturating_add((index + 1).saturating_mul(chunk as u64))
                    .saturating_sub(host_side(&piece));
                piece.len = piece
                    .len
                    .min(usize::try_from(chunk_end).unwrap_or(usize::MAX));
            }
            done += piece.len;
            if let Some(last) = out.last_mut() {
                let adjacent = last.src.wrapping_add(last.len as u64) == piece.src
                    && last.dst.wrapping_add(last.len as u64) == piece.dst;
                let same_chunk = chunk_of(host_side(last))
                    == chunk_of(host_side(&piece).wrapping_add(piece.len as u64 - 1));
                if adjacent && same_chunk {
                    last.len += piece.len;
                    continue;
                }
            }
            out.push(piece);
        }
    }
}

impl CopyBackend for CudaCopyBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn describe(&self) -> String {
        format!(
            "cuda (driver {}, device {}, {})",
            version_text(self.driver.version),
            self.options.device,
            self.batch.symbol()
        )
    }

    fn attach(&mut self, host_base: u64, host_len: usize) -> Result<(), BackendError> {
        // Any failure here is fatal to the engine anyway; keep the driver's words.
        self.attach_inner(host_base, host_len)
            .map_err(|e| BackendError::fatal(e.to_string()))
    }

    fn wait_event(&mut self, event: u64) -> Result<(), BackendError> {
        let stream = self.stream()?;
        let handle = usize::try_from(event)
            .map_err(|_| BackendError::job(format!("event handle {event:#x} exceeds usize")))?;
        if handle == 0 {
            return Err(BackendError::job("wait event handle is null"));
        }
        // SAFETY: the caller passes a live event handle (`TransferJob::wait_event`'s
        // contract); the driver validates it and fails with INVALID_HANDLE otherwise.
        let rc = unsafe {
            (self.api().stream_wait_event)(
                stream.ptr(),
                Handle(handle).ptr(),
                sys::CU_EVENT_WAIT_DEFAULT,
            )
        };
        self.check(&format!("cuStreamWaitEvent(event {event:#x})"), rc)
            .map_err(BackendError::from)
    }

    unsafe fn submit(
        &mut self,
        direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError> {
        let stream = self.stream()?;
        let host = self
            .host
            .map(|(base, len)| (base, len, self.options.pin_chunk_bytes));
        let mut descriptors = std::mem::take(&mut self.descriptors);
        build_descriptors(runs, direction, host, &mut descriptors);
        self.descriptors = descriptors;
        let copied = if self.descriptors.is_empty() {
            Ok(())
        } else {
            // SAFETY: the descriptors cover exactly the bytes of `runs`, for which our caller
            // upholds `submit`'s contract.
            unsafe { self.enqueue(stream) }
        };
        if let Err(err) = &copied {
            if err.is_sticky() {
                return Err(err.clone().into());
            }
        }
        let deferred = copied.err().map(BackendError::from);
        let event = self.take_event().map_err(BackendError::from)?;
        // SAFETY: both handles are ours and alive.
        let rc = unsafe { (self.api().event_record)(event.ptr(), stream.ptr()) };
        if let Err(err) = self.check("cuEventRecord", rc) {
            self.destroy_event(event);
            if deferred.is_some() {
                // Part of the job may be enqueued: it must finish before the engine lets
                // anyone reuse the job's memory.
                // SAFETY: our stream.
                let rc = unsafe { (self.api().stream_synchronize)(stream.ptr()) };
                if let Err(sync) = self.check("cuStreamSynchronize", rc) {
                    log::warn!("after a failed copy: {sync}");
                }
            }
            return Err(deferred.unwrap_or_else(|| err.into()));
        }
        let ticket = self.next_ticket;
        self.next_ticket = self.next_ticket.wrapping_add(1);
        self.in_flight.insert(ticket, InFlight { event, deferred });
        Ok(Ticket(ticket))
    }

    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
        let Some(job) = self.in_flight.get(&ticket.0) else {
            return Err(BackendError::job(format!(
                "unknown cuda ticket {}",
                ticket.0
            )));
        };
        let event = job.event;
        // SAFETY: a live event of ours.
        let rc = unsafe { (self.api().event_query)(event.ptr()) };
        match rc {
            sys::CUDA_ERROR_NOT_READY => Ok(false),
            sys::CUDA_SUCCESS => {
                let deferred = self.in_flight.remove(&ticket.0).and_then(|j| j.deferred);
                self.free_events.push(event);
                match deferred {
                    Some(err) => Err(err),
                    None => Ok(true),
                }
            }
            code => {
                self.in_flight.remove(&ticket.0);
                self.destroy_event(event);
                Err(self.driver.error("cuEventQuery".into(), code).into())
            }
        }
    }
}

impl Drop for CudaCopyBackend {
    fn drop(&mut self) {
        let api = *self.api();
        if let Some(stream) = self.attached.stream.take() {
            // Nothing may still be copying into memory we are about to unpin.
            // SAFETY: our stream.
            let rc = unsafe { (api.stream_synchronize)(stream.ptr()) };
            if let Err(err) = self.check("cuStreamSynchronize", rc) {
                log::warn!("cuda backend shutdown: {err}");
            }
            let events: Vec<Handle> = self
                .in_flight
                .drain()
                .map(|(_, job)| job.event)
                .chain(self.free_events.drain(..))
                .collect();
            for event in events {
                self.destroy_event(event);
            }
            // SAFETY: our stream, destroyed once.
            let rc = unsafe { (api.stream_destroy)(stream.ptr()) };
            if let Err(err) = self.check("cuStreamDestroy", rc) {
                log::debug!("{err}");
            }
        }
        for (base, len) in std::mem::take(&mut self.attached.pinned) {
            // SAFETY: `base` is the start of a range we registered and have not unregistered.
            let rc = unsafe { (api.mem_host_unregister)(base as usize as *mut c_void) };
            if let Err(err) = self.check(&format!("cuMemHostUnregister({len} bytes)"), rc) {
                log::warn!("cuda backend shutdown: {err}");
            }
        }
        if std::mem::take(&mut self.attached.context_retained) {
            // SAFETY: balances the successful retain in `attach`.
            let rc = unsafe { (api.primary_ctx_release)(self.device) };
            if let Err(err) = self.check("cuDevicePrimaryCtxRelease", rc) {
                log::debug!("{err}");
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn run(src: u64, dst: u64, len: usize) -> CopyRun {
        CopyRun { src, dst, len }
    }

    fn descs(
        runs: &[CopyRun],
        dir: Direction,
        host: Option<(u64, usize, usize)>,
    ) -> Vec<(u64, u64, usize)> {
        let mut out = Vec::new();
        build_descriptors(runs, dir, host, &mut out);
        out.iter().map(|d| (d.src, d.dst, d.len)).collect()
    }

    #[test]
    fn adjacent_runs_merge_and_others_do_not() {
        let runs = [
            run(0, 1000, 10),
            run(10, 1010, 5),
            run(20, 1015, 5),
            run(25, 1020, 0),
        ];
        assert_eq!(
            descs(&runs, Direction::Store, None),
            [(0, 1000, 15), (20, 1015, 5)]
        );
    }

    #[test]
    fn host_side_is_split_at_pin_chunks() {
        // Host memory at 4096, 3 chunks of 4096 bytes; a store writing host addresses
        // 8096..12096 crosses the boundary at 8192.
        let host = Some((4096u64, 3 * 4096usize, 4096usize));
        let runs = [run(0x10_0000, 4096 + 4000, 4000)];
        assert_eq!(
            descs(&runs, Direction::Store, host),
            [(0x10_0000, 8096, 96), (0x10_0000 + 96, 8192, 3904)]
        );
        // A load reads the host side: same split, applied to the source.
        let runs = [run(4096 + 4000, 0x10_0000, 4000)];
        assert_eq!(
            descs(&runs, Direction::Load, host),
            [(8096, 0x10_0000, 96), (8192, 0x10_0000 + 96, 3904)]
        );
        // Adjacent runs meeting at a boundary stay separate.
        let runs = [run(0, 4096, 4096), run(4096, 8192, 4096)];
        assert_eq!(descs(&runs, Direction::Store, host).len(), 2);
        // Within one chunk they merge.
        let runs = [run(0, 4096, 100), run(100, 4196, 100)];
        assert_eq!(descs(&runs, Direction::Store, host), [(0, 4096, 200)]);
    }

    #[test]
    fn batch_api_follows_the_version() {
        assert_eq!(choose_batch_api(12040, true, true), BatchApi::Unavailable);
        assert_eq!(choose_batch_api(12080, true, false), BatchApi::Cuda12_8);
        assert_eq!(choose_batch_api(12090, true, true), BatchApi::Cuda12_8);
        assert_eq!(choose_batch_api(13000, true, true), BatchApi::Cuda13);
        assert_eq!(choose_batch_api(13000, true, false), BatchApi::Cuda12_8);
        assert_eq!(choose_batch_api(13000, false, false), BatchApi::Unavailable);
        assert_eq!(choose_batch_api(12080, false, true), BatchApi::Unavailable);
    }

    #[test]
    fn library_path_prefers_a_non_empty_env() {
        assert_eq!(library_path(None), OsString::from(DEFAULT_LIBRARY));
        assert_eq!(
            library_path(Some("".into())),
            OsString::from(DEFAULT_LIBRARY)
        );
        assert_eq!(
            library_path(Some("/x/libcuda.so".into())),
            OsString::from("/x/libcuda.so")
        );
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let err = CudaError::DriverTooOld {
            version: 11040,
            minimum: MIN_DRIVER_VERSION,
        };
        assert!(err.to_string().contains("11.4 is too old"), "{err}");
        assert!(err.to_string().contains("11.8"), "{err}");
        let err = describe_error(
            None,
            None,
            "cuEventQuery".into(),
            sys::CUDA_ERROR_ILLEGAL_ADDRESS,
        );
        assert!(err.is_sticky());
        assert!(
            err.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS (700)"),
            "{err}"
        );
        assert!(BackendError::from(err).is_fatal());
        let err = describe_error(None, None, "x".into(), 12345);
        assert!(err.to_string().contains("CUDA_ERROR_12345"), "{err}");
        assert!(!BackendError::from(err).is_fatal());
    }

    #[test]
    fn a_missing_library_is_a_clear_error() {
        let err = CudaDriver::load_from("/nonexistent/libcuda.so.1").unwrap_err();
        assert!(matches!(err, CudaError::LibraryNotFound { .. }), "{err:?}");
        assert!(
            err.to_string().contains("/nonexistent/libcuda.so.1"),
            "{err}"
        );
        assert!(err.to_string().contains(LIBRARY_ENV), "{err}");
    }
}
