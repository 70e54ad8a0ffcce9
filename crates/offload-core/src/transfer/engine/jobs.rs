//! Jobs in, completions out: the engine handle's side of the queues to the copy thread.
//! A submit never blocks; completions are parked for whichever caller asks, so that a
//! `wait_for` on some jobs leaves the completions of others to `poll_completions`.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, TrySendError};

use super::super::error::{SubmitError, WaitError};
use super::super::types::{Completion, TransferJob};
use super::{TransferEngine, WAIT_SLICE};

/// Completions received from the copy thread but not yet handed to the caller, and the ids
/// of jobs whose completion has not been received yet.
#[derive(Debug, Default)]
pub(super) struct Inbox {
    in_flight: HashSet<u64>,
    parked: VecDeque<Completion>,
}

impl Inbox {
    fn receive(&mut self, completion: Completion) {
        self.in_flight.remove(&completion.id);
        self.parked.push_back(completion);
    }
}

impl TransferEngine {
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
    /// [`JobError::Stopped`]: crate::transfer::JobError::Stopped
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

    fn lock_inbox(&self) -> MutexGuard<'_, Inbox> {
        // The inbox holds plain data that every critical section leaves consistent, so a
        // panic elsewhere while holding it does not corrupt it.
        self.inbox.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
