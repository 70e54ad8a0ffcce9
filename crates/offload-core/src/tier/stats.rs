//! Counters of the remote tier, shared by the threads that use it.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters; every thread that talks to the store adds to the same set.
        #[derive(Debug, Default)]
        pub struct TierStats {
            $(pub(crate) $name: AtomicU64,)*
        }

        /// A copy of [`TierStats`] at one moment.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        #[non_exhaustive]
        pub struct TierSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl TierStats {
            /// The counters now.
            pub fn snapshot(&self) -> TierSnapshot {
                TierSnapshot {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }
    };
}

counters! {
    /// Existence checks sent: one round trip each, however many keys.
    probe_round_trips,
    /// Keys asked about by existence checks.
    probe_keys,
    /// Blocks found by existence checks (the leading run of each chain).
    probe_hits,
    /// Fetches sent: one round trip each.
    get_round_trips,
    /// Microseconds spent waiting for fetches (their round trips, whole).
    get_micros,
    /// Blocks fetched and verified.
    get_hits,
    /// Blocks asked for that the store did not have.
    get_misses,
    /// Values that failed a check (header, layout, size, checksum): misses, never loaded.
    corrupt_values,
    /// Keys whose call failed (timeout, connection, server error).
    failed_keys,
    /// Keys whose call missed its deadline (also counted in `failed_keys`).
    timeouts,
    /// Blocks accepted into the write-behind queue.
    writes_queued,
    /// Blocks dropped because the write-behind queue was full.
    writes_dropped,
    /// Blocks written.
    writes_done,
    /// Blocks whose write failed.
    writes_failed,
    /// Write batches sent: one round trip each.
    write_round_trips,
    /// Payload bytes written.
    bytes_written,
    /// Payload bytes fetched and verified.
    bytes_read,
}

/// Adds `n` to a counter.
pub(crate) fn bump(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}
