//! What `O_DIRECT` asks of memory: [`AlignedBuf`], a zeroed page-aligned buffer for
//! the slots' bounce copies, and [`DioAlign`], the alignment the kernel asks of a
//! transfer straight into other memory (a CPU block's slices).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::File;
use std::os::unix::io::AsRawFd;

use super::layout::ALIGN;

/// A zeroed buffer aligned for `O_DIRECT`.
pub(crate) struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// `len` bytes (a multiple of [`ALIGN`], non-zero), all zero.
    pub(crate) fn new(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (at least ALIGN).
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Self { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        // ALIGN is a power of two and len is bounded by the slot size; a failure here is
        // a bug in the geometry, not input.
        Layout::from_size_align(len.max(ALIGN as usize), ALIGN as usize)
            .unwrap_or_else(|_| Layout::new::<[u8; ALIGN as usize]>())
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialized (zeroed, then written) bytes while
        // self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with this same layout.
        unsafe { dealloc(self.ptr, Self::layout(self.len)) };
    }
}

/// What `O_DIRECT` asks of a transfer: memory addresses aligned to `mem`, file offsets
/// and each segment's length to `offset` (both powers of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DioAlign {
    pub mem: usize,
    pub offset: usize,
}

impl DioAlign {
    /// A page for both: what every file system that takes `O_DIRECT` accepts.
    pub(crate) const PAGE: Self = Self {
        mem: ALIGN as usize,
        offset: ALIGN as usize,
    };

    /// What the kernel reports for `file` (`statx` `STATX_DIOALIGN`, Linux 6.1+), a page
    /// where it reports nothing. A CPU block is one slice per layer region, often
    /// smaller than a page (2 KiB for a 64 KiB block of 32 layers), so asking the kernel
    /// is what lets those slices take the direct path.
    pub(crate) fn of(file: &File) -> Self {
        // SAFETY: statx is all zeros when empty (plain integers).
        let mut stx: libc::statx = unsafe { std::mem::zeroed() };
        // SAFETY: an empty path with AT_EMPTY_PATH names the descriptor we own; `stx` is
        // a valid, exclusively borrowed statx the kernel fills.
        let rc = unsafe {
            libc::statx(
                file.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                libc::STATX_DIOALIGN,
                &mut stx,
            )
        };
        let reported = rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0;
        let (mem, offset) = (
            stx.stx_dio_mem_align as usize,
            stx.stx_dio_offset_align as usize,
        );
        if !reported || !mem.is_power_of_two() || !offset.is_power_of_two() {
            return Self::PAGE;
        }
        Self { mem, offset }
    }

    /// Whether a segment at `ptr` of `len` bytes may be read or written directly.
    pub(crate) fn takes(&self, ptr: *const u8, len: usize) -> bool {
        (ptr as usize) % self.mem == 0 && len % self.offset == 0
    }

    /// Whether slots (on [`ALIGN`] boundaries, in pages) and page-aligned scratch buffers
    /// meet these demands, so a direct transfer into other memory is possible at all.
    pub(crate) fn fits_pages(&self) -> bool {
        self.mem <= ALIGN as usize && self.offset <= ALIGN as usize
    }
}
