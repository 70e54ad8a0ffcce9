//! The copy thread: takes jobs from the queues, validates and coalesces them, drives the
//! backend, and sends one completion per job, each only once the backend is done with the
//! job's memory.
//!
//! Loads and stores travel in separate lanes, each with its own queue and its own jobs in
//! flight, completed in submission order within the lane: a load (which a request is
//! waiting for) is taken before queued stores and never completes behind running ones.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Select, Sender};

use super::backend::{BackendError, CopyBackend, Ticket};
use super::config::TransferConfig;
use super::error::JobError;
use super::layout::{validate, Layout};
use super::region::{emit_runs, group_consecutive, BlockRun, CopyRun};
use super::shared::Shared;
use super::types::{Completion, Direction, TransferJob};
use crate::memory::HostMemory;

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
    Finished(Result<(), JobError>),
}

enum Next {
    Job(TransferJob),
    Idle,
    Stop,
}

/// The channels of one engine, as the copy thread sees them: jobs in (one queue per lane),
/// the stop request, completions out, and a sender dropped when the thread exits.
pub(crate) type Channels = (
    [Receiver<TransferJob>; 2],
    Receiver<()>,
    Sender<Completion>,
    Sender<()>,
);

/// The copy thread's state. Owns the backend; keeps the host memory alive while it runs.
pub(crate) struct CopyThread<B> {
    backend: B,
    host_base: u64,
    layout: Arc<Layout>,
    /// Held so a detached thread never outlives the memory it copies into.
    memory: Arc<HostMemory>,
    shared: Arc<Shared>,
    jobs: [Receiver<TransferJob>; 2],
    stop: Receiver<()>,
    completions: Sender<Completion>,
    /// Per lane, in submission order; completions leave from the front only.
    outstanding: [VecDeque<Pending>; 2],
    /// Scratch bitset over block ids for duplicate-destination checks; all zero between jobs.
    seen: Vec<u64>,
    groups: Vec<BlockRun>,
    runs: Vec<CopyRun>,
    max_in_flight: usize,
    poll_interval: Duration,
    /// Dropped when the thread exits, panicking or not.
    _exited: Sender<()>,
}

impl<B: CopyBackend> CopyThread<B> {
    pub(crate) fn new(
        backend: B,
        layout: Arc<Layout>,
        memory: Arc<HostMemory>,
        shared: Arc<Shared>,
        (jobs, stop, completions, exited): Channels,
        config: &TransferConfig,
    ) -> Self {
        Self {
            backend,
            host_base: memory.as_mut_ptr() as u64,
            seen: vec![0; layout.id_bitset_words()],
            layout,
            memory,
            shared,
            jobs,
            stop,
            completions,
            outstanding: [VecDeque::new(), VecDeque::new()],
            groups: Vec::new(),
            runs: Vec::new(),
            max_in_flight: config.max_in_flight,
            poll_interval: config.poll_interval,
            _exited: exited,
        }
    }

