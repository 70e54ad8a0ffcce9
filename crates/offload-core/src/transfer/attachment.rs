//! Whether the engine may touch its device regions: detached while the server releases its
//! KV memory (vLLM's sleep mode), attached again once it is back.
//!
//! Detaching stops new copies at once (a submit is refused, a job still queued fails
//! without copying), waits for the copies already handed to the backend, and only then
//! reports the regions free: a copy is never submitted against memory the server may have
//! released. The host memory, the CPU blocks it holds and everything the scheduler knows
//! stay as they are.
//!
//! ```
//! use std::time::Duration;
//! use offload_core::transfer::{Direction, RegionSpec, TransferConfig, TransferEngine, TransferJob};
//!
//! let mut device = vec![5u8; 4 * 8];
//! // SAFETY: `device` outlives the engine, is untouched while a job is in flight, and is
//! // not freed while the engine is attached to it.
//! let region = unsafe { RegionSpec::new(device.as_mut_ptr() as u64, 4, 8, 8) }?;
//! let engine = TransferEngine::new(vec![region], 2, TransferConfig::default())?;
//! engine.detach_regions(Duration::from_secs(5))?;
//! // Asleep: nothing copies.
//! assert!(engine.submit(TransferJob::new(1, Direction::Store, vec![(0, 0)])).is_err());
//! // SAFETY: the same memory, valid again.
//! unsafe { engine.attach_regions(vec![region]) }?;
//! engine.submit(TransferJob::new(2, Direction::Store, vec![(0, 0)]))?;
//! assert!(engine.wait_for(&[2], Duration::from_secs(10))?[0].result.is_ok());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::time::{Duration, Instant};

use super::engine::TransferEngine;
use super::region::RegionSpec;

/// Why [`TransferEngine::detach_regions`] could not vouch that no copy touches the regions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DetachError {
    /// Copies were still running when the timeout passed. The engine stopped for good
    /// (every later copy fails, naming this), since they may still touch the regions.
    #[error(
        "{unfinished} copy job(s) still running {timeout_ms} ms after the KV caches were \
         unregistered; the transfer engine stopped"
    )]
    Timeout {
        /// Jobs not yet completed.
        unfinished: u64,
        /// The timeout given.
        timeout_ms: u128,
    },
}

/// Why [`TransferEngine::attach_regions`] refused the regions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// Not the shape the engine was built with (its host layout depends on it).
    #[error("region {index}: {field} is {got}, the engine was built with {want}")]
    Mismatch {
        /// Which region (in construction order), or the count for `field == "regions"`.
        index: usize,
        /// The differing property.
        field: &'static str,
        /// What was given.
        got: u64,
        /// What the engine was built with.
        want: u64,
    },
    /// The engine stopped for good; attaching would not make it copy again.
    #[error("transfer engine stopped: {reason}")]
    Stopped {
        /// Why.
        reason: String,
    },
}

/// How often a detach re-checks the jobs in flight.
const DETACH_POLL: Duration = Duration::from_micros(200);

impl TransferEngine {
    /// Stops copying to and from the device regions and waits, at most `timeout`, for the
    /// copies already running. Submits are refused from now on
    /// ([`SubmitError::Detached`](super::SubmitError::Detached)) and jobs still queued fail
    /// without copying ([`JobError::Detached`](super::JobError::Detached)); each still gets
    /// its completion. On `Ok` no copy touches the regions until
    /// [`attach_regions`](Self::attach_regions): their memory may be released. On a timeout
    /// the engine stops for good. Idempotent.
    pub fn detach_regions(&self, timeout: Duration) -> Result<(), DetachError> {
        self.shared.attachment.set(None);
        let deadline = Instant::now().checked_add(timeout);
        loop {
            // Acquire: pairs with the copy thread's Release once the backend is done.
            let unfinished = self.shared.unfinished();
            if unfinished == 0 {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let err = DetachError::Timeout {
                    unfinished,
                    timeout_ms: timeout.as_millis(),
                };
                self.shared.stop(err.to_string());
                return Err(err);
            }
            std::thread::sleep(DETACH_POLL);
        }
    }

    /// Copies use `regions` from now on, which must have the shape the engine was built
    /// with (count, blocks, block bytes and stride; their addresses may differ).
    ///
    /// # Safety
    ///
    /// Every guarantee of [`RegionSpec::new`] holds for `regions` from now on, for as long
    /// as the engine stays attached to them.
    pub unsafe fn attach_regions(&self, regions: Vec<RegionSpec>) -> Result<(), AttachError> {
        if let Some(reason) = self.shared.stopped() {
            return Err(AttachError::Stopped {
                reason: reason.to_owned(),
            });
        }
        let built = self.regions();
        if regions.len() != built.len() {
            return Err(AttachError::Mismatch {
                index: regions.len(),
                field: "regions",
                got: regions.len() as u64,
                want: built.len() as u64,
            });
        }
        for (index, (got, want)) in regions.iter().zip(built).enumerate() {
            let fields = [
                (
                    "num_blocks",
                    got.num_blocks() as u64,
                    want.num_blocks() as u64,
                ),
                (
                    "block_bytes",
                    got.block_bytes() as u64,
                    want.block_bytes() as u64,
                ),
                (
                    "block_stride",
                    got.block_stride() as u64,
                    want.block_stride() as u64,
                ),
            ];
            if let Some(&(field, got, want)) = fields.iter().find(|(_, g, w)| g != w) {
                return Err(AttachError::Mismatch {
                    index,
                    field,
                    got,
                    want,
                });
            }
        }
        self.shared.attachment.set(Some(regions.into()));
        Ok(())
    }

    /// Whether copies may touch the device regions (not detached).
    pub fn is_attached(&self) -> bool {
        self.shared.attachment.current().is_some()
    }
}
