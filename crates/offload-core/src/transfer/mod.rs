//! Worker-side transfer engine: moves KV blocks between device regions and host memory.
//!
//! The caller (one per worker rank) hands the engine one [`TransferJob`] per step and
//! direction. A single copy thread validates each job, coalesces its block pairs into
//! [`CopyRun`]s per region, submits them to a [`CopyBackend`], polls the backend until the
//! job is done and reports a [`Completion`]. The caller never blocks on a copy: `submit`
//! fails fast with [`TransferError::QueueFull`] when the queue is full, and
//! [`TransferEngine::poll_completions`] only drains what is ready.
//!
//! Host layout is region-major: one [`HostMemory`] of `num_cpu_blocks * cpu_block_bytes`
//! bytes, where region `r` owns the area starting at
//! `num_cpu_blocks * (sum of block_bytes of regions before r)` and CPU block `c` of region `r`
//! is at `area_r + c * block_bytes_r`. Consecutive CPU ids are therefore adjacent within a
//! region, so a run of consecutive `(device, cpu)` pairs is one copy per region whenever the
//! device region is contiguous.
//!
//! Completions are reported in submission order. A job that fails (bad id, backend error)
//! fails alone; a backend error marked fatal makes the engine sticky-failed, and every later
//! submit names the original fault.
//!
//! Backends: [`HostCopyBackend`] (memcpy; CPU-only servers and tests) and
//! [`CudaCopyBackend`] (the CUDA driver, loaded at run time; see [`cuda`]). The backend's
//! [`attach`](CopyBackend::attach) (e.g. pinning the host memory) runs on the copy thread, so
//! construction returns at once; [`TransferEngine::is_ready`] turns true when it finished,
//! and jobs submitted before that simply wait in the queue.

pub mod cuda;
mod cuda_sys;
pub mod fault;
mod host;
mod region;

use std::collections::{HashSet, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{
    bounded, select, unbounded, Receiver, RecvTimeoutError, Sender, TrySendError,
};

use crate::memory::{HostMemory, HostMemoryOptions, MemoryError};

pub use cuda::{BatchApi, CudaCopyBackend, CudaDriver, CudaError, CudaOptions};
pub use fault::{FaultInjector, FaultPlan, FaultSpecError};
pub use host::HostCopyBackend;
pub use region::{coalesce, CopyRun, RegionSpec};

use region::{emit_runs, group_consecutive, BlockRun};

/// Which way a job moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Device -> host (offload).
    Store,
    /// Host -> device (onload).
    Load,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Store => "store",
            Self::Load => "load",
        })
    }
}

/// Which id space a block id belongs to, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockSide {
    /// A device (GPU) block id, indexing every [`RegionSpec`].
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

/// One batch of block copies in one direction, identified by a caller-chosen id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferJob {
    /// Caller-chosen id, unique among jobs in flight; echoed in the [`Completion`].
    pub id: u64,
    /// Store (device -> host) or load (host -> device).
    pub direction: Direction,
    /// `(gpu block, cpu block)` pairs. Each pair copies that device block of every region
    /// to/from that CPU block. Keep them in block order: consecutive runs become one copy.
    pub pairs: Vec<(u32, u32)>,
    /// A device event (a `CUevent` / `cudaEvent_t` handle, e.g. PyTorch's
    /// `torch.cuda.Event.cuda_event`) that the copies must wait for: the backend orders them
    /// after the event's most recent record (see [`CopyBackend::wait_event`]). Stores pass an
    /// event recorded on the compute stream so they never read blocks still being written.
    /// The event must stay alive until the job's [`Completion`] arrives. `None`: no wait.
    pub wait_event: Option<u64>,
}

impl TransferJob {
    /// A job without a wait event.
    pub fn new(id: u64, direction: Direction, pairs: Vec<(u32, u32)>) -> Self {
        Self {
            id,
            direction,
            pairs,
            wait_event: None,
        }
    }

    /// The same job, ordered after `event` (see [`TransferJob::wait_event`]).
    pub fn with_wait_event(mut self, event: u64) -> Self {
        self.wait_event = Some(event);
        self
    }
}

/// The outcome of one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The job's id.
    pub id: u64,
    /// The job's direction.
    pub direction: Direction,
    /// `Ok` when every byte was copied; otherwise why not (nothing, or an unknown part of the
    /// job, was copied: treat every block of the job as not transferred).
    pub result: Result<(), TransferError>,
    /// Bytes moved: `pairs * cpu_block_bytes` on success, 0 on failure.
    pub bytes: u64,
}

/// An opaque handle for one submission to a [`CopyBackend`] (a stream event, for a device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);

/// A backend's failure, and whether the backend can still be used afterwards.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BackendError {
    message: String,
    fatal: bool,
}

impl BackendError {
    /// A failure of this submission only; later jobs are still submitted.
    pub fn job(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            fatal: false,
        }
    }

    /// A failure that leaves the backend unusable (e.g. a sticky CUDA context error): the
    /// engine fails every later job and submit with this message.
    pub fn fatal(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            fatal: true,
        }
    }

    /// The backend's description of the failure.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the backend is unusable from now on.
    pub fn is_fatal(&self) -> bool {
        self.fatal
    }
}

/// Moves bytes for the engine. Lives on the copy thread; called only from there.
///
/// A backend may be asynchronous: `submit` enqueues the copies (e.g. on a CUDA stream,
/// recording an event) and returns at once; the engine then calls `query` on outstanding
/// tickets, oldest first, until each reports done. A synchronous backend copies inside
/// `submit` and answers `true` to every `query`.
pub trait CopyBackend: Send + 'static {
    /// A short name for logs and error messages.
    fn name(&self) -> &'static str;

    /// Called once on the copy thread before the first `submit`, with the engine's host
    /// memory (e.g. to pin it for DMA). It must not read or write the memory's contents.
    /// An error here is fatal to the engine.
    fn attach(&mut self, host_base: u64, host_len: usize) -> Result<(), BackendError> {
        let _ = (host_base, host_len);
        Ok(())
    }

    /// Orders the next `submit`'s copies after `event`, a device event handle supplied by
    /// the caller ([`TransferJob::wait_event`]). Called right before that `submit`. A backend
    /// without device events refuses (the default), failing the job: silently ignoring the
    /// event could read blocks still being written.
    fn wait_event(&mut self, event: u64) -> Result<(), BackendError> {
        Err(BackendError::job(format!(
            "the {} backend cannot wait on device event {event:#x}",
            self.name()
        )))
    }

    /// A one-line description for logs (e.g. the driver version and copy path).
    fn describe(&self) -> String {
        self.name().to_owned()
    }

    /// Starts the copies of one job and returns a ticket to poll. The runs of one job never
    /// overlap each other's destinations.
    ///
    /// # Safety
    ///
    /// For every run, `src` must be valid for reads and `dst` valid for writes of `len` bytes
    /// (device or host memory per `direction`), source and destination must not overlap, and
    /// neither may be freed, nor the destination otherwise accessed, until `query` on the
    /// returned ticket has returned `Ok(true)` or an error.
    unsafe fn submit(
        &mut self,
        direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError>;

    /// Whether the ticket's copies are complete. After `Ok(true)` or an error the ticket is
    /// retired and is not queried again. Must not block for long: the engine polls.
    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError>;
}

