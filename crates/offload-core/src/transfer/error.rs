//! One error type per operation of the transfer engine. Every message names the offending
//! value.

use super::cuda::CudaError;
use crate::memory::MemoryError;

/// Which id space a block id belongs to, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockSide {
    /// A device (GPU) block id, indexing every [`RegionSpec`](super::RegionSpec).
    Gpu,
    /// A CPU block id, indexing the engine's host memory.
    Cpu,
}

impl std::fmt::Display for BlockSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Gpu => "gpu",
            Self::Cpu => "cpu",
        })
    }
}

/// Why [`RegionSpec::new`](super::RegionSpec::new) refused a shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid region: {reason}")]
pub struct RegionError {
    /// What is wrong, naming the value.
    pub reason: String,
}

/// Why an engine could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// A construction parameter is invalid.
    #[error("invalid transfer config: {field} = {value}: {reason}")]
    InvalidConfig {
        /// The parameter's name.
        field: &'static str,
        /// Its value.
        value: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// Host memory could not be allocated.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The copy thread could not be started.
    #[error("failed to start the copy thread: {message}")]
    ThreadSpawn {
        /// The OS error.
        message: String,
    },
    /// The CUDA driver could not be loaded or the CUDA backend could not be built.
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// Why [`TransferEngine::submit`](super::TransferEngine::submit) refused a job. A refused
/// job was not queued: nothing of it is copied and no completion will come for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// A job with this id is already in flight.
    #[error("job id {id} is already in flight")]
    DuplicateJobId {
        /// The repeated job id.
        id: u64,
    },
    /// The job queue is full.
    #[error("transfer queue full ({capacity} jobs queued); job {id} not queued")]
    QueueFull {
        /// The rejected job's id.
        id: u64,
        /// The queue's capacity.
        capacity: usize,
    },
    /// The engine was shut down.
    #[error("transfer engine shut down; job {id} not queued")]
    Shutdown {
        /// The job's id.
        id: u64,
    },
    /// The engine stopped for good (a fatal device fault or a timed-out wait).
    #[error("transfer engine stopped; job {id} not queued: {reason}")]
    Stopped {
        /// The job's id.
        id: u64,
        /// Why the engine stopped.
        reason: String,
    },
    /// The device regions are detached (the server released its KV memory).
    #[error("KV caches unregistered (device regions detached); job {id} not queued")]
    Detached {
        /// The job's id.
        id: u64,
    },
}

/// Why a job failed: the `result` of its [`Completion`](super::Completion). Whatever the
/// error, no copy of the job runs any more when it is reported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// A block id is outside its id space; nothing was copied.
    #[error("{side} block id {id} out of range: must be < {limit}")]
    InvalidBlock {
        /// Device or CPU id.
        side: BlockSide,
        /// The offending id.
        id: u32,
        /// The exclusive upper bound (for device ids: the smallest region's `num_blocks`).
        limit: u32,
    },
    /// Two pairs of the job write the same destination block; nothing was copied.
    #[error("{side} block id {id} is the destination of more than one pair in one job")]
    DuplicateDestination {
        /// Destination side: CPU for stores, device for loads.
        side: BlockSide,
        /// The repeated id.
        id: u32,
    },
    /// The backend failed the job.
    #[error("{backend} backend failed: {message}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// The backend's message.
        message: String,
        /// Whether the failure stopped the engine.
        fatal: bool,
    },
    /// The engine was shut down before the job ran; nothing was copied.
    #[error("transfer engine shut down; job {id} not run")]
    Shutdown {
        /// The job's id.
        id: u64,
    },
    /// The engine stopped for good before the job ran, or while it ran (its bytes are not
    /// trusted even if the copy ended).
    #[error("transfer engine stopped: {reason}")]
    Stopped {
        /// Why the engine stopped.
        reason: String,
    },
    /// The device regions were detached before the job started: nothing was copied.
    #[error("KV caches unregistered (device regions detached); job {id} not run")]
    Detached {
        /// The job's id.
        id: u64,
    },
}

/// Why [`TransferEngine::wait_for`](super::TransferEngine::wait_for) could not collect every
/// completion.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// The copy thread exited without completing these jobs (it panicked, a bug in the
    /// engine itself); no copy runs any more.
    #[error(
        "the copy thread is gone; {waiting} job(s) never completed, first id {first}: {reason}"
    )]
    CopyThreadGone {
        /// How many awaited jobs had no completion.
        waiting: usize,
        /// One of them.
        first: u64,
        /// Why the thread is gone, as far as known.
        reason: String,
    },
}

/// Why [`TransferEngine::wait_ready`](super::TransferEngine::wait_ready) returned without the
/// engine being ready.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReadyError {
    /// The backend is still attaching (pinning) the host memory.
    #[error("transfer engine not ready after {timeout_ms} ms (host memory still being pinned)")]
    NotReady {
        /// The timeout.
        timeout_ms: u128,
    },
    /// The engine stopped (e.g. the attach failed) and will never be ready.
    #[error("transfer engine stopped: {reason}")]
    Stopped {
        /// Why.
        reason: String,
    },
}

/// Why [`TransferEngine::shutdown`](super::TransferEngine::shutdown) returned before the copy
/// thread exited.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "copy thread did not stop within {timeout_ms} ms ({unfinished} jobs unfinished); it keeps \
     the host memory and uses the regions until it exits"
)]
pub struct ShutdownError {
    /// The timeout.
    pub timeout_ms: u128,
    /// Jobs still being copied.
    pub unfinished: u64,
}

/// Why [`TransferEngine::cpu_block_slice`](super::TransferEngine::cpu_block_slice) refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockAccessError {
    /// A region index is out of range.
    #[error("region index {region} out of range: the engine has {count} regions")]
    NoSuchRegion {
        /// The offending index.
        region: usize,
        /// How many regions there are.
        count: usize,
    },
    /// The CPU block id is out of range.
    #[error("cpu block id {id} out of range: must be < {limit}")]
    InvalidBlock {
        /// The offending id.
        id: u32,
        /// The number of CPU blocks.
        limit: u32,
    },
    /// Jobs are in flight, so the copy thread may be touching host memory.
    #[error("{unfinished} job(s) in flight; host blocks are readable only when none are")]
    Busy {
        /// Jobs submitted and not completed.
        unfinished: u64,
    },
}
