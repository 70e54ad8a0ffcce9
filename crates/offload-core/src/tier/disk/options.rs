//! [`DiskOptions`]: how a rank's disk tier opens its files, and the tier's constants.

use std::path::PathBuf;

use super::layout::Geometry;
use crate::tier::LayoutFingerprint;
use crate::transfer::FaultPlan;

/// Consecutive failed I/Os after which the tier turns itself off.
pub const DISABLE_AFTER_ERRORS: u64 = 16;
/// Threads a batch's I/O runs on when none is given.
pub const DEFAULT_IO_THREADS: usize = 8;

/// How to open a rank's files.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DiskOptions {
    /// `<disk_path>.rank_<N>`; the index is this path plus `.idx`.
    pub path: PathBuf,
    /// Bytes the two files may take together.
    pub capacity_bytes: u64,
    /// Bytes of every block's payload (all blocks of a layout have one length); a slot
    /// is this rounded up to 4 KiB.
    pub block_bytes: u64,
    /// The layout whose blocks the files hold; a persisted file of another is wiped.
    pub fingerprint: LayoutFingerprint,
    /// Buffered I/O instead of `O_DIRECT`.
    pub use_page_cache: bool,
    /// Keep the files at shutdown and serve them after a restart.
    pub persist: bool,
    /// Most I/Os of one batch in flight at once with `O_DIRECT`; through the page cache
    /// no more than the machine's cores (see [`DiskStore::io_threads`](super::DiskStore::io_threads)).
    pub io_threads: usize,
    /// Faults to inject (tests).
    pub faults: FaultPlan,
    /// Record which blocks come and go, for [`DiskStore::take_changes`](super::DiskStore::take_changes) (KV events).
    pub report_changes: bool,
}

/// The `capacity_bytes` that holds exactly `blocks` blocks of `block_bytes` bytes: their
/// slots (each block rounded up to 4 KiB), the index file's entries and header. `None`
/// when that does not fit in a `u64` or names more than `u32::MAX` blocks.
///
/// # Examples
/// ```
/// use offload_core::tier::disk::capacity_for_blocks;
///
/// // 1,000 blocks of 64 KiB: 64,000 KiB of slots and 1,500 entries of 128 bytes (whole
/// // sets of 64), after a 4 KiB header.
/// assert_eq!(capacity_for_blocks(1000, 64 << 10), Some(1000 * 65536 + 1536 * 128 + 4096));
/// ```
pub fn capacity_for_blocks(blocks: u64, block_bytes: u64) -> Option<u64> {
    Geometry::capacity_for(blocks, block_bytes)
}

impl DiskOptions {
    /// I/Os of one batch in flight at once on files opened `direct` or not: with
    /// `O_DIRECT` the device's queue sets the pace, so [`Self::io_threads`]; through the
    /// page cache each read or write is the kernel copying on a core, and threads beyond
    /// the cores only take turns on them (on two cores, 8 threads read and wrote slower
    /// than 2 in `benches/disk.rs`, measured before this cap), so no more than the cores.
    pub(super) fn io_width(&self, direct: bool) -> usize {
        let wanted = self.io_threads.max(1);
        if direct {
            return wanted;
        }
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        wanted.min(cores)
    }

    /// Options with the defaults: `O_DIRECT`, not persisted, no faults.
    pub fn new(
        path: impl Into<PathBuf>,
        capacity_bytes: u64,
        block_bytes: u64,
        fingerprint: LayoutFingerprint,
    ) -> Self {
        Self {
            path: path.into(),
            capacity_bytes,
            block_bytes,
            fingerprint,
            use_page_cache: false,
            persist: false,
            io_threads: DEFAULT_IO_THREADS,
            faults: FaultPlan::default(),
            report_changes: false,
        }
    }
}
