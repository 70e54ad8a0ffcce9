//! The seam between the engine and whatever moves the bytes.
//!
//! A [`CopyBackend`] lives on the engine's copy thread. The engine hands it the coalesced
//! [`CopyRun`]s of one job at a time and polls the returned [`Ticket`] until the backend
//! says the copies are over. A backend that counts the runs it is given:
//!
//! ```
//! use offload_core::transfer::{
//!     BackendError, CopyBackend, CopyRun, Direction, HostCopyBackend, Ticket,
//! };
//!
//! #[derive(Debug, Default)]
//! struct Counting {
//!     inner: HostCopyBackend,
//!     runs: usize,
//! }
//!
//! impl CopyBackend for Counting {
//!     fn name(&self) -> &'static str {
//!         "counting"
//!     }
//!
//!     unsafe fn submit(
//!         &mut self,
//!         direction: Direction,
//!         runs: &[CopyRun],
//!     ) -> Result<Ticket, BackendError> {
//!         self.runs += runs.len();
//!         // SAFETY: our caller's guarantees are forwarded unchanged.
//!         unsafe { self.inner.submit(direction, runs) }
//!     }
//!
//!     fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
//!         self.inner.query(ticket)
//!     }
//! }
//!
//! let src = [7u8; 8];
//! let mut dst = [0u8; 8];
//! let mut backend = Counting::default();
//! let run = CopyRun { src: src.as_ptr() as u64, dst: dst.as_mut_ptr() as u64, len: 8 };
//! // SAFETY: both buffers are live, distinct and untouched until the query says done.
//! let ticket = unsafe { backend.submit(Direction::Store, &[run]) }.unwrap();
//! assert!(backend.query(ticket).unwrap());
//! assert_eq!((dst, backend.runs), ([7u8; 8], 1));
//! ```

use super::region::CopyRun;
use super::types::Direction;

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
///
/// The engine reports a job finished (failed or not) only after `query` said so or
/// `submit` returned an error, so both must mean "nothing of this job is still copying":
/// a backend that fails after part of a job was started waits for that part first.
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
    /// the caller ([`TransferJob::wait_event`](super::TransferJob::wait_event)). Called right
    /// before that `submit`. A backend without device events refuses (the default), failing
    /// the job: silently ignoring the event could read blocks still being written.
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
    /// overlap each other's destinations. An error means no copy of the job is running
    /// (any part already started has finished).
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
    /// retired and is not queried again; both mean no copy of it is still running. Must not
    /// block for long: the engine polls.
    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError>;
}
