//! Worker-side transfer engine: moves KV blocks between device regions and host memory.
//!
//! The caller (one per worker rank) hands the engine one [`TransferJob`] per step and
//! direction. A single copy thread validates each job, coalesces its block pairs into
//! [`CopyRun`]s per region, submits them to a [`CopyBackend`], polls the backend until the
//! job is done and reports a [`Completion`]. The caller never blocks on a copy: `submit`
//! fails fast with [`SubmitError::QueueFull`] when the queue is full, and
//! [`TransferEngine::poll_completions`] only drains what is ready.
//!
//! Host layout is region-major: one [`HostMemory`](crate::memory::HostMemory) of
//! `num_cpu_blocks * cpu_block_bytes` bytes, where region `r` owns the area starting at
//! `num_cpu_blocks * (sum of block_bytes of regions before r)` and CPU block `c` of region `r`
//! is at `area_r + c * block_bytes_r`. Consecutive CPU ids are therefore adjacent within a
//! region, so a run of consecutive `(device, cpu)` pairs is one copy per region whenever the
//! device region is contiguous.
//!
//! Loads and stores travel in separate lanes (queues, jobs in flight and, on CUDA, streams):
//! a load, which a request is waiting for, never waits behind stores. Completions are
//! reported in submission order within each direction, and a completion (success or
//! failure) is sent only once no copy of its job can still write. A job that fails (bad id, backend
//! error) fails alone; a fatal backend error, or a [`TransferEngine::wait_for`] that runs out
//! of time, stops the engine for good: every later job and submit names the reason.
//!
//! Backends: [`HostCopyBackend`] (memcpy; CPU-only servers and tests) and
//! [`CudaCopyBackend`] (the CUDA driver, loaded at run time; see [`cuda`]). The backend's
//! [`attach`](CopyBackend::attach) (e.g. pinning the host memory) runs on the copy thread, so
//! construction returns at once; [`TransferEngine::is_ready`] turns true when it finished,
//! and jobs submitted before that simply wait in the queue.
//!
//! ```
//! use std::time::Duration;
//! use offload_core::transfer::{Direction, RegionSpec, TransferConfig, TransferEngine, TransferJob};
//!
//! let mut device = vec![0u8; 8 * 16];
//! device[16..32].fill(9); // device block 1
//! // SAFETY: `device` outlives the engine and is not touched while a job is in flight.
//! let region = unsafe { RegionSpec::new(device.as_mut_ptr() as u64, 8, 16, 16) }?;
//! let engine = TransferEngine::new(vec![region], 4, TransferConfig::default())?;
//! engine.submit(TransferJob::new(1, Direction::Store, vec![(1, 3)]))?;
//! engine.wait_for(&[1], Duration::from_secs(10))?;
//! engine.submit(TransferJob::new(2, Direction::Load, vec![(5, 3)]))?;
//! let done = engine.wait_for(&[2], Duration::from_secs(10))?;
//! assert!(done[0].result.is_ok());
//! drop(engine);
//! assert_eq!(&device[80..96], &[9u8; 16][..]); // device block 5 now holds block 1's bytes
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod attachment;
mod backend;
mod config;
mod copy_thread;
pub mod cuda;
mod engine;
mod error;
pub mod fault;
mod host;
mod host_blocks;
mod layout;
mod region;
mod shared;
mod stats;
mod types;

pub use attachment::{AttachError, DetachError};
pub use backend::{BackendError, CopyBackend, Ticket};
pub use config::{BackendKind, TransferConfig};
pub use cuda::{BatchApi, CudaCopyBackend, CudaDriver, CudaError, CudaOptions, MAX_BATCH_COPIES};
pub use engine::TransferEngine;
pub use error::{
    BlockAccessError, BlockSide, BuildError, JobError, ReadyError, RegionError, ShutdownError,
    SubmitError, WaitError,
};
pub use fault::{FaultInjector, FaultPlan, FaultSpecError};
pub use host::HostCopyBackend;
pub use host_blocks::HostBlocks;
pub use region::{coalesce, CopyRun, RegionSpec};
pub use stats::TransferStats;
pub use types::{Completion, Direction, TransferJob};
