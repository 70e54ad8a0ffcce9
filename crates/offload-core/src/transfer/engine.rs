//! The [`TransferEngine`] handle: what callers hold. It queues jobs for the copy thread,
//! hands back completions, and stops the engine when a wait runs out of time.
//!
//! ```
//! use std::time::Duration;
//! use offload_core::transfer::{Direction, RegionSpec, TransferConfig, TransferEngine, TransferJob};
//!
//! // Four "device" blocks of 8 bytes, here ordinary host memory.
//! let mut device = vec![3u8; 4 * 8];
//! // SAFETY: `device` outlives the engine and is not touched while a job is in flight.
//! let region = unsafe { RegionSpec::new(device.as_mut_ptr() as u64, 4, 8, 8) }?;
//! let mut engine = TransferEngine::new(vec![region], 2, TransferConfig::default())?;
//! engine.submit(TransferJob::new(1, Direction::Store, vec![(2, 0)]))?;
//! let done = engine.wait_for(&[1], Duration::from_secs(10))?;
//! assert_eq!(done[0].result, Ok(()));
//! assert_eq!(engine.cpu_block_slice(0, 0)?, &[3u8; 8][..]);
//! engine.shutdown(Duration::from_secs(5))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender, TrySendError};

use super::backend::CopyBackend;
use super::config::{BackendKind, TransferConfig};
use super::copy_thread::CopyThread;
use super::cuda::CudaCopyBackend;
use super::error::{
    BlockAccessError, BuildError, ReadyError, ShutdownError, SubmitError, WaitError,
};
use super::fault::FaultInjector;
use super::host::HostCopyBackend;
use super::host_blocks::HostBlocks;
use super::layout::Layout;
use super::region::RegionSpec;
use super::shared::Shared;
use super::stats::TransferStats;
use super::types::{Completion, TransferJob};
use crate::memory::HostMemory;

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
    pub(super) shared: Arc<Shared>,
    /// One queue per lane (loads, stores).
    jobs: Option<[Sender<TransferJob>; 2]>,
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
    ) -> Result<Self, BuildError> {
        Self::open(regions, num_cpu_blocks, config, BackendKind::Host)
    }

    /// An engine with the backend `kind` names, wrapped in a [`FaultInjector`] when
    /// `config.faults` injects anything. For CUDA this loads the driver and checks the device
    /// now (a missing or old driver fails here, as [`BuildError::Cuda`]); pinning happens on
    /// the copy thread afterwards (see [`is_ready`](Self::is_ready)).
    pub fn open(
        regions: Vec<RegionSpec>,
        num_cpu_blocks: u32,
        config: TransferConfig,
        kind: BackendKind,
    ) -> Result<Self, BuildError> {
        let faults = config.faults;
        match kind {
            BackendKind::Host if faults.is_active() => {
                let backend = FaultInjector::new(HostCopyBackend::new(), faults);
                Self::with_backend(regions, num_cpu_blocks, config, backend)
            }
            BackendKind::Host => {
                Self::with_backend(regions, num_cpu_blocks, config, HostCopyBackend::new())
            }
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
    ) -> Result<Self, BuildError> {
        for (field, value) in [
            ("queue_capacity", config.queue_capacity),
            ("max_in_flight", config.max_in_flight),
        ] {
            if value == 0 {
                return Err(BuildError::InvalidConfig {
                    field,
                    value: "0".into(),
                    reason: "must be > 0",
                });
            }
        }
        let layout = Arc::new(Layout::new(regions, num_cpu_blocks)?);
        let memory = Arc::new(HostMemory::with_options(layout.host_len(), &config.memory)?);
        let shared = Arc::new(Shared::default());
        shared.attachment.set(Some(layout.regions.clone().into()));
        let (loads_tx, loads_rx) = bounded(config.queue_capacity);
        let (stores_tx, stores_rx) = bounded(config.queue_capacity);
        let (stop_tx, stop_rx) = bounded(1);
        let (exited_tx, exited_rx) = bounded(1);
        let (done_tx, done_rx) = unbounded();
        let backend_name = backend.name();
        let backend_detail = backend.describe();
        let copy_thread = CopyThread::new(
            backend,
            Arc::clone(&layout),
            Arc::clone(&memory),
            Arc::clone(&shared),
            ([loads_rx, stores_rx], stop_rx, done_tx, exited_tx),
            &config,
        );
        let thread = std::thread::Builder::new()
            .name("kvoffload-copy".into())
            .spawn(move || copy_thread.run())
            .map_err(|e| BuildError::ThreadSpawn {
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
            jobs: Some([loads_tx, stores_tx]),
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
    pub fn submit(&self, job: TransferJob) -> Result<(), SubmitError> {
        let id = job.id;
        if let Some(reason) = self.shared.stopped() {
            return Err(SubmitError::Stopped {
                id,
                reason: reason.to_owned(),
            });
        }
        let Some(jobs) = self.jobs.as_ref() else {
            return Err(SubmitError::Shutdown { id });
        };
        if !self.is_attached() {
            return Err(SubmitError::Detached { id });
        }
        if !self.lock_inbox().in_flight.insert(id) {
            return Err(SubmitError::DuplicateJobId { id });
        }
        self.shared.unfinished.fetch_add(1, Ordering::AcqRel);
        let refused = match jobs[job.direction.lane()].try_send(job) {
            Ok(()) => {
                self.shared.counters.submitted();
                return Ok(());
            }
            Err(TrySendError::Full(_)) => SubmitError::QueueFull {
                id,
                capacity: self.queue_capacity,
            },
            Err(TrySendError::Disconnected(_)) => match self.shared.stopped() {
                Some(reason) => SubmitError::Stopped {
                    id,
                    reason: reason.to_owned(),
                },
                None => SubmitError::Shutdown { id },
            },
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
    /// lookup.
    ///
    /// When `timeout` passes first, the engine **stops for good** and the call keeps waiting
    /// until the copies already running have ended; only then does it return, with every
    /// awaited job that had not completed reported as failed ([`JobError::Stopped`]). A
    /// caller that gives up on a copy must be able to reuse its memory, and a copy on a
    /// device cannot be cancelled: reporting the job before the copy ends would let a late
    /// load overwrite a block the server has handed to another request, or publish a store
    /// whose source was overwritten while it was read. Waiting longer with the blocks held
    /// would keep the server's step blocked on a device that is already too slow, so the
    /// engine stops instead: jobs still queued fail without copying, later submits fail with
    /// [`SubmitError::Stopped`], and the server recomputes. The call can therefore block past
    /// `timeout` for as long as the device takes to finish its running copies.
    ///
    /// [`JobError::Stopped`]: super::JobError::Stopped
    pub fn wait_for(&self, ids: &[u64], timeout: Duration) -> Result<Vec<Completion>, WaitError> {
        // `None`: the timeout is too long to represent, i.e. wait forever.
        let deadline = Instant::now().checked_add(timeout);
        let mut timed_out = false;
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
            if !timed_out && deadline.is_some_and(|d| Instant::now() >= d) {
                timed_out = true;
                self.shared.stop(format!(
                    "a wait for {} job(s) (first id {}) timed out after {} ms; waiting for the \
                     copies already running to end before reporting them failed",
                    waiting.len(),
                    waiting[0],
                    timeout.as_millis()
                ));
            }
            let slice = match deadline {
                Some(d) if !timed_out => d.saturating_duration_since(Instant::now()),
                _ => WAIT_SLICE,
            };
            match self.completions.recv_timeout(slice.min(WAIT_SLICE)) {
                Ok(completion) => self.lock_inbox().receive(completion),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    // The copy thread is gone without completing these jobs: only a panic in
                    // the engine itself does that, and then nothing copies any more.
                    let err = WaitError::CopyThreadGone {
                        waiting: waiting.len(),
                        first: waiting[0],
                        reason: self.shared.stopped().unwrap_or("shut down").to_owned(),
                    };
                    let mut inbox = self.lock_inbox();
                    for completion in found.into_iter().rev() {
                        inbox.parked.push_front(completion);
                    }
                    return Err(err);
                }
            }
        }
    }

    /// Stops the copy thread: jobs still queued complete with
    /// [`JobError::Shutdown`](super::JobError::Shutdown), jobs already handed to the backend
    /// are waited for. Returns once the thread has exited, or with a [`ShutdownError`] after
    /// `timeout`: the thread then runs on, detached, and keeps the host memory mapped until
    /// its copies end; the caller must keep the regions alive (leak them) rather than free
    /// memory a copy may still write. Idempotent. Completions remain available to
    /// `poll_completions` afterwards.
    pub fn shutdown(&mut self, timeout: Duration) -> Result<(), ShutdownError> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        self.shared.shutting_down.store(true, Ordering::Release);
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
                let unfinished = self.shared.unfinished();
                log::warn!(
                    "copy thread did not stop within {timeout:?} ({unfinished} jobs \
                     unfinished); detaching it with the host memory"
                );
                Err(ShutdownError {
                    timeout_ms: timeout.as_millis(),
                    unfinished,
                })
            }
        }
    }

    /// Whether the copy thread has exited (after [`shutdown`](Self::shutdown), or a panic):
    /// from then on no copy touches the regions.
    pub fn copy_thread_exited(&self) -> bool {
        matches!(
            self.exited.try_recv(),
            Err(crossbeam_channel::TryRecvError::Disconnected)
        )
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> TransferStats {
        self.shared.counters.snapshot()
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
    /// Stays `false` forever if the attach failed ([`stopped`](Self::stopped) says why).
    pub fn is_ready(&self) -> bool {
        self.shared.ready.load(Ordering::Acquire)
    }

    /// Blocks until [`is_ready`](Self::is_ready), the engine stopped (e.g. the attach
    /// failed), or `timeout` passed.
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), ReadyError> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if self.is_ready() {
                return Ok(());
            }
            if let Some(reason) = self.shared.stopped() {
                return Err(ReadyError::Stopped {
                    reason: reason.to_owned(),
                });
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(ReadyError::NotReady {
                    timeout_ms: timeout.as_millis(),
                });
            }
            std::thread::sleep(WAIT_SLICE);
        }
    }

    /// Why the engine stopped for good (a fatal device fault, a failed attach, a timed-out
    /// [`wait_for`](Self::wait_for)), or `None` while it works.
    pub fn stopped(&self) -> Option<&str> {
        self.shared.stopped()
    }

    /// Whole CPU blocks of this engine's host memory, for callers outside the copy thread
    /// (the remote tier); see [`HostBlocks`] for who may touch which block when.
    pub fn host_blocks(&self) -> HostBlocks {
        HostBlocks::new(Arc::clone(&self.layout), Arc::clone(&self.memory))
    }

    /// The bytes of CPU block `cpu_id` of region `region`, for tests and debugging.
    ///
    /// `&mut self` keeps new jobs from being submitted while the slice lives, and the call
    /// fails with [`BlockAccessError::Busy`] while any job is in flight, so the copy thread
    /// cannot be touching the bytes.
    pub fn cpu_block_slice(
        &mut self,
        region: usize,
        cpu_id: u32,
    ) -> Result<&[u8], BlockAccessError> {
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
    ) -> Result<&mut [u8], BlockAccessError> {
        let (ptr, len) = self.idle_block(region, cpu_id)?;
        // SAFETY: as in `cpu_block_slice`; `&mut self` also makes this the only slice.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    fn idle_block(&self, region: usize, cpu_id: u32) -> Result<(*mut u8, usize), BlockAccessError> {
        let layout = &self.layout;
        let spec = layout
            .regions
            .get(region)
            .ok_or(BlockAccessError::NoSuchRegion {
                region,
                count: layout.regions.len(),
            })?;
        if cpu_id >= layout.num_cpu_blocks {
            return Err(BlockAccessError::InvalidBlock {
                id: cpu_id,
                limit: layout.num_cpu_blocks,
            });
        }
        let unfinished = self.shared.unfinished();
        if unfinished != 0 {
            return Err(BlockAccessError::Busy { unfinished });
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