/// Errors of the transfer engine. Every message names the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// A block id is outside its id space.
    #[error("{side} block id {id} out of range: must be < {limit}")]
    InvalidBlock {
        /// Device or CPU id.
        side: BlockSide,
        /// The offending id.
        id: u32,
        /// The exclusive upper bound (for device ids: the smallest region's `num_blocks`).
        limit: u32,
    },
    /// Two pairs of one job write the same destination block.
    #[error("{side} block id {id} is the destination of more than one pair in one job")]
    DuplicateDestination {
        /// Destination side: CPU for stores, device for loads.
        side: BlockSide,
        /// The repeated id.
        id: u32,
    },
    /// A job with this id is already in flight.
    #[error("job id {id} is already in flight")]
    DuplicateJobId {
        /// The repeated job id.
        id: u64,
    },
    /// The job queue is full; the job was not queued and nothing was copied.
    #[error("transfer queue full ({capacity} jobs queued); job {id} not queued")]
    QueueFull {
        /// The rejected job's id.
        id: u64,
        /// The queue's capacity.
        capacity: usize,
    },
    /// The engine was shut down before the job ran (or before it was submitted).
    #[error("transfer engine shut down; job {id} not run")]
    Shutdown {
        /// The job's id.
        id: u64,
    },
    /// The backend failed this job.
    #[error("{backend} backend failed: {message}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// The backend's message.
        message: String,
        /// Whether the failure made the engine sticky-failed.
        fatal: bool,
    },
    /// An earlier fatal fault made the engine unusable.
    #[error("transfer engine failed earlier and is unusable: {original}")]
    Fatal {
        /// The original fault's message.
        original: String,
    },
    /// A region's shape is invalid.
    #[error("invalid region: {reason}")]
    InvalidRegion {
        /// What is wrong, naming the value.
        reason: String,
    },
    /// A region index is out of range.
    #[error("region index {region} out of range: the engine has {count} regions")]
    NoSuchRegion {
        /// The offending index.
        region: usize,
        /// How many regions there are.
        count: usize,
    },
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
    /// `wait_for` ran out of time.
    #[error("timed out after {timeout_ms} ms waiting for {waiting} job(s), first id {first}")]
    Timeout {
        /// The timeout.
        timeout_ms: u128,
        /// How many of the awaited jobs had not completed.
        waiting: usize,
        /// One of them.
        first: u64,
    },
    /// The copy thread did not exit in time and was detached; it frees the host memory when
    /// it exits, and the regions must stay valid until then.
    #[error("copy thread did not stop within {timeout_ms} ms ({unfinished} jobs unfinished)")]
    ShutdownTimeout {
        /// The timeout.
        timeout_ms: u128,
        /// Jobs still being copied.
        unfinished: u64,
    },
    /// Host block bytes cannot be handed out while jobs are in flight.
    #[error("{unfinished} job(s) in flight; host blocks are readable only when none are")]
    Busy {
        /// Jobs submitted and not completed.
        unfinished: u64,
    },
    /// The CUDA driver could not be loaded or the CUDA backend could not be built.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// `wait_ready` ran out of time before the backend finished attaching (pinning).
    #[error("transfer engine not ready after {timeout_ms} ms (host memory still being pinned)")]
    NotReady {
        /// The timeout.
        timeout_ms: u128,
    },
}

/// Tunables of a [`TransferEngine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferConfig {
    /// Jobs that may wait for the copy thread before `submit` returns `QueueFull`.
    pub queue_capacity: usize,
    /// Jobs submitted to the backend and not yet complete before the copy thread stops
    /// taking new ones (bounds a device backend's outstanding events).
    pub max_in_flight: usize,
    /// How long the copy thread sleeps between polls of an asynchronous backend.
    pub poll_interval: Duration,
    /// How the host memory is allocated.
    pub memory: HostMemoryOptions,
    /// Faults to inject ([`TransferEngine::open`] wraps the backend when any is set).
    pub faults: FaultPlan,
}

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 1024,
            max_in_flight: 64,
            poll_interval: Duration::from_micros(50),
            memory: HostMemoryOptions::default(),
            faults: FaultPlan::default(),
        }
    }
}

/// Which backend [`TransferEngine::open`] builds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendKind {
    /// [`HostCopyBackend`]: both sides are host memory (CPU servers, tests).
    Host,
    /// [`CudaCopyBackend`] on the driver from [`CudaDriver::load`], with these options.
    Cuda(CudaOptions),
}

/// A snapshot of the engine's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Jobs accepted by `submit`.
    pub jobs_submitted: u64,
    /// Jobs completed successfully.
    pub jobs_succeeded: u64,
    /// Jobs completed with an error.
    pub jobs_failed: u64,
    /// Copy runs handed to the backend.
    pub runs_submitted: u64,
    /// CPU blocks written by successful stores.
    pub blocks_stored: u64,
    /// CPU blocks read by successful loads.
    pub blocks_loaded: u64,
    /// Bytes moved by successful stores.
    pub bytes_stored: u64,
    /// Bytes moved by successful loads.
    pub bytes_loaded: u64,
}

#[derive(Debug, Default)]
struct Counters {
    jobs_submitted: AtomicU64,
    jobs_succeeded: AtomicU64,
    jobs_failed: AtomicU64,
    runs_submitted: AtomicU64,
    blocks_stored: AtomicU64,
    blocks_loaded: AtomicU64,
    bytes_stored: AtomicU64,
    bytes_loaded: AtomicU64,
}

/// State shared by the engine handle and the copy thread.
#[derive(Debug, Default)]
struct Shared {
    /// The first fatal fault; once set, never cleared.
    fatal: OnceLock<String>,
    stopping: AtomicBool,
    /// Set once the backend's `attach` succeeded (host memory pinned); never cleared.
    ready: AtomicBool,
    /// Jobs accepted and not yet completed. The copy thread decrements it (Release) only
    /// after the backend is done with a job's memory, so observing 0 (Acquire) proves no copy
    /// touches host memory.
    unfinished: AtomicU64,
    counters: Counters,
}

impl Shared {
    fn set_fatal(&self, message: String) {
        if self.fatal.set(message.clone()).is_ok() {
            log::warn!("transfer engine is now failed: {message}");
        }
    }

    fn fatal_error(&self) -> Option<TransferError> {
        self.fatal.get().map(|original| TransferError::Fatal {
            original: original.clone(),
        })
    }
}

/// Immutable geometry of the engine.
#[derive(Debug)]
struct Layout {
    regions: Vec<RegionSpec>,
    /// Byte offset of each region's CPU area in host memory.
    cpu_offsets: Vec<usize>,
    num_cpu_blocks: u32,
    cpu_block_bytes: usize,
    /// The smallest region's `num_blocks`: device ids must be below it in every region.
    gpu_limit: u32,
}

impl Layout {
    fn new(regions: Vec<RegionSpec>, num_cpu_blocks: u32) -> Result<Self, TransferError> {
        let gpu_limit = regions
            .iter()
            .map(RegionSpec::num_blocks)
            .min()
            .ok_or_else(|| TransferError::InvalidConfig {
                field: "regions",
                value: "[]".into(),
                reason: "at least one region is required",
            })?;
        if num_cpu_blocks == 0 {
            return Err(TransferError::InvalidConfig {
                field: "num_cpu_blocks",
                value: "0".into(),
                reason: "must be > 0",
            });
        }
        let too_large = || TransferError::InvalidConfig {
            field: "num_cpu_blocks",
            value: num_cpu_blocks.to_string(),
            reason: "num_cpu_blocks * cpu_block_bytes overflows usize",
        };
        let mut cpu_offsets = Vec::with_capacity(regions.len());
        let mut offset = 0usize;
        for region in &regions {
            cpu_offsets.push(offset);
            let area = region
                .block_bytes()
                .checked_mul(num_cpu_blocks as usize)
                .ok_or_else(too_large)?;
            offset = offset.checked_add(area).ok_or_else(too_large)?;
        }
        let cpu_block_bytes = regions.iter().map(RegionSpec::block_bytes).sum();
        Ok(Self {
            regions,
            cpu_offsets,
            num_cpu_blocks,
            cpu_block_bytes,
            gpu_limit,
        })
    }

    fn host_len(&self) -> usize {
        // Cannot overflow: `new` checked every partial sum.
        self.cpu_block_bytes * self.num_cpu_blocks as usize
    }
}

/// Completions received from the copy thread but not yet handed to the caller, and the ids
/// of jobs whose completion has not been received yet.
#[derive(Debug, Default)]
struct Inbox {
    in_flight: HashSet<u64>,
    parked: VecDeque<Completion>,
}

impl Inbox {
    fn receive(&mut self, completion: Completion) {
        self.in_flight.remove(&completion.id);
        self.parked.push_back(completion);
    }
}

/// Moves KV blocks between device regions and its own host memory on one copy thread.
///
/// `TransferEngine` is `Send + Sync`: `submit`, `poll_completions` and `wait_for` take
/// `&self` and may be called from any thread.
#[derive(Debug)]
pub struct TransferEngine {
    layout: Arc<Layout>,
    memory: Arc<HostMemory>,
    shared: Arc<Shared>,
    jobs: Option<Sender<TransferJob>>,
    /// Dropped to wake the copy thread for shutdown; never sent on.
    stop: Option<Sender<()>>,
    /// Disconnects when the copy thread exits; lets shutdown wait with a timeout.
    exited: Receiver<()>,
    completions: Receiver<Completion>,
    inbox: Mutex<Inbox>,
    thread: Option<JoinHandle<()>>,
    queue_capacity: usize,
    backend_name: &'static str,
    backend_detail: String,
}

