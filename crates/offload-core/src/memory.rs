//! Host memory for the CPU side of the KV cache.
//!
//! The CPU block store is one anonymous mapping of exactly the size asked for. We do not use
//! torch's `pin_memory` allocator because it rounds up to a power of two, which can waste up
//! to half of a multi-GiB budget. The mapping is first-touched by several threads so that the
//! page faults (the dominant cost of a fresh 64 GiB mapping) are paid in parallel at
//! start-up instead of serially inside the first copies. Pinning for DMA is a device
//! backend's job and is not done here.

use std::ptr::NonNull;

/// Transparent huge pages are 2 MiB on every platform vLLM runs on; aligning the mapping to
/// it lets the kernel back the whole region with huge pages instead of only its interior.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Below this many pages per thread, spawning a thread costs more than the faults it saves.
const MIN_PAGES_PER_TOUCH_THREAD: usize = 256;

/// Upper bound on first-touch threads: past this, page faulting is limited by the kernel's
/// memory-management locks rather than by cores.
const MAX_TOUCH_THREADS: usize = 8;

/// Errors from allocating host memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// A mapping of zero bytes was asked for (a zero-block pool or zero-byte blocks).
    #[error("host memory size must be non-zero, asked for {size} bytes")]
    ZeroSize {
        /// The size asked for (always 0).
        size: usize,
    },
    /// The size, plus the slack needed for huge-page alignment, does not fit in the address
    /// space.
    #[error("host memory size {size} bytes is too large to map")]
    TooLarge {
        /// The size asked for.
        size: usize,
    },
    /// `mmap` failed, usually `ENOMEM` because the budget exceeds what the machine can give.
    #[error("mmap of {size} bytes failed: errno {errno} ({})", errno_text(.errno))]
    Map {
        /// The size asked for.
        size: usize,
        /// The `errno` reported by `mmap`.
        errno: i32,
    },
}

fn errno_text(errno: &i32) -> String {
    std::io::Error::from_raw_os_error(*errno).to_string()
}

/// How to allocate a [`HostMemory`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMemoryOptions {
    /// Align the mapping to 2 MiB and advise `MADV_HUGEPAGE` (the default). Failure to
    /// advise (THP disabled) is logged and ignored: huge pages are an optimisation, never a
    /// requirement. They matter most for direct disk I/O into the blocks: a device request
    /// takes a bounded number of physically contiguous segments (254 on a virtio disk), so
    /// a 64 KiB layer slice on 4 KiB pages is up to 16 segments and a 4 MiB read is split
    /// in five requests, where on 2 MiB pages it is one segment and one request (the disk
    /// bench, `benches/disk.rs`, shows the difference at 2 MiB blocks). Copies in and out
    /// of the pool miss the TLB less too.
    pub hugepages: bool,
    /// Fault every page in at allocation time. Turn off only for tests or for callers that
    /// will touch the memory themselves.
    pub first_touch: bool,
    /// Threads used for the first touch; `None` means `min(available_parallelism, 8)`.
    pub touch_threads: Option<usize>,
}

impl Default for HostMemoryOptions {
    fn default() -> Self {
        Self {
            hugepages: true,
            first_touch: true,
            touch_threads: None,
        }
    }
}

/// An exact-size, page-aligned, anonymous private mapping, unmapped on drop.
///
/// It hands out raw pointers only: the memory is shared between the caller and the copy
/// thread, so who may touch which bytes when is decided by the owner (the transfer engine),
/// not by Rust references.
#[derive(Debug)]
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
    hugepages: bool,
}

