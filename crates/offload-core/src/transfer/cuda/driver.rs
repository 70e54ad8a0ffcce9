//! Loading the driver library: resolving its functions, checking its version, choosing the
//! copy path, and turning `CUresult`s into [`CudaError`]s.

use std::ffi::{c_int, CStr, OsStr, OsString};

use libloading::Library;

use super::sys::{self, CUresult};
use super::{
    version_text, BatchApi, CudaError, BATCH_V1_MIN_VERSION, BATCH_V2_MIN_VERSION, DEFAULT_LIBRARY,
    LIBRARY_ENV, MIN_DRIVER_VERSION,
};

/// Every driver function the backend uses; optional ones stay `Option`.
#[derive(Clone, Copy)]
pub(super) struct Api {
    pub(super) init: sys::cuInit_t,
    pub(super) device_get: sys::cuDeviceGet_t,
    pub(super) primary_ctx_retain: sys::cuDevicePrimaryCtxRetain_t,
    pub(super) primary_ctx_release: sys::cuDevicePrimaryCtxRelease_t,
    pub(super) ctx_set_current: sys::cuCtxSetCurrent_t,
    pub(super) stream_create_with_priority: sys::cuStreamCreateWithPriority_t,
    pub(super) stream_destroy: sys::cuStreamDestroy_t,
    pub(super) stream_synchronize: sys::cuStreamSynchronize_t,
    pub(super) stream_wait_event: sys::cuStreamWaitEvent_t,
    pub(super) event_create: sys::cuEventCreate_t,
    pub(super) event_record: sys::cuEventRecord_t,
    pub(super) event_query: sys::cuEventQuery_t,
    pub(super) event_destroy: sys::cuEventDestroy_t,
    pub(super) memcpy_async: sys::cuMemcpyAsync_t,
    pub(super) mem_host_register: sys::cuMemHostRegister_t,
    pub(super) mem_host_unregister: sys::cuMemHostUnregister_t,
    pub(super) ctx_get_stream_priority_range: Option<sys::cuCtxGetStreamPriorityRange_t>,
    pub(super) get_error_name: Option<sys::cuGetErrorName_t>,
    pub(super) get_error_string: Option<sys::cuGetErrorString_t>,
    pub(super) memcpy_batch_v1: Option<sys::cuMemcpyBatchAsync_v1_t>,
    pub(super) memcpy_batch_v2: Option<sys::cuMemcpyBatchAsync_v2_t>,
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
/// Cheap to share (`Arc`): every [`CudaCopyBackend`](super::CudaCopyBackend) holds one, and the library stays
/// loaded while any does.
pub struct CudaDriver {
    path: String,
    version: i32,
    batch: BatchApi,
    pub(super) api: Api,
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

        // SAFETY: each type is the symbol's cuda.h signature (see `sys`).
        let get_error_name: Option<sys::cuGetErrorName_t> =
            unsafe { symbol(&library, "cuGetErrorName") };
        // SAFETY: as above.
        let get_error_string: Option<sys::cuGetErrorString_t> =
            unsafe { symbol(&library, "cuGetErrorString") };
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

        // Every required symbol is looked up before any is unwrapped, so the error lists all
        // that are absent at once.
        macro_rules! resolve_api {
            (
                required { $($field:ident = $name:literal),* $(,)? }
                optional { $($opt_field:ident = $opt_name:literal),* $(,)? }
            ) => {{
                let mut absent = Vec::new();
                $(
                    // SAFETY: each field's type is that symbol's cuda.h signature (see
                    // `sys`).
                    let $field = unsafe { symbol(&library, $name) };
                    if $field.is_none() {
                        absent.push($name);
                    }
                )*
                let ($(Some($field),)*) = ($($field,)*) else {
                    return Err(missing(absent));
                };
                Api {
                    $($field,)*
                    // SAFETY: as for the required symbols.
                    $($opt_field: unsafe { symbol(&library, $opt_name) },)*
                    get_error_name,
                    get_error_string,
                }
            }};
        }
        let api = resolve_api! {
            required {
                init = "cuInit",
                device_get = "cuDeviceGet",
                primary_ctx_retain = "cuDevicePrimaryCtxRetain",
                primary_ctx_release = "cuDevicePrimaryCtxRelease_v2",
                ctx_set_current = "cuCtxSetCurrent",
                stream_create_with_priority = "cuStreamCreateWithPriority",
                stream_destroy = "cuStreamDestroy_v2",
                stream_synchronize = "cuStreamSynchronize",
                stream_wait_event = "cuStreamWaitEvent",
                event_create = "cuEventCreate",
                event_record = "cuEventRecord",
                event_query = "cuEventQuery",
                event_destroy = "cuEventDestroy_v2",
                memcpy_async = "cuMemcpyAsync",
                mem_host_register = "cuMemHostRegister_v2",
                mem_host_unregister = "cuMemHostUnregister",
            }
            optional {
                ctx_get_stream_priority_range = "cuCtxGetStreamPriorityRange",
                memcpy_batch_v1 = "cuMemcpyBatchAsync",
                memcpy_batch_v2 = "cuMemcpyBatchAsync_v2",
            }
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
    pub(super) fn check(&self, call: &str, code: CUresult) -> Result<(), CudaError> {
        if code == sys::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call.to_owned(), code))
        }
    }

    pub(super) fn error(&self, call: String, code: CUresult) -> CudaError {
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

pub(super) fn describe_error(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