/// Used by `Drop`, which cannot be told a timeout.
const DROP_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one blocking receive in `wait_for` lasts before it re-checks completions parked
/// by a concurrent caller.
const WAIT_SLICE: Duration = Duration::from_millis(1);

impl TransferEngine {
    /// An engine over `regions` with `num_cpu_blocks` CPU blocks, copying with
    /// [`HostCopyBackend`] (both sides host memory).
    ///
    /// Safe because the regions' addresses were vouched for by [`RegionSpec::new`].
    pub fn new(
        regions: Vec<RegionSpec>,
        num_cpu_blocks: u32,
        config: TransferConfig,
    ) -> Result<Self, TransferError> {
        Self::with_backend(regions, num_cpu_blocks, config, HostCopyBackend::new())
    }

    /// An engine with the backend `kind` names. For CUDA this loads the driver and checks the
    /// device now (a missing or old driver fails here, as [`TransferError::Cuda`]); pinning
    /// happens on the copy thread afterwards (see [`is_ready`](Self::is_ready)).
    pub fn open(
        regions: Vec<RegionSpec>,
        num_cpu_blocks: u32,
        config: TransferConfig,
        kind: BackendKind,
    ) -> Result<Self, TransferError> {
        let faults = config.faults;
        match kind {
            BackendKind::Host if faults.is_active() => {
                let backend = FaultInjector::new(HostCopyBackend::new(), faults);
                Self::with_backend(regions, num_cpu_blocks, config, backend)
            }
            BackendKind::Host => Self::new(regions, num_cpu_blocks, config),
            BackendKind::Cuda(options) => {
                let backend = CudaCopyBackend::open(options)?;
                if faults.is_active() {
                    let backend = FaultInjector::new(backend, faults);
                    Self::with_backend(regions, num_cpu_blocks, config, backend)
                } else {
                    Self::with_backend(regions, num_cpu_blocks, config, backend)
                }
            }
        }
    }

    /// An engine with a custom backend, which moves to the copy thread.
    pub fn with_backend<B: CopyBackend>(
        regions: Vec<RegionSpec>,
        num_cpu_blocks: u32,
        config: TransferConfig,
        backend: B,
    ) -> Result<Self, TransferError> {
        if config.queue_capacity == 0 {
            return Err(TransferError::InvalidConfig {
                field: "queue_capacity",
                value: "0".into(),
                reason: "must be > 0",
            });
        }
        if config.max_in_flight == 0 {
            return Err(TransferError::InvalidConfig {
                field: "max_in_flight",
                value: "0".into(),
                reason: "must be > 0",
            });
        }
        let layout = Arc::new(Layout::new(regions, num_cpu_blocks)?);
        let memory = Arc::new(HostMemory::with_options(layout.host_len(), &config.memory)?);
        let shared = Arc::new(Shared::default());
        let (jobs_tx, jobs_rx) = bounded(config.queue_capacity);
        let (stop_tx, stop_rx) = bounded(1);
        let (exited_tx, exited_rx) = bounded(1);
        let (done_tx, done_rx) = unbounded();
        let backend_name = backend.name();
        let backend_detail = backend.describe();
        let id_bits = (layout.num_cpu_blocks.max(layout.gpu_limit) as usize).div_ceil(64);
        let worker = Worker {
            backend,
            host_base: memory.as_mut_ptr() as u64,
            layout: Arc::clone(&layout),
            memory: Arc::clone(&memory),
            shared: Arc::clone(&shared),
            jobs: jobs_rx,
            stop: stop_rx,
            completions: done_tx,
            outstanding: VecDeque::new(),
            seen: vec![0; id_bits],
            groups: Vec::new(),
            runs: Vec::new(),
            max_in_flight: config.max_in_flight,
            poll_interval: config.poll_interval,
            _exited: exited_tx,
        };
        let thread = std::thread::Builder::new()
            .name("kvoffload-copy".into())
            .spawn(move || worker.run())
            .map_err(|e| TransferError::ThreadSpawn {
                message: e.to_string(),
            })?;
        log::debug!(
            "transfer engine started: {} regions, {} cpu blocks of {} bytes ({} bytes host), \
             backend {backend_detail}",
            layout.regions.len(),
            layout.num_cpu_blocks,
            layout.cpu_block_bytes,
            layout.host_len()
        );
        Ok(Self {
            layout,
            memory,
            shared,
            jobs: Some(jobs_tx),
            stop: Some(stop_tx),
            exited: exited_rx,
            completions: done_rx,
            inbox: Mutex::new(Inbox::default()),
            thread: Some(thread),
            queue_capacity: config.queue_capacity,
            backend_name,
            backend_detail,
        })
    }

    /// Queues a job without blocking. On error the job was not queued and nothing of it will
    /// be copied or completed. An accepted job always gets exactly one [`Completion`], even
    /// when it is invalid (validation happens on the copy thread).
    pub fn submit(&self, job: TransferJob) -> Result<(), TransferError> {
        if let Some(err) = self.shared.fatal_error() {
            return Err(err);
        }
        let id = job.id;
        let Some(jobs) = self.jobs.as_ref() else {
            return Err(TransferError::Shutdown { id });
        };
        if !self.lock_inbox().in_flight.insert(id) {
            return Err(TransferError::DuplicateJobId { id });
        }
        self.shared.unfinished.fetch_add(1, Ordering::AcqRel);
        let refused = match jobs.try_send(job) {
            Ok(()) => {
                self.shared
                    .counters
                    .jobs_submitted
                    .fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            Err(TrySendError::Full(_)) => TransferError::QueueFull {
                id,
                capacity: self.queue_capacity,
            },
            Err(TrySendError::Disconnected(_)) => self
                .shared
                .fatal_error()
                .unwrap_or(TransferError::Shutdown { id }),
        };
        self.lock_inbox().in_flight.remove(&id);
        self.shared.unfinished.fetch_sub(1, Ordering::AcqRel);
        Err(refused)
    }

    /// Appends every completion received so far to `out`, without blocking.
    pub fn poll_completions(&self, out: &mut Vec<Completion>) {
        let mut inbox = self.lock_inbox();
        out.extend(inbox.parked.drain(..));
        while let Ok(completion) = self.completions.try_recv() {
            inbox.in_flight.remove(&completion.id);
            out.push(completion);
        }
    }

    /// Blocks until every job in `ids` has completed, and returns their completions (in
    /// completion order). Completions of other jobs received meanwhile stay available to
    /// [`poll_completions`](Self::poll_completions).
    ///
    /// An id that is not in flight (never submitted, or its completion was already returned)
    /// counts as complete and contributes nothing to the result: this is a fence, not a
    /// lookup. On timeout nothing is consumed: completions found so far are returned to the
    /// queue for `poll_completions`.
    pub fn wait_for(
        &self,
        ids: &[u64],
        timeout: Duration,
    ) -> Result<Vec<Completion>, TransferError> {
        // `None`: the timeout is too long to represent, i.e. wait forever.
        let deadline = Instant::now().checked_add(timeout);
        let mut waiting: Vec<u64> = ids.to_vec();
        waiting.sort_unstable();
        waiting.dedup();
        let mut found = Vec::new();
        loop {
            {
                let mut inbox = self.lock_inbox();
                while let Ok(completion) = self.completions.try_recv() {
                    inbox.receive(completion);
                }
                let parked = std::mem::take(&mut inbox.parked);
                for completion in parked {
                    if waiting.binary_search(&completion.id).is_ok() {
                        found.push(completion);
                    } else {
                        inbox.parked.push_back(completion);
                    }
                }
                waiting.retain(|id| inbox.in_flight.contains(id));
                if waiting.is_empty() {
                    return Ok(found);
                }
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let failure = if left == Some(Duration::ZERO) {
                Some(TransferError::Timeout {
                    timeout_ms: timeout.as_millis(),
                    waiting: waiting.len(),
                    first: waiting[0],
                })
            } else {
                match self
                    .completions
                    .recv_timeout(left.map_or(WAIT_SLICE, |l| l.min(WAIT_SLICE)))
                {
                    Ok(completion) => {
                        self.lock_inbox().receive(completion);
                        None
                    }
                    Err(RecvTimeoutError::Timeout) => None,
                    // The copy thread is gone without completing these jobs: only a panic
                    // in the engine itself does that.
                    Err(RecvTimeoutError::Disconnected) => Some(
                        self.shared
                            .fatal_error()
                            .unwrap_or(TransferError::Shutdown { id: waiting[0] }),
                    ),
                }
            };
            if let Some(err) = failure {
                let mut inbox = self.lock_inbox();
                for completion in found.into_iter().rev() {
                    inbox.parked.push_front(completion);
                }
                return Err(err);
            }
        }
    }

    /// Stops the copy thread: jobs still queued complete with [`TransferError::Shutdown`],
    /// jobs already handed to the backend are waited for. Returns once the thread has exited,
    /// or with [`TransferError::ShutdownTimeout`] after `timeout`, in which case the thread is
    /// detached and keeps the host memory (and its use of the regions) alive until it exits.
    /// Idempotent. Completions remain available to `poll_completions` afterwards.
    pub fn shutdown(&mut self, timeout: Duration) -> Result<(), TransferError> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        self.shared.stopping.store(true, Ordering::Release);
        self.stop = None;
        self.jobs = None;
        match self.exited.recv_timeout(timeout) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                if thread.join().is_err() {
                    log::warn!("copy thread panicked before shutdown");
                }
                log::debug!("transfer engine shut down");
                Ok(())
            }
            Err(RecvTimeoutError::Timeout) => {
                let unfinished = self.shared.unfinished.load(Ordering::Acquire);
                log::warn!(
                    "copy thread did not stop within {timeout:?} ({unfinished} jobs \
                     unfinished); detaching it"
                );
                Err(TransferError::ShutdownTimeout {
                    timeout_ms: timeout.as_millis(),
                    unfinished,
                })
            }
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> TransferStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TransferStats {
            jobs_submitted: get(&c.jobs_submitted),
            jobs_succeeded: get(&c.jobs_succeeded),
            jobs_failed: get(&c.jobs_failed),
            runs_submitted: get(&c.runs_submitted),
            blocks_stored: get(&c.blocks_stored),
            blocks_loaded: get(&c.blocks_loaded),
            bytes_stored: get(&c.bytes_stored),
            bytes_loaded: get(&c.bytes_loaded),
        }
    }

