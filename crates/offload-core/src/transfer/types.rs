//! The values that cross the engine's boundary: a job in, a completion out.

use super::error::JobError;

/// Which way a job moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Device -> host (offload).
    Store,
    /// Host -> device (onload).
    Load,
}

impl Direction {
    /// The lane of a direction (its queue, its jobs in flight and, on CUDA, its stream):
    /// loads first, so that scanning lanes in order favours them.
    pub(crate) fn lane(self) -> usize {
        match self {
            Self::Load => 0,
            Self::Store => 1,
        }
    }
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Store => "store",
            Self::Load => "load",
        })
    }
}

/// One batch of block copies in one direction, identified by a caller-chosen id.
///
/// ```
/// use offload_core::transfer::{Direction, TransferJob};
///
/// // Device blocks 4 and 5 to CPU blocks 0 and 1, after the compute stream's event 0xbeef.
/// let job = TransferJob::new(7, Direction::Store, vec![(4, 0), (5, 1)]).with_wait_event(0xbeef);
/// assert_eq!(job.wait_event, Some(0xbeef));
/// ```
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
    /// after the event's most recent record (see
    /// [`CopyBackend::wait_event`](super::CopyBackend::wait_event)). Stores pass an event
    /// recorded on the compute stream so they never read blocks still being written. The
    /// event must stay alive until the job's [`Completion`] arrives. `None`: no wait.
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

/// The outcome of one job. It is sent only once the backend can no longer touch the job's
/// memory, whether the job succeeded or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The job's id.
    pub id: u64,
    /// The job's direction.
    pub direction: Direction,
    /// `Ok` when every byte was copied; otherwise why not (nothing, or an unknown part of the
    /// job, was copied: treat every block of the job as not transferred).
    pub result: Result<(), JobError>,
    /// Bytes moved: `pairs * cpu_block_bytes` on success, 0 on failure.
    pub bytes: u64,
}
