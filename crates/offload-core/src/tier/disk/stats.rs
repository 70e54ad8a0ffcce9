//! Counters and gauges of one rank's disk tier.

use std::sync::atomic::{AtomicU64, Ordering};

use super::error::IoKind;

macro_rules! disk_counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters, shared by every handle on one rank's files.
        #[derive(Debug, Default)]
        pub struct DiskStats {
            $(pub(crate) $name: AtomicU64,)*
        }

        /// A copy of [`DiskStats`] at one moment.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        #[non_exhaustive]
        pub struct DiskSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl DiskStats {
            /// The counters now.
            pub fn snapshot(&self) -> DiskSnapshot {
                DiskSnapshot {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }

        impl DiskSnapshot {
            /// Every counter by name, prefixed `disk_`.
            pub fn named(&self) -> Vec<(&'static str, u64)> {
                vec![$((concat!("disk_", stringify!($name)), self.$name),)*]
            }
        }
    };
}

disk_counters! {
    /// Blocks read, verified or not.
    reads,
    /// Blocks written.
    writes,
    /// Bytes read from the data file.
    bytes_read,
    /// Bytes written to the data file.
    bytes_written,
    /// Microseconds spent in read batches.
    read_micros,
    /// Microseconds spent in write batches.
    write_micros,
    /// Blocks on disk now (gauge).
    resident_blocks,
    /// Blocks the capacity holds (gauge).
    capacity_blocks,
    /// Bytes reserved for the files (gauge).
    capacity_bytes,
    /// Blocks evicted to make room (the clock hand's, or a full set's least recently
    /// used).
    evictions,
    /// Writes skipped: every slot, or every entry of the block's set, was busy.
    writes_skipped_busy,
    /// Blocks whose bytes failed a check on read: misses, slot freed.
    checksum_failures,
    /// I/O errors: `ENOSPC`.
    errors_enospc,
    /// I/O errors: `EIO`.
    errors_eio,
    /// I/O errors: `EINVAL`.
    errors_einval,
    /// I/O errors: short reads or writes.
    errors_short,
    /// I/O errors of any other kind.
    errors_other,
    /// Blocks found intact by the index rebuild at start.
    recovered_blocks,
    /// Microseconds the index rebuild took.
    rebuild_micros,
    /// 1 when I/O goes through the page cache (asked for, or `O_DIRECT` refused).
    buffered_io,
    /// `O_DIRECT` reads straight into the block's slices.
    direct_reads,
    /// `O_DIRECT` writes straight from the block's slices.
    direct_writes,
    /// `O_DIRECT` reads that went through an aligned buffer and a copy: the block's
    /// slices were not aligned as direct I/O asks (aligned ones are read into directly).
    bounced_reads,
    /// `O_DIRECT` writes that were copied into an aligned buffer first (as for reads).
    bounced_writes,
    /// 1 once repeated errors disabled the tier.
    disabled,
}

impl DiskStats {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn set(gauge: &AtomicU64, n: u64) {
        gauge.store(n, Ordering::Relaxed);
    }

    pub(crate) fn error(&self, kind: IoKind) {
        let c = match kind {
            IoKind::NoSpace => &self.errors_enospc,
            IoKind::Io => &self.errors_eio,
            IoKind::Invalid => &self.errors_einval,
            IoKind::Short => &self.errors_short,
            IoKind::Other => &self.errors_other,
        };
        Self::add(c, 1);
    }
}