    /// Bytes of one CPU block across all regions (the sum of their `block_bytes`).
    pub fn cpu_block_bytes(&self) -> usize {
        self.layout.cpu_block_bytes
    }

    /// Number of CPU blocks; valid CPU ids are `0..num_cpu_blocks`.
    pub fn num_cpu_blocks(&self) -> u32 {
        self.layout.num_cpu_blocks
    }

    /// Exclusive bound on device block ids (the smallest region's `num_blocks`).
    pub fn num_gpu_blocks(&self) -> u32 {
        self.layout.gpu_limit
    }

    /// The regions, in the order given at construction.
    pub fn regions(&self) -> &[RegionSpec] {
        &self.layout.regions
    }

    /// Bytes of host memory owned by the engine.
    pub fn host_bytes(&self) -> usize {
        self.memory.len()
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.backend_name
    }

    /// The backend's description ([`CopyBackend::describe`]), e.g. the CUDA copy path.
    pub fn backend_detail(&self) -> &str {
        &self.backend_detail
    }

    /// Whether the backend finished attaching the host memory (for CUDA: pinned it). Jobs
    /// submitted earlier wait in the queue; a server may report itself not ready meanwhile.
    /// Stays `false` forever if the attach failed ([`fatal_error`](Self::fatal_error) says
    /// why).
    pub fn is_ready(&self) -> bool {
        self.shared.ready.load(Ordering::Acquire)
    }

    /// Blocks until [`is_ready`](Self::is_ready), the attach failed (returns the fatal
    /// error), or `timeout` passed ([`TransferError::NotReady`]).
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), TransferError> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if self.is_ready() {
                return Ok(());
            }
            if let Some(err) = self.shared.fatal_error() {
                return Err(err);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(TransferError::NotReady {
                    timeout_ms: timeout.as_millis(),
                });
            }
            std::thread::sleep(WAIT_SLICE);
        }
    }

    /// The first fatal fault, if the engine is sticky-failed.
    pub fn fatal_error(&self) -> Option<&str> {
        self.shared.fatal.get().map(String::as_str)
    }

    /// The bytes of CPU block `cpu_id` of region `region`, for tests and debugging.
    ///
    /// `&mut self` keeps new jobs from being submitted while the slice lives, and the call
    /// fails with [`TransferError::Busy`] while any job is in flight, so the copy thread
    /// cannot be touching the bytes.
    pub fn cpu_block_slice(&mut self, region: usize, cpu_id: u32) -> Result<&[u8], TransferError> {
        let (ptr, len) = self.idle_block(region, cpu_id)?;
        // SAFETY: `idle_block` checked the block lies inside our mapping and that no job is in
        // flight; `&mut self` prevents new ones until the borrow ends.
        Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
    }

    /// Mutable access to the bytes of CPU block `cpu_id` of region `region`, for tests and
    /// debugging. Same conditions as [`cpu_block_slice`](Self::cpu_block_slice).
    pub fn cpu_block_slice_mut(
        &mut self,
        region: usize,
        cpu_id: u32,
    ) -> Result<&mut [u8], TransferError> {
        let (ptr, len) = self.idle_block(region, cpu_id)?;
        // SAFETY: as in `cpu_block_slice`; `&mut self` also makes this the only slice.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    fn idle_block(&self, region: usize, cpu_id: u32) -> Result<(*mut u8, usize), TransferError> {
        let layout = &self.layout;
        let spec = layout
            .regions
            .get(region)
            .ok_or(TransferError::NoSuchRegion {
                region,
                count: layout.regions.len(),
            })?;
        if cpu_id >= layout.num_cpu_blocks {
            return Err(TransferError::InvalidBlock {
                side: BlockSide::Cpu,
                id: cpu_id,
                limit: layout.num_cpu_blocks,
            });
        }
        let unfinished = self.shared.unfinished.load(Ordering::Acquire);
        if unfinished != 0 {
            return Err(TransferError::Busy { unfinished });
        }
        let offset = layout.cpu_offsets[region] + cpu_id as usize * spec.block_bytes();
        // SAFETY: `offset + block_bytes <= host_len` by the layout's construction, so the
        // pointer stays inside the mapping.
        let ptr = unsafe { self.memory.as_mut_ptr().add(offset) };
        Ok((ptr, spec.block_bytes()))
    }

    fn lock_inbox(&self) -> MutexGuard<'_, Inbox> {
        // The inbox holds plain data that every critical section leaves consistent, so a
        // panic elsewhere while holding it does not corrupt it.
        self.inbox.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        if let Err(err) = self.shutdown(DROP_SHUTDOWN_TIMEOUT) {
            log::warn!("transfer engine dropped uncleanly: {err}");
        }
    }
}

/// A job handed to the backend (or already finished) whose completion is not yet sent.
#[derive(Debug)]
struct Pending {
    id: u64,
    direction: Direction,
    blocks: u64,
    bytes: u64,
    state: PendingState,
}

#[derive(Debug)]
enum PendingState {
    Submitted(Ticket),
    Finished(Result<(), TransferError>),
}

enum Next {
    Job(TransferJob),
    Idle,
    Stop,
}

/// The copy thread's state. Owns the backend; keeps the host memory alive while it runs.
struct Worker<B> {
    backend: B,
    host_base: u64,
    layout: Arc<Layout>,
    /// Held so a detached thread never outlives the memory it copies into.
    memory: Arc<HostMemory>,
    shared: Arc<Shared>,
    jobs: Receiver<TransferJob>,
    stop: Receiver<()>,
    completions: Sender<Completion>,
    /// In submission order; completions leave from the front only.
    outstanding: VecDeque<Pending>,
    /// Scratch bitset over block ids for duplicate-destination checks; all zero between jobs.
    seen: Vec<u64>,
    groups: Vec<BlockRun>,
    runs: Vec<CopyRun>,
    max_in_flight: usize,
    poll_interval: Duration,
    /// Dropped when the thread exits, panicking or not.
    _exited: Sender<()>,
}

