//! CUDA backend: copies between device regions and pinned host memory with the CUDA
//! driver API, loaded at run time.
//!
//! Nothing links against CUDA. [`CudaDriver::load`] opens `libcuda.so.1` (or the file named
//! by `KVOFFLOAD_LIBCUDA`) with `dlopen`, resolves every driver function as optional, and
//! refuses with a typed [`CudaError`] when a required one is missing, the library is absent,
//! or the driver is older than [`MIN_DRIVER_VERSION`]. The driver version also picks the copy
//! path ([`BatchApi`]): `cuMemcpyBatchAsync` calls of at most [`MAX_BATCH_COPIES`] copies
//! when the driver has it (CUDA 12.8 and 13.x export it with different signatures), else a
//! loop of `cuMemcpyAsync`.
//!
//! [`CudaCopyBackend`] runs on the engine's copy thread. Its `attach` retains the device's
//! primary context (the one PyTorch uses), makes it current on the copy thread, creates two
//! non-blocking streams, one per direction (stores at the lowest priority, so they yield to
//! compute; loads one step higher, and never queued behind stores), and pins the
//! engine's host memory with `cuMemHostRegister` in chunks of at most
//! [`CudaOptions::pin_chunk_bytes`]. Each job: an optional `cuStreamWaitEvent` on the
//! caller's event (stores wait for the compute stream), the copies, and an event record;
//! completion is polled with `cuEventQuery`. Errors that poison the context (illegal address
//! and the like) are fatal to the engine; others fail only their job. On drop the backend
//! drains its stream, destroys its events and stream, unpins the memory and releases the
//! context.

mod backend;
mod driver;
mod enqueue;
mod sys;

use super::BackendError;

pub use backend::{CudaCopyBackend, CudaOptions};
pub use driver::{choose_batch_api, library_path, CudaDriver};

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

/// Most copies handed to one `cuMemcpyBatchAsync` call. The driver spends CPU time on every
/// copy before the call returns, and the copy engines start only then: smaller calls let
/// the engines work on the first copies while the driver takes the next.
pub const MAX_BATCH_COPIES: usize = 2048;

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
pub(crate) fn version_text(version: i32) -> String {
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::driver::describe_error;
    use super::*;

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
}
