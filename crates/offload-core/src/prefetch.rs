//! [`prefetch`]: a cache hint for lookups that touch many random places at once.
//!
//! A prefix lookup probes one index bucket and one pool slot per block, each a likely
//! cache miss on a busy scheduler. Issuing the hints for a run of blocks before reading
//! any of them lets those misses overlap instead of queueing one behind the other.

/// Asks the CPU to bring the cache line holding `value` into its caches.
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        let p = std::ptr::from_ref(value).cast::<i8>();
        // SAFETY: a prefetch is a hint that never faults and reads nothing observable;
        // `p` points at a live value. SSE is part of the x86_64 baseline.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}