impl<B: CopyBackend> Worker<B> {
    fn run(mut self) {
        let _guard = PanicGuard(Arc::clone(&self.shared));
        match self.guarded(|b, host| b.attach(host.0, host.1)) {
            Ok(()) => self.shared.ready.store(true, Ordering::Release),
            Err(err) => self.shared.set_fatal(format!(
                "{} backend failed to attach host memory: {}",
                self.backend.name(),
                err.message()
            )),
        }
        loop {
            self.poll_outstanding();
            match self.next() {
                Next::Job(job) => self.start(job),
                Next::Idle => {}
                Next::Stop => break,
            }
        }
        // Jobs queued behind the stop request are not started: shutdown must be bounded.
        // They queue behind the outstanding ones so completions keep submission order.
        while let Ok(job) = self.jobs.try_recv() {
            let id = job.id;
            self.push_finished(&job, Err(TransferError::Shutdown { id }));
        }
        // Jobs already with the backend must finish before the memory can be released.
        loop {
            self.poll_outstanding();
            if self.outstanding.is_empty() {
                break;
            }
            std::thread::sleep(self.poll_interval);
        }
        log::debug!("copy thread exiting");
    }

    fn next(&mut self) -> Next {
        if self.shared.stopping.load(Ordering::Acquire) {
            return Next::Stop;
        }
        if self.outstanding.len() >= self.max_in_flight {
            return match self.stop.recv_timeout(self.poll_interval) {
                Err(RecvTimeoutError::Timeout) => Next::Idle,
                Ok(()) | Err(RecvTimeoutError::Disconnected) => Next::Stop,
            };
        }
        // Block only when nothing is outstanding; otherwise wake up to poll the backend.
        let next = if self.outstanding.is_empty() {
            select! {
                recv(self.jobs) -> job => job.ok(),
                recv(self.stop) -> _ => None,
            }
        } else {
            select! {
                recv(self.jobs) -> job => job.ok(),
                recv(self.stop) -> _ => None,
                default(self.poll_interval) => return Next::Idle,
            }
        };
        match next {
            // Both channels may be ready at once; a stop request wins so that queued jobs
            // are not started after shutdown began.
            Some(job) if self.shared.stopping.load(Ordering::Acquire) => {
                let id = job.id;
                self.push_finished(&job, Err(TransferError::Shutdown { id }));
                Next::Stop
            }
            Some(job) => Next::Job(job),
            None => Next::Stop,
        }
    }

    fn start(&mut self, job: TransferJob) {
        if let Some(err) = self.shared.fatal_error() {
            self.push_finished(&job, Err(err));
            return;
        }
        if let Err(err) = validate(&self.layout, &job, &mut self.seen) {
            log::debug!("job {} rejected: {err}", job.id);
            self.push_finished(&job, Err(err));
            return;
        }
        if job.pairs.is_empty() {
            self.push_finished(&job, Ok(()));
            return;
        }
        self.groups.clear();
        self.runs.clear();
        group_consecutive(&job.pairs, &mut self.groups);
        for (region, offset) in self.layout.regions.iter().zip(&self.layout.cpu_offsets) {
            let area = self.host_base + *offset as u64;
            emit_runs(region, area, job.direction, &self.groups, &mut self.runs);
        }
        if let Some(event) = job.wait_event {
            if let Err(err) = self.guarded(|backend, _| backend.wait_event(event)) {
                let err = self.backend_failure(err);
                self.push_finished(&job, Err(err));
                return;
            }
        }
        let runs = std::mem::take(&mut self.runs);
        let direction = job.direction;
        let submitted = self.guarded(|backend, _| {
            // SAFETY: every run was computed from a validated job: device ids are below every
            // region's `num_blocks`, so device ranges lie in regions that `RegionSpec::new`'s
            // caller vouched for; CPU ids are below `num_cpu_blocks`, so host ranges lie in
            // our mapping, which `memory` keeps alive. Destinations are distinct blocks
            // (duplicates were rejected) and host memory cannot overlap the regions (their
            // contract). The job stays in `outstanding`, and `unfinished` stays non-zero,
            // until `query` reports it done, so no one else touches the host blocks.
            unsafe { backend.submit(direction, &runs) }
        });
        let run_count = runs.len() as u64;
        self.runs = runs;
        match submitted {
            Ok(ticket) => {
                self.shared
                    .counters
                    .runs_submitted
                    .fetch_add(run_count, Ordering::Relaxed);
                self.push(&job, PendingState::Submitted(ticket));
            }
            Err(err) => {
                let err = self.backend_failure(err);
                self.push_finished(&job, Err(err));
            }
        }
    }

    /// Sends completions for outstanding jobs that are done, oldest first, stopping at the
    /// first one still running so that completions keep submission order.
    fn poll_outstanding(&mut self) {
        while let Some(front) = self.outstanding.front_mut() {
            let result = match &mut front.state {
                PendingState::Finished(result) => std::mem::replace(result, Ok(())),
                PendingState::Submitted(ticket) => {
                    let ticket = *ticket;
                    match self.guarded(|backend, _| backend.query(ticket)) {
                        Ok(true) => Ok(()),
                        Ok(false) => return,
                        Err(err) => Err(self.backend_failure(err)),
                    }
                }
            };
            if let Some(pending) = self.outstanding.pop_front() {
                self.complete(pending, result);
            }
        }
    }

    /// Runs a backend call, turning a panic into a fatal error: the copy thread must survive
    /// a buggy backend so that every job still gets a completion.
    fn guarded<T>(
        &mut self,
        call: impl FnOnce(&mut B, (u64, usize)) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let host = (self.host_base, self.memory.len());
        let backend = &mut self.backend;
        catch_unwind(AssertUnwindSafe(|| call(backend, host))).unwrap_or_else(|payload| {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic".into());
            Err(BackendError::fatal(format!("backend panicked: {what}")))
        })
    }

    fn backend_failure(&self, err: BackendError) -> TransferError {
        let backend = self.backend.name();
        if err.is_fatal() {
            self.shared
                .set_fatal(format!("{backend} backend failed: {}", err.message()));
        }
        TransferError::Backend {
            backend,
            message: err.message,
            fatal: err.fatal,
        }
    }

    fn push(&mut self, job: &TransferJob, state: PendingState) {
        let blocks = job.pairs.len() as u64;
        self.outstanding.push_back(Pending {
            id: job.id,
            direction: job.direction,
            blocks,
            bytes: blocks * self.layout.cpu_block_bytes as u64,
            state,
        });
    }

    /// Queues an already-decided outcome behind the outstanding jobs, keeping order.
    fn push_finished(&mut self, job: &TransferJob, result: Result<(), TransferError>) {
        self.push(job, PendingState::Finished(result));
    }

    fn complete(&self, pending: Pending, result: Result<(), TransferError>) {
        let c = &self.shared.counters;
        let bytes = if result.is_ok() {
            c.jobs_succeeded.fetch_add(1, Ordering::Relaxed);
            let (blocks_ctr, bytes_ctr) = match pending.direction {
                Direction::Store => (&c.blocks_stored, &c.bytes_stored),
                Direction::Load => (&c.blocks_loaded, &c.bytes_loaded),
            };
            blocks_ctr.fetch_add(pending.blocks, Ordering::Relaxed);
            bytes_ctr.fetch_add(pending.bytes, Ordering::Relaxed);
            pending.bytes
        } else {
            c.jobs_failed.fetch_add(1, Ordering::Relaxed);
            0
        };
        // Release: the backend is done with this job's memory before anyone can see the
        // count drop (see `Shared::unfinished`), and before the completion is visible.
        self.shared.unfinished.fetch_sub(1, Ordering::AcqRel);
        // The receiver is gone only if the engine was dropped after a shutdown timeout;
        // nobody is left to tell.
        let _ = self.completions.send(Completion {
            id: pending.id,
            direction: pending.direction,
            result,
            bytes,
        });
    }
}

impl<B> std::fmt::Debug for Worker<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("outstanding", &self.outstanding.len())
            .finish_non_exhaustive()
    }
}

/// Marks the engine failed if the copy thread dies by panicking (a bug in the engine itself,
/// since backend panics are caught), so callers get an error instead of waiting forever.
#[derive(Debug)]
struct PanicGuard(Arc<Shared>);

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.set_fatal("copy thread panicked".into());
        }
    }
}