    pub(crate) fn run(mut self) {
        let _guard = PanicGuard(Arc::clone(&self.shared));
        match self.guarded(|b, host| b.attach(host.0, host.1)) {
            Ok(()) => self.shared.ready.store(true, Ordering::Release),
            Err(err) => {
                self.shared.stop(format!(
                    "{} backend failed to attach host memory: {}",
                    self.backend.name(),
                    err.message()
                ));
            }
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
        for lane in 0..2 {
            while let Ok(job) = self.jobs[lane].try_recv() {
                let id = job.id;
                self.push_finished(&job, Err(JobError::Shutdown { id }));
            }
        }
        // Jobs already with the backend must finish before the memory can be released.
        loop {
            self.poll_outstanding();
            if self.outstanding.iter().all(VecDeque::is_empty) {
                break;
            }
            std::thread::sleep(self.poll_interval);
        }
        log::debug!("copy thread exiting");
    }

    fn next(&mut self) -> Next {
        if self.shared.shutting_down.load(Ordering::Acquire) {
            return Next::Stop;
        }
        let room = [0, 1].map(|lane| self.outstanding[lane].len() < self.max_in_flight);
        // A job already queued is taken at once, loads before stores.
        let queued = (0..2)
            .filter(|&lane| room[lane])
            .find_map(|lane| self.jobs[lane].try_recv().ok());
        if let Some(job) = queued {
            return self.accept(job);
        }
        // Otherwise wait for a job or the stop request; with copies in flight, only until the
        // next poll of the backend.
        let busy = self.outstanding.iter().any(|o| !o.is_empty());
        let mut select = Select::new();
        let mut lanes = [usize::MAX; 2];
        for (lane, index) in lanes.iter_mut().enumerate() {
            if room[lane] {
                *index = select.recv(&self.jobs[lane]);
            }
        }
        select.recv(&self.stop);
        let op = if busy {
            match select.select_timeout(self.poll_interval) {
                Ok(op) => op,
                Err(_) => return Next::Idle,
            }
        } else {
            select.select()
        };
        let index = op.index();
        match lanes.iter().position(|&i| i == index) {
            Some(lane) => match op.recv(&self.jobs[lane]) {
                Ok(job) => self.accept(job),
                Err(_) => Next::Stop,
            },
            None => {
                let _ = op.recv(&self.stop);
                Next::Stop
            }
        }
    }

    /// A job just taken from a queue: started, unless a stop request came with it (both may
    /// be ready at once; queued jobs are not started after shutdown began).
    fn accept(&mut self, job: TransferJob) -> Next {
        if self.shared.shutting_down.load(Ordering::Acquire) {
            let id = job.id;
            self.push_finished(&job, Err(JobError::Shutdown { id }));
            return Next::Stop;
        }
        Next::Job(job)
    }

    fn stopped_error(&self) -> Option<JobError> {
        self.shared.stopped().map(|reason| JobError::Stopped {
            reason: reason.to_owned(),
        })
    }

    fn start(&mut self, job: TransferJob) {
        if let Some(err) = self.stopped_error() {
            self.push_finished(&job, Err(err));
            return;
        }
        // Read once: a detach waits for this job (it is unfinished) once the copies used
        // these regions, and a job started after it finds none.
        let Some(regions) = self.shared.attachment.current() else {
            let id = job.id;
            self.push_finished(&job, Err(JobError::Detached { id }));
            return;
        };
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
        for (region, offset) in regions.iter().zip(&self.layout.cpu_offsets) {
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
                self.shared.counters.runs(run_count);
                self.push(&job, PendingState::Submitted(ticket));
            }
            Err(err) => {
                let err = self.backend_failure(err);
                self.push_finished(&job, Err(err));
            }
        }
    }

    /// Sends completions for outstanding jobs that are done, oldest first in each lane,
    /// stopping at the first one still running so that a lane keeps submission order.
    fn poll_outstanding(&mut self) {
        for lane in 0..2 {
            self.poll_lane(lane);
        }
    }

    fn poll_lane(&mut self, lane: usize) {
        while let Some(front) = self.outstanding[lane].front_mut() {
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
            if let Some(pending) = self.outstanding[lane].pop_front() {
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

    fn backend_failure(&self, err: BackendError) -> JobError {
        let backend = self.backend.name();
        if err.is_fatal() {
            self.shared
                .stop(format!("{backend} backend failed: {}", err.message()));
        }
        JobError::Backend {
            backend,
            message: err.message().to_owned(),
            fatal: err.is_fatal(),
        }
    }

    fn push(&mut self, job: &TransferJob, state: PendingState) {
        let blocks = job.pairs.len() as u64;
        self.outstanding[job.direction.lane()].push_back(Pending {
            id: job.id,
            direction: job.direction,
            blocks,
            bytes: blocks * self.layout.cpu_block_bytes as u64,
            state,
        });
    }

    /// Queues an already-decided outcome behind the outstanding jobs, keeping order.
    fn push_finished(&mut self, job: &TransferJob, result: Result<(), JobError>) {
        self.push(job, PendingState::Finished(result));
    }

    fn complete(&self, pending: Pending, result: Result<(), JobError>) {
        // A job that ends after the engine stopped is not trusted: the stop may come from a
        // timed-out wait whose caller already gave up on it, or from a device fault.
        let result = result.and_then(|()| self.stopped_error().map_or(Ok(()), Err));
        let counters = &self.shared.counters;
        let bytes = if result.is_ok() {
            counters.succeeded(pending.direction, pending.blocks, pending.bytes);
            pending.bytes
        } else {
            counters.failed();
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

impl<B> std::fmt::Debug for CopyThread<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyThread")
            .field("loads", &self.outstanding[0].len())
            .field("stores", &self.outstanding[1].len())
            .finish_non_exhaustive()
    }
}

/// Stops the engine if the copy thread dies by panicking (a bug in the engine itself,
/// since backend panics are caught), so callers get an error instead of waiting forever.
#[derive(Debug)]
struct PanicGuard(Arc<Shared>);

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.stop("copy thread panicked".into());
        }
    }
}
