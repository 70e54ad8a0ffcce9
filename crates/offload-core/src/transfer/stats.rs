//! The engine's counters: bumped by the copy thread, read by anyone.

use std::sync::atomic::{AtomicU64, Ordering};

use super::types::Direction;

/// A snapshot of an engine's counters ([`TransferEngine::stats`](super::TransferEngine::stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
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
pub(crate) struct Counters {
    jobs_submitted: AtomicU64,
    jobs_succeeded: AtomicU64,
    jobs_failed: AtomicU64,
    runs_submitted: AtomicU64,
    blocks_stored: AtomicU64,
    blocks_loaded: AtomicU64,
    bytes_stored: AtomicU64,
    bytes_loaded: AtomicU64,
}

impl Counters {
    pub(crate) fn submitted(&self) {
        self.jobs_submitted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn runs(&self, runs: u64) {
        self.runs_submitted.fetch_add(runs, Ordering::Relaxed);
    }

    pub(crate) fn failed(&self) {
        self.jobs_failed.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn succeeded(&self, direction: Direction, blocks: u64, bytes: u64) {
        self.jobs_succeeded.fetch_add(1, Ordering::Relaxed);
        let (blocks_ctr, bytes_ctr) = match direction {
            Direction::Store => (&self.blocks_stored, &self.bytes_stored),
            Direction::Load => (&self.blocks_loaded, &self.bytes_loaded),
        };
        blocks_ctr.fetch_add(blocks, Ordering::Relaxed);
        bytes_ctr.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> TransferStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TransferStats {
            jobs_submitted: get(&self.jobs_submitted),
            jobs_succeeded: get(&self.jobs_succeeded),
            jobs_failed: get(&self.jobs_failed),
            runs_submitted: get(&self.runs_submitted),
            blocks_stored: get(&self.blocks_stored),
            blocks_loaded: get(&self.blocks_loaded),
            bytes_stored: get(&self.bytes_stored),
            bytes_loaded: get(&self.bytes_loaded),
        }
    }
}
