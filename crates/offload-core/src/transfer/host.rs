//! Host-memory backend: plain `memcpy` on the copy thread.
//!
//! Used by CPU-only vLLM, by tests and by CI. Copies are synchronous, so every ticket is
//! complete by the time `submit` returns.

use super::{BackendError, CopyBackend, CopyRun, Direction, Ticket};

/// A [`CopyBackend`] whose both sides are ordinary host memory.
#[derive(Debug, Default)]
pub struct HostCopyBackend {
    next_ticket: u64,
}

impl HostCopyBackend {
    /// A backend with no state beyond its ticket counter.
    pub fn new() -> Self {
        Self::default()
    }
}

impl CopyBackend for HostCopyBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    unsafe fn submit(
        &mut self,
        _direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError> {
        for run in runs {
            // SAFETY: our caller upholds `CopyBackend::submit`'s contract for every run,
            // which is exactly `copy_run`'s contract.
            unsafe { copy_run(run) }?;
        }
        let ticket = Ticket(self.next_ticket);
        self.next_ticket = self.next_ticket.wrapping_add(1);
        Ok(ticket)
    }

    fn query(&mut self, _ticket: Ticket) -> Result<bool, BackendError> {
        Ok(true)
    }
}

/// Copies one run. The only place the host backend dereferences an address.
///
/// # Safety
///
/// `run.src` must be valid for reads and `run.dst` valid for writes of `run.len` bytes, the
/// two ranges must not overlap, and no other thread may access the destination, or write the
/// source, during the call.
unsafe fn copy_run(run: &CopyRun) -> Result<(), BackendError> {
    // Addresses arrive as u64 (what Python's `tensor.data_ptr()` gives); on a 32-bit host an
    // address above 4 GiB cannot be ours, so refuse it instead of truncating it.
    let src = usize::try_from(run.src)
        .map_err(|_| BackendError::job(format!("source address {:#x} exceeds usize", run.src)))?;
    let dst = usize::try_from(run.dst).map_err(|_| {
        BackendError::job(format!("destination address {:#x} exceeds usize", run.dst))
    })?;
    // SAFETY: validity, non-overlap and exclusive access are this function's contract; the
    // integer-to-pointer casts recover addresses the caller obtained from live allocations.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, run.len) };
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn copies_runs_and_completes_at_once() {
        let src: Vec<u8> = (0..64).collect();
        let mut dst = vec![0u8; 64];
        let runs = [
            CopyRun {
                src: src.as_ptr() as u64,
                dst: dst.as_mut_ptr() as u64 + 32,
                len: 16,
            },
            CopyRun {
                src: src.as_ptr() as u64 + 48,
                dst: dst.as_mut_ptr() as u64,
                len: 16,
            },
        ];
        let mut backend = HostCopyBackend::new();
        // SAFETY: both runs lie inside `src`/`dst`, which are distinct live allocations not
        // otherwise touched during the call.
        let ticket = unsafe { backend.submit(Direction::Store, &runs) }.unwrap();
        assert!(backend.query(ticket).unwrap());
        assert_eq!(&dst[32..48], &src[0..16]);
        assert_eq!(&dst[0..16], &src[48..64]);
        assert!(dst[16..32].iter().all(|&b| b == 0));
        assert_eq!(backend.name(), "host");
    }
}
