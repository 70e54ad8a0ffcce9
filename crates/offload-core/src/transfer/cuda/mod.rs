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
mod error;
mod options;
mod sys;

pub use backend::CudaCopyBackend;
pub use driver::{choose_batch_api, library_path, CudaDriver};
pub use error::CudaError;
pub use options::CudaOptions;

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