// SAFETY: `HostMemory` owns its mapping exclusively (nothing else unmaps it) and exposes only
// raw pointers, whose use is `unsafe` for the caller. Moving the owner between threads, or
// sharing `&HostMemory` (which only reads `ptr`/`len`), cannot cause a data race by itself.
unsafe impl Send for HostMemory {}
// SAFETY: see the `Send` impl; no `&self` method reads or writes the mapped bytes.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Maps `len` bytes with the default options (first touch on, huge pages advised).
    pub fn new(len: usize) -> Result<Self, MemoryError> {
        Self::with_options(len, &HostMemoryOptions::default())
    }

    /// Maps `len` bytes of zeroed memory.
    pub fn with_options(len: usize, options: &HostMemoryOptions) -> Result<Self, MemoryError> {
        if len == 0 {
            return Err(MemoryError::ZeroSize { size: len });
        }
        let page = page_size();
        let rounded = len
            .checked_next_multiple_of(page)
            .ok_or(MemoryError::TooLarge { size: len })?;
        let align = options.hugepages && rounded >= HUGE_PAGE_BYTES;
        let ptr = if align {
            map_aligned(len, rounded, HUGE_PAGE_BYTES, page)?
        } else {
            map_anonymous(rounded).map_err(|errno| MemoryError::Map { size: len, errno })?
        };
        let mut mem = Self {
            ptr,
            len,
            hugepages: false,
        };
        if options.hugepages {
            // SAFETY: `ptr..ptr+rounded` is exactly the mapping we just created and own.
            let rc = unsafe {
                libc::madvise(
                    mem.ptr.as_ptr().cast::<libc::c_void>(),
                    rounded,
                    libc::MADV_HUGEPAGE,
                )
            };
            if rc == 0 {
                mem.hugepages = true;
            } else {
                log::debug!(
                    "madvise(MADV_HUGEPAGE) on {len} bytes failed ({}); using normal pages",
                    std::io::Error::last_os_error()
                );
            }
        }
        if options.first_touch {
            let threads = options
                .touch_threads
                .unwrap_or_else(default_touch_threads)
                .max(1);
            first_touch(mem.ptr, rounded, page, threads);
        }
        log::debug!(
            "mapped {len} bytes of host memory at {:p} (hugepages advised: {})",
            mem.ptr,
            mem.hugepages
        );
        Ok(mem)
    }

    /// Start of the mapping (page aligned; 2 MiB aligned when huge pages were asked for and
    /// the size is at least 2 MiB).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the mapping, for writing. Writes must follow the owner's rules about which
    /// bytes are in flight; nothing here synchronises them.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Exactly the size asked for (the kernel backs the last page in full).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: a zero-size mapping is refused at construction.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `MADV_HUGEPAGE` was accepted by the kernel.
    pub fn hugepages(&self) -> bool {
        self.hugepages
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: we own the mapping `ptr..ptr+len` (rounded up to a page by the kernel) and
        // nobody can use it after drop: the owner guarantees no copy is in flight, which is
        // why the transfer engine keeps its memory alive until the copy thread exits.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast::<libc::c_void>(), self.len) };
        if rc != 0 {
            log::debug!(
                "munmap of {} bytes at {:p} failed: {}",
                self.len,
                self.ptr,
                std::io::Error::last_os_error()
            );
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

fn default_touch_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(MAX_TOUCH_THREADS)
}

/// Maps `len` bytes (a multiple of the page size) or returns `errno`.
fn map_anonymous(len: usize) -> Result<NonNull<u8>, i32> {
    // SAFETY: a fresh anonymous private mapping at a kernel-chosen address aliases nothing.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    NonNull::new(ptr.cast::<u8>()).ok_or(0)
}

/// Maps `rounded` bytes aligned to `align` by over-mapping and trimming both ends, so the
/// final mapping is still exactly `rounded` bytes.
fn map_aligned(
    len: usize,
    rounded: usize,
    align: usize,
    page: usize,
) -> Result<NonNull<u8>, MemoryError> {
    let padded = rounded
        .checked_add(align - page)
        .ok_or(MemoryError::TooLarge { size: len })?;
    let raw = map_anonymous(padded).map_err(|errno| MemoryError::Map { size: len, errno })?;
    let start = raw.as_ptr() as usize;
    let aligned = start.next_multiple_of(align);
    let head = aligned - start;
    let tail = padded - head - rounded;
    // SAFETY: `head` and `tail` are page multiples (both `start` and `align` are page
    // aligned) and lie inside the `padded` mapping we just created; the kept middle is
    // untouched.
    unsafe {
        if head > 0 {
            libc::munmap(raw.as_ptr().cast::<libc::c_void>(), head);
        }
        if tail > 0 {
            libc::munmap(
                raw.as_ptr().add(head + rounded).cast::<libc::c_void>(),
                tail,
            );
        }
    }
    // SAFETY: `head < padded`, so the result is inside the mapping and non-null.
    Ok(unsafe { NonNull::new_unchecked(raw.as_ptr().add(head)) })
}

/// Writes one byte per page, in parallel. The mapping is fresh and zeroed, so writing a zero
/// changes no contents; it only makes the kernel allocate the page now.
fn first_touch(ptr: NonNull<u8>, len: usize, page: usize, threads: usize) {
    let pages = len / page;
    let threads = threads.min(pages / MIN_PAGES_PER_TOUCH_THREAD).max(1);
    let pages_per_thread = pages.div_ceil(threads);
    // Raw pointers are not `Send`; the address is, and each thread only touches its own
    // disjoint page range.
    let base = ptr.as_ptr() as usize;
    std::thread::scope(|scope| {
        for t in 0..threads {
            let first = t * pages_per_thread;
            let last = ((t + 1) * pages_per_thread).min(pages);
            if first >= last {
                continue;
            }
            let work = move || touch_pages(base, page, first, last);
            let spawned = std::thread::Builder::new()
                .name("kvoffload-touch".into())
                .spawn_scoped(scope, work);
            if spawned.is_err() {
                // Out of threads is not a reason to fail the allocation; touch inline.
                touch_pages(base, page, first, last);
            }
        }
    });
}

fn touch_pages(base: usize, page: usize, first: usize, last: usize) {
    for p in first..last {
        // SAFETY: `p < pages`, so the byte is inside the mapping; ranges of different threads
        // are disjoint and nobody else holds the memory yet.
        unsafe { std::ptr::write_volatile((base + p * page) as *mut u8, 0) };
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn zero_size_is_an_error_naming_the_size() {
        let err = HostMemory::new(0).unwrap_err();
        assert_eq!(err, MemoryError::ZeroSize { size: 0 });
        assert!(err.to_string().contains("0 bytes"), "{err}");
    }

    #[test]
    fn exact_size_is_reported_and_memory_is_zeroed_and_writable() {
        let len = 3 * 4096 + 17;
        let mem = HostMemory::new(len).unwrap();
        assert_eq!(mem.len(), len);
        assert!(!mem.is_empty());
        // SAFETY: `mem` is ours alone and `len` bytes long.
        let bytes = unsafe { std::slice::from_raw_parts_mut(mem.as_mut_ptr(), len) };
        assert!(bytes.iter().all(|&b| b == 0));
        bytes.fill(0xAB);
        assert!(bytes.iter().all(|&b| b == 0xAB));
    }

    #[test]
    fn parallel_touch_covers_every_page() {
        let options = HostMemoryOptions {
            touch_threads: Some(4),
            ..HostMemoryOptions::default()
        };
        let len = 8 << 20;
        let mem = HostMemory::with_options(len, &options).unwrap();
        // SAFETY: `mem` is ours alone and `len` bytes long.
        let bytes = unsafe { std::slice::from_raw_parts(mem.as_ptr(), len) };
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn the_default_mapping_asks_for_huge_pages() {
        let mem = HostMemory::new(4 << 20).unwrap();
        assert_eq!(mem.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert!(mem.hugepages() || !thp_enabled());
    }

    /// Whether the kernel lets a mapping ask for transparent huge pages at all.
    fn thp_enabled() -> bool {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| !s.contains("[never]"))
    }

    #[test]
    fn hugepage_mapping_is_aligned_and_exact() {
        let options = HostMemoryOptions {
            hugepages: true,
            touch_threads: Some(2),
            ..HostMemoryOptions::default()
        };
        let len = (4 << 20) + 123;
        let mem = HostMemory::with_options(len, &options).unwrap();
        assert_eq!(mem.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert_eq!(mem.len(), len);
        // SAFETY: `mem` is ours alone and `len` bytes long.
        let bytes = unsafe { std::slice::from_raw_parts_mut(mem.as_mut_ptr(), len) };
        bytes[len - 1] = 7;
        assert_eq!(bytes[len - 1], 7);
    }

    #[test]
    fn impossible_size_is_a_map_error_naming_the_size() {
        let len = usize::MAX / 2;
        let options = HostMemoryOptions {
            first_touch: false,
            ..HostMemoryOptions::default()
        };
        let err = HostMemory::with_options(len, &options).unwrap_err();
        assert!(
            matches!(err, MemoryError::Map { size, .. } | MemoryError::TooLarge { size } if size == len),
            "{err:?}"
        );
        assert!(err.to_string().contains(&len.to_string()), "{err}");
    }

    #[test]
    fn no_touch_still_maps() {
        let options = HostMemoryOptions {
            first_touch: false,
            ..HostMemoryOptions::default()
        };
        let mem = HostMemory::with_options(1, &options).unwrap();
        assert_eq!(mem.len(), 1);
    }
}
