//! State shared by the engine handle and its copy thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use super::region::RegionSpec;
use super::stats::Counters;

#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// Why the engine stopped for good (a fatal backend fault, a failed attach, a timed-out
    /// wait, a panic); once set, never cleared.
    stopped: OnceLock<String>,
    /// Set by `shutdown`: queued jobs are not started any more.
    pub(crate) shutting_down: AtomicBool,
    /// Set once the backend's `attach` succeeded (host memory pinned); never cleared.
    pub(crate) ready: AtomicBool,
    /// Jobs accepted and not yet completed. The copy thread decrements it (Release) only
    /// after the backend is done with a job's memory, so observing 0 (Acquire) proves no copy
    /// touches host memory.
    pub(crate) unfinished: AtomicU64,
    pub(crate) counters: Counters,
    /// The device regions copies use; `None` while detached (see `TransferEngine::detach_regions`).
    pub(crate) attachment: Attachment,
}

impl Shared {
    /// Stops the engine for good; the first reason wins. Returns whether this call stopped it.
    pub(crate) fn stop(&self, reason: String) -> bool {
        let first = self.stopped.set(reason.clone()).is_ok();
        if first {
            log::error!("kvoffload transfer engine stopped: {reason}");
        }
        first
    }

    pub(crate) fn stopped(&self) -> Option<&str> {
        self.stopped.get().map(String::as_str)
    }

    pub(crate) fn unfinished(&self) -> u64 {
        self.unfinished.load(Ordering::Acquire)
    }
}

/// The regions copies may use now, or `None` while detached.
#[derive(Debug, Default)]
pub(crate) struct Attachment(Mutex<Option<Arc<[RegionSpec]>>>);

impl Attachment {
    /// The regions to copy with, or `None` while detached. A copy started with them keeps
    /// its job unfinished, so a concurrent detach waits for it.
    pub(crate) fn current(&self) -> Option<Arc<[RegionSpec]>> {
        self.lock().clone()
    }

    pub(crate) fn set(&self, regions: Option<Arc<[RegionSpec]>>) {
        *self.lock() = regions;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<[RegionSpec]>>> {
        // A plain value swapped whole: a panic elsewhere cannot leave it half written.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