/// Checks every id of `job` before anything is copied, so an invalid job copies nothing.
/// `seen` is a bitset over ids, all zero on entry and on return.
fn validate(layout: &Layout, job: &TransferJob, seen: &mut [u64]) -> Result<(), TransferError> {
    for &(gpu, cpu) in &job.pairs {
        if gpu >= layout.gpu_limit {
            return Err(TransferError::InvalidBlock {
                side: BlockSide::Gpu,
                id: gpu,
                limit: layout.gpu_limit,
            });
        }
        if cpu >= layout.num_cpu_blocks {
            return Err(TransferError::InvalidBlock {
                side: BlockSide::Cpu,
                id: cpu,
                limit: layout.num_cpu_blocks,
            });
        }
    }
    // Two reads of one block are fine; two writes to one block would race on a device and
    // mean a planner bug on any backend.
    let side = match job.direction {
        Direction::Store => BlockSide::Cpu,
        Direction::Load => BlockSide::Gpu,
    };
    let destination = |&(gpu, cpu): &(u32, u32)| match side {
        BlockSide::Cpu => cpu,
        BlockSide::Gpu => gpu,
    };
    let mut duplicate = None;
    for pair in &job.pairs {
        let id = destination(pair) as usize;
        let (word, bit) = (id / 64, 1u64 << (id % 64));
        if seen[word] & bit != 0 {
            duplicate = Some(id as u32);
            break;
        }
        seen[word] |= bit;
    }
    for pair in &job.pairs {
        let id = destination(pair) as usize;
        seen[id / 64] = 0;
    }
    match duplicate {
        Some(id) => Err(TransferError::DuplicateDestination { side, id }),
        None => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const WAIT: Duration = Duration::from_secs(10);

    /// Stand-in for device memory: a heap buffer touched only through its raw pointer, so
    /// the copy thread's writes never alias a live Rust reference. Must outlive the engine
    /// (declare it first).
    struct FakeGpu {
        ptr: *mut u8,
        len: usize,
    }

    impl FakeGpu {
        fn new(len: usize) -> Self {
            let ptr = Box::into_raw(vec![0u8; len].into_boxed_slice()).cast::<u8>();
            Self { ptr, len }
        }

        /// Only while no job touching this buffer is in flight.
        fn bytes(&self) -> &[u8] {
            // SAFETY: `ptr` owns `len` bytes; tests call this only when the engine is idle.
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }

        /// Only while no job touching this buffer is in flight.
        #[allow(clippy::mut_from_ref)]
        fn bytes_mut(&self) -> &mut [u8] {
            // SAFETY: as in `bytes`, and tests hold no other slice of it meanwhile.
            unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
        }

        fn region(&self, num_blocks: u32, bytes: usize, stride: usize) -> RegionSpec {
            assert!((num_blocks as usize - 1) * stride + bytes <= self.len);
            // SAFETY: the region lies inside this live buffer, which outlives the engine, and
            // tests access it only while no job is in flight.
            unsafe { RegionSpec::new(self.ptr as u64, num_blocks, bytes, stride) }.unwrap()
        }

        fn block(&self, spec: &RegionSpec, id: u32) -> &[u8] {
            let start = id as usize * spec.block_stride();
            &self.bytes()[start..start + spec.block_bytes()]
        }
    }

    impl Drop for FakeGpu {
        fn drop(&mut self) {
            // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of this length.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
        }
    }

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            // xorshift64*: deterministic and dependency-free.
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: u32) -> u32 {
            (self.next() % u64::from(n)) as u32
        }

        fn fill(&mut self, buf: &mut [u8]) {
            for b in buf {
                *b = self.next() as u8;
            }
        }
    }

    fn config() -> TransferConfig {
        TransferConfig {
            memory: HostMemoryOptions {
                first_touch: false,
                ..HostMemoryOptions::default()
            },
            ..TransferConfig::default()
        }
    }

    fn job(id: u64, direction: Direction, pairs: &[(u32, u32)]) -> TransferJob {
        TransferJob::new(id, direction, pairs.to_vec())
    }

    fn run_one(engine: &TransferEngine, job: TransferJob) -> Completion {
        let id = job.id;
        engine.submit(job).unwrap();
        let mut done = engine.wait_for(&[id], WAIT).unwrap();
        assert_eq!(done.len(), 1);
        done.remove(0)
    }

    fn drain(engine: &TransferEngine, n: usize) -> Vec<Completion> {
        let deadline = Instant::now() + WAIT;
        let mut out = Vec::new();
        while out.len() < n {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} completions",
                out.len()
            );
            engine.poll_completions(&mut out);
            std::thread::sleep(Duration::from_millis(1));
        }
        out
    }

    #[test]
    fn engine_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<TransferEngine>();
    }

    #[test]
    fn round_trip_through_contiguous_and_strided_regions() {
        let gpu_blocks = 32;
        let bufs = [
            FakeGpu::new(32 * 64),
            FakeGpu::new(31 * 80 + 48),
            FakeGpu::new(32 * 16),
        ];
        let specs = [
            bufs[0].region(gpu_blocks, 64, 64),
            bufs[1].region(gpu_blocks, 48, 80),
            bufs[2].region(gpu_blocks, 16, 16),
        ];
        let mut rng = Rng(7);
        for buf in &bufs {
            rng.fill(buf.bytes_mut());
        }
        let originals: Vec<Vec<u8>> = bufs.iter().map(|b| b.bytes().to_vec()).collect();
        let mut engine = TransferEngine::new(specs.to_vec(), 40, config()).unwrap();
        assert_eq!(engine.cpu_block_bytes(), 64 + 48 + 16);
        assert_eq!(engine.host_bytes(), 40 * (64 + 48 + 16));

        let stored = [(0, 5), (1, 6), (2, 7), (10, 0), (20, 39), (21, 38), (31, 1)];
        let done = run_one(&engine, job(1, Direction::Store, &stored));
        assert_eq!(done.result, Ok(()));
        assert_eq!(done.bytes, 7 * 128);
        for (r, (spec, buf)) in specs.iter().zip(&bufs).enumerate() {
            for &(g, c) in &stored {
                assert_eq!(engine.cpu_block_slice(r, c).unwrap(), buf.block(spec, g));
            }
        }

        for buf in &bufs {
            buf.bytes_mut().fill(0);
        }
        let moved = |g: u32| (g + 1) % gpu_blocks;
        let loads: Vec<(u32, u32)> = stored.iter().map(|&(g, c)| (moved(g), c)).collect();
        let done = run_one(&engine, job(2, Direction::Load, &loads));
        assert_eq!(done.result, Ok(()));
        for (r, (spec, buf)) in specs.iter().zip(&bufs).enumerate() {
            // Whole-buffer comparison: loaded blocks hold the originals, and everything else,
            // the strided region's gaps included, is untouched.
            let mut expected = vec![0u8; buf.len];
            for &(g, _) in &stored {
                let (src, dst) = (
                    g as usize * spec.block_stride(),
                    moved(g) as usize * spec.block_stride(),
                );
                expected[dst..dst + spec.block_bytes()]
                    .copy_from_slice(&originals[r][src..src + spec.block_bytes()]);
            }
            assert_eq!(buf.bytes(), &expected[..], "region {r}");
        }

        let stats = engine.stats();
        assert_eq!(stats.jobs_submitted, 2);
        assert_eq!(stats.jobs_succeeded, 2);
        assert_eq!(stats.blocks_stored, 7);
        assert_eq!(stats.blocks_loaded, 7);
        assert_eq!(stats.bytes_stored, 7 * 128);
        assert_eq!(stats.bytes_loaded, 7 * 128);
        // Store: runs {0-2}, {10}, {20}, {21}, {31} = 5 per contiguous region, 7 strided.
        // Load: {1-3}, {11}, {21}, {22}, {0} = 5, 5, 7 again.
        assert_eq!(stats.runs_submitted, 2 * (5 + 7 + 5));
    }

    #[test]
    fn completions_arrive_in_submission_order() {
        let buf = FakeGpu::new(16 * 8);
        let engine = TransferEngine::new(vec![buf.region(16, 8, 8)], 16, config()).unwrap();
        for id in 0..20u64 {
            let pairs = [((id % 16) as u32, ((id * 3) % 16) as u32)];
            let direction = if id % 2 == 0 {
                Direction::Store
            } else {
                Direction::Load
            };
            engine.submit(job(id, direction, &pairs)).unwrap();
        }
        let done = drain(&engine, 20);
        assert_eq!(
            done.iter().map(|c| c.id).collect::<Vec<_>>(),
            (0..20).collect::<Vec<_>>()
        );
        assert!(done.iter().all(|c| c.result.is_ok() && c.bytes == 8));
        let mut more = Vec::new();
        engine.poll_completions(&mut more);
        assert!(more.is_empty());
    }

    #[test]
    fn wait_for_returns_its_jobs_and_keeps_the_others() {
        let buf = FakeGpu::new(16 * 8);
        let engine = TransferEngine::new(vec![buf.region(16, 8, 8)], 16, config()).unwrap();
        for id in 1..=5u64 {
            engine
                .submit(job(id, Direction::Store, &[(id as u32, id as u32)]))
                .unwrap();
        }
        let mut got = engine.wait_for(&[4, 2, 2], WAIT).unwrap();
        got.sort_by_key(|c| c.id);
        assert_eq!(got.iter().map(|c| c.id).collect::<Vec<_>>(), [2, 4]);
        let rest = drain(&engine, 3);
        assert_eq!(rest.iter().map(|c| c.id).collect::<Vec<_>>(), [1, 3, 5]);
        // Already-reported and never-submitted ids are fenced trivially.
        assert_eq!(
            engine.wait_for(&[1, 2, 99], Duration::ZERO).unwrap(),
            vec![]
        );
    }

    #[test]
    fn invalid_jobs_fail_whole_and_copy_nothing() {
        let buf = FakeGpu::new(8 * 4);
        buf.bytes_mut().fill(0xEE);
        let mut engine = TransferEngine::new(vec![buf.region(8, 4, 4)], 6, config()).unwrap();
        type Case = (Direction, &'static [(u32, u32)], TransferError);
        let cases: [Case; 4] = [
            (
                Direction::Store,
                &[(0, 0), (8, 1)],
                TransferError::InvalidBlock {
                    side: BlockSide::Gpu,
                    id: 8,
                    limit: 8,
                },
            ),
            (
                Direction::Store,
                &[(0, 0), (1, 6)],
                TransferError::InvalidBlock {
                    side: BlockSide::Cpu,
                    id: 6,
                    limit: 6,
                },
            ),
            (
                Direction::Store,
                &[(0, 0), (1, 2), (2, 2)],
                TransferError::DuplicateDestination {
                    side: BlockSide::Cpu,
                    id: 2,
                },
            ),
            (
                Direction::Load,
                &[(3, 0), (4, 1), (3, 2)],
                TransferError::DuplicateDestination {
                    side: BlockSide::Gpu,
                    id: 3,
                },
            ),
        ];
        for (i, (direction, pairs, expected)) in cases.into_iter().enumerate() {
            let done = run_one(&engine, job(i as u64, direction, pairs));
            assert_eq!(done.bytes, 0);
            let err = done.result.unwrap_err();
            let named = match &expected {
                TransferError::InvalidBlock { id, .. }
                | TransferError::DuplicateDestination { id, .. } => id.to_string(),
                _ => unreachable!(),
            };
            assert!(err.to_string().contains(&named), "{err}");
            assert_eq!(err, expected);
        }
        for c in 0..6 {
            assert!(engine
                .cpu_block_slice(0, c)
                .unwrap()
                .iter()
                .all(|&b| b == 0));
        }
        assert!(buf.bytes().iter().all(|&b| b == 0xEE));
        // One device block stored to two CPU blocks is two reads: allowed.
        let done = run_one(&engine, job(9, Direction::Store, &[(5, 0), (5, 1)]));
        assert_eq!(done.result, Ok(()));
        assert_eq!(engine.cpu_block_slice(0, 1).unwrap(), [0xEE; 4]);
        let stats = engine.stats();
        assert_eq!((stats.jobs_failed, stats.jobs_succeeded), (4, 1));
        // An empty job succeeds without touching the backend.
        let done = run_one(&engine, job(10, Direction::Load, &[]));
        assert_eq!((done.result, done.bytes), (Ok(()), 0));
    }

    #[test]
    fn bad_construction_is_refused_with_the_value() {
        let buf = FakeGpu::new(64);
        let spec = buf.region(8, 8, 8);
        let err = TransferEngine::new(vec![spec], 0, config()).unwrap_err();
        assert!(err.to_string().contains("num_cpu_blocks = 0"), "{err}");
        let err = TransferEngine::new(vec![], 4, config()).unwrap_err();
        assert!(err.to_string().contains("regions"), "{err}");
        let bad = TransferConfig {
            queue_capacity: 0,
            ..config()
        };
        let err = TransferEngine::new(vec![spec], 4, bad).unwrap_err();
        assert!(err.to_string().contains("queue_capacity = 0"), "{err}");
        let bad = TransferConfig {
            max_in_flight: 0,
            ..config()
        };
        let err = TransferEngine::new(vec![spec], 4, bad).unwrap_err();
        assert!(err.to_string().contains("max_in_flight = 0"), "{err}");
        let huge = vec![spec; 3];
        let err = TransferEngine::new(huge, u32::MAX, config());
        // 3 * 8 * 4G = 96 GiB does not fit in a test machine; either refusal names a value.
        if let Err(err) = err {
            assert!(
                err.to_string().contains("bytes") || err.to_string().contains("usize"),
                "{err}"
            );
        }
    }

    #[test]
    fn cpu_block_slice_checks_region_and_id() {
        let buf = FakeGpu::new(64);
        let mut engine = TransferEngine::new(vec![buf.region(8, 8, 8)], 4, config()).unwrap();
        assert_eq!(
            engine.cpu_block_slice(1, 0).unwrap_err(),
            TransferError::NoSuchRegion {
                region: 1,
                count: 1
            }
        );
        assert_eq!(
            engine.cpu_block_slice(0, 4).unwrap_err(),
            TransferError::InvalidBlock {
                side: BlockSide::Cpu,
                id: 4,
                limit: 4
            }
        );
        engine.cpu_block_slice_mut(0, 3).unwrap().fill(9);
        let done = run_one(&engine, job(1, Direction::Load, &[(7, 3)]));
        assert_eq!(done.result, Ok(()));
        assert_eq!(&buf.bytes()[56..64], [9; 8]);
    }

    /// Wraps the host backend; the first submit signals `entered` and then waits for
    /// `release`, so a test can hold the copy thread still.
    struct GateBackend {
        inner: HostCopyBackend,
        entered: Sender<()>,
        release: Receiver<()>,
        gated: bool,
    }

    impl CopyBackend for GateBackend {
        fn name(&self) -> &'static str {
            "gate"
        }

        unsafe fn submit(
            &mut self,
            direction: Direction,
            runs: &[CopyRun],
        ) -> Result<Ticket, BackendError> {
            if !self.gated {
                self.gated = true;
                let _ = self.entered.send(());
                let _ = self.release.recv();
            }
            // SAFETY: forwarded from our caller.
            unsafe { self.inner.submit(direction, runs) }
        }

        fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
            self.inner.query(ticket)
        }
    }

    #[test]
    fn full_queue_refuses_without_blocking() {
        let buf = FakeGpu::new(16 * 8);
        let (entered_tx, entered_rx) = bounded(1);
        let (release_tx, release_rx) = bounded(1);
        let backend = GateBackend {
            inner: HostCopyBackend::new(),
            entered: entered_tx,
            release: release_rx,
            gated: false,
        };
        let cfg = TransferConfig {
            queue_capacity: 4,
            ..config()
        };
        let engine =
            TransferEngine::with_backend(vec![buf.region(16, 8, 8)], 16, cfg, backend).unwrap();
        assert_eq!(engine.backend_name(), "gate");
        engine.submit(job(0, Direction::Store, &[(0, 0)])).unwrap();
        entered_rx.recv_timeout(WAIT).unwrap();
        for id in 1..=4 {
            engine
                .submit(job(id, Direction::Store, &[(id as u32, id as u32)]))
                .unwrap();
        }
        let err = engine
            .submit(job(5, Direction::Store, &[(5, 5)]))
            .unwrap_err();
        assert_eq!(err, TransferError::QueueFull { id: 5, capacity: 4 });
        assert!(err.to_string().contains("job 5"), "{err}");
        let err = engine
            .submit(job(3, Direction::Store, &[(6, 6)]))
            .unwrap_err();
        assert_eq!(err, TransferError::DuplicateJobId { id: 3 });
        release_tx.send(()).unwrap();
        let done = engine.wait_for(&[0, 1, 2, 3, 4], WAIT).unwrap();
        assert_eq!(done.len(), 5);
        assert!(done.iter().all(|c| c.result.is_ok()));
        // The refused id was never in flight, so it can be reused.
        assert_eq!(
            run_one(&engine, job(5, Direction::Store, &[(5, 5)])).result,
            Ok(())
        );
        assert_eq!(engine.stats().jobs_submitted, 6);
    }

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
                    matches!(err, TransferError::Backend { fatal: false, .. }),
                    "{err:?}"
                );
                assert!(err.to_string().contains("submit 2"), "{err}");
            } else {
                assert_eq!(c.result, Ok(()), "job {}", c.id);
            }
        }
        assert_eq!(engine.fatal_error(), None);
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
            Err(TransferError::Backend { fatal: true, .. })
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
        assert!(matches!(err, TransferError::Fatal { .. }));
        assert!(
            err.to_string().contains("scripted failure of submit 1"),
            "{err}"
        );
        assert!(engine.fatal_error().unwrap().contains("submit 1"));
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
        assert!(matches!(done[1].result, Err(TransferError::Fatal { .. })));
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
            matches!(err, TransferError::Backend { fatal: false, .. }),
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
            TransferEngine::with_backend(vec![buf.region(16, 8, 8)], 16, config(), backend)
                .unwrap();
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
            Err(TransferError::Backend { fatal: true, .. })
        ));
        assert_eq!(calls.lock().unwrap().last().unwrap(), "wait 666");
        assert!(engine.fatal_error().unwrap().contains("device lost"));
    }

    #[test]
    fn asynchronous_backend_with_bounded_in_flight() {
        let buf = FakeGpu::new(16 * 8);
        let mut rng = Rng(99);
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
            .filter(|c| c.result == Err(TransferError::Shutdown { id: c.id }))
            .count();
        assert!(skipped > 100, "only {skipped} skipped");
        assert_eq!(
            engine.submit(job(500, Direction::Store, &[(0, 0)])),
            Err(TransferError::Shutdown { id: 500 })
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

    /// A device that never finishes until told to.
    struct StuckBackend {
        inner: HostCopyBackend,
        finished: Arc<AtomicBool>,
    }

    impl CopyBackend for StuckBackend {
        fn name(&self) -> &'static str {
            "stuck"
        }

        unsafe fn submit(
            &mut self,
            direction: Direction,
            runs: &[CopyRun],
        ) -> Result<Ticket, BackendError> {
            // SAFETY: forwarded from our caller.
            unsafe { self.inner.submit(direction, runs) }
        }

        fn query(&mut self, _ticket: Ticket) -> Result<bool, BackendError> {
            Ok(self.finished.load(Ordering::Acquire))
        }
    }

    #[test]
    fn shutdown_times_out_on_a_stuck_device_and_detaches() {
        let buf = FakeGpu::new(16 * 8);
        let finished = Arc::new(AtomicBool::new(false));
        let backend = StuckBackend {
            inner: HostCopyBackend::new(),
            finished: Arc::clone(&finished),
        };
        let mut engine =
            TransferEngine::with_backend(vec![buf.region(16, 8, 8)], 16, config(), backend)
                .unwrap();
        engine.submit(job(1, Direction::Store, &[(0, 0)])).unwrap();
        let err = engine
            .wait_for(&[1], Duration::from_millis(20))
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransferError::Timeout {
                    waiting: 1,
                    first: 1,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(matches!(
            engine.cpu_block_slice(0, 0),
            Err(TransferError::Busy { unfinished: 1 })
        ));
        let err = engine.shutdown(Duration::from_millis(50)).unwrap_err();
        assert!(
            matches!(err, TransferError::ShutdownTimeout { unfinished: 1, .. }),
            "{err:?}"
        );
        // The detached thread still finishes the job, reports it and lets go of the memory.
        finished.store(true, Ordering::Release);
        let done = engine.wait_for(&[1], WAIT).unwrap();
        assert_eq!(done[0].result, Ok(()));
        assert!(engine.cpu_block_slice(0, 0).is_ok());
    }

    /// Builds random regions and jobs from `seed`, stores to CPU, wipes the device buffers,
    /// loads into other device ids, and checks every byte of every buffer.
    fn round_trip(
        seed: u64,
        shapes: &[(usize, usize)],
        gpu_blocks: &[u32],
        num_cpu: u32,
        count: usize,
    ) {
        let mut rng = Rng(seed | 1);
        let bufs: Vec<FakeGpu> = shapes
            .iter()
            .zip(gpu_blocks)
            .map(|(&(bytes, stride), &n)| FakeGpu::new((n as usize - 1) * stride + bytes))
            .collect();
        let specs: Vec<RegionSpec> = shapes
            .iter()
            .zip(gpu_blocks)
            .zip(&bufs)
            .map(|((&(bytes, stride), &n), buf)| buf.region(n, bytes, stride))
            .collect();
        for buf in &bufs {
            rng.fill(buf.bytes_mut());
        }
        let originals: Vec<Vec<u8>> = bufs.iter().map(|b| b.bytes().to_vec()).collect();
        let gpu_limit = *gpu_blocks.iter().min().unwrap();
        let count = count.min(gpu_limit as usize).min(num_cpu as usize);

        // Pairs with distinct ids on both sides, often in consecutive runs.
        let distinct = |rng: &mut Rng, limit: u32| -> Vec<u32> {
            let mut used = vec![false; limit as usize];
            let mut out: Vec<u32> = Vec::with_capacity(count);
            while out.len() < count {
                let next = match out.last() {
                    Some(&last)
                        if rng.below(4) != 0 && last + 1 < limit && !used[last as usize + 1] =>
                    {
                        last + 1
                    }
                    _ => rng.below(limit),
                };
                if !used[next as usize] {
                    used[next as usize] = true;
                    out.push(next);
                }
            }
            out
        };
        let src_gpu = distinct(&mut rng, gpu_limit);
        let cpu = distinct(&mut rng, num_cpu);
        let dst_gpu = distinct(&mut rng, gpu_limit);
        let stores: Vec<(u32, u32)> = src_gpu.iter().copied().zip(cpu.iter().copied()).collect();
        let loads: Vec<(u32, u32)> = dst_gpu.iter().copied().zip(cpu.iter().copied()).collect();

        let engine = TransferEngine::new(specs.clone(), num_cpu, config()).unwrap();
        let done = run_one(&engine, job(1, Direction::Store, &stores));
        assert_eq!(done.result, Ok(()));
        assert_eq!(done.bytes, (count * engine.cpu_block_bytes()) as u64);
        for buf in &bufs {
            buf.bytes_mut().fill(0);
        }
        let done = run_one(&engine, job(2, Direction::Load, &loads));
        assert_eq!(done.result, Ok(()));
        for (r, (spec, buf)) in specs.iter().zip(&bufs).enumerate() {
            let mut expected = vec![0u8; buf.len];
            for (&src, &dst) in src_gpu.iter().zip(&dst_gpu) {
                let (s, d) = (
                    src as usize * spec.block_stride(),
                    dst as usize * spec.block_stride(),
                );
                expected[d..d + spec.block_bytes()]
                    .copy_from_slice(&originals[r][s..s + spec.block_bytes()]);
            }
            assert_eq!(buf.bytes(), &expected[..], "region {r}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        #[test]
        fn random_jobs_round_trip_exactly(
            seed: u64,
            shapes in proptest::collection::vec((1usize..=40, 0usize..=2, 1usize..=24), 1..=3),
            gpu_blocks in proptest::collection::vec(1u32..=48, 3),
            num_cpu in 1u32..=64,
            count in 0usize..=64,
        ) {
            // Stride: contiguous, or padded by 1..=24 bytes.
            let shapes: Vec<(usize, usize)> = shapes
                .iter()
                .map(|&(bytes, kind, pad)| (bytes, if kind == 0 { bytes + pad } else { bytes }))
                .collect();
            round_trip(seed, &shapes, &gpu_blocks[..shapes.len()], num_cpu, count);
        }
    }
}
