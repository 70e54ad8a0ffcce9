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

mod cpu_blocks;
mod jobs;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};

use super::backend::CopyBackend;
use super::config::{BackendKind, TransferConfig};
use super::copy_thread::CopyThread;
use super::cuda::CudaCopyBackend;
use super::error::{BuildError, ReadyError, ShutdownError};
use super::fault::FaultInjector;
use super::host::HostCopyBackend;
use super::layout::Layout;
use super::region::RegionSpec;
use super::shared::Shared;
use super::stats::TransferStats;
use super::types::{Completion, TransferJob};
use crate::memory::HostMemory;
use jobs::Inbox;

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
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        if let Err(err) = self.shutdown(DROP_SHUTDOWN_TIMEOUT) {
            log::warn!("transfer engine dropped uncleanly: {err}");
        }
    }
}
