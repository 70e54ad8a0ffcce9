//! Turning a job's runs into driver copies and enqueueing them on a stream. Knows the
//! driver, not the backend that owns the stream.

use super::super::{CopyRun, Direction};
use super::driver::CudaDriver;
use super::sys;
use super::{BatchApi, CudaError, MAX_BATCH_COPIES};

/// One copy as handed to the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Descriptor {
    src: u64,
    dst: u64,
    len: usize,
}

/// One job's copies as the driver takes them, and the arrays a batch call reads them from;
/// kept between jobs so that a submit allocates nothing once they have grown.
#[derive(Debug, Default)]
pub(super) struct Copies {
    descriptors: Vec<Descriptor>,
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
}

impl Copies {
    /// Replaces the copies with those of `runs` (see [`build_descriptors`]).
    pub(super) fn build(
        &mut self,
        runs: &[CopyRun],
        direction: Direction,
        host: Option<(u64, usize, usize)>,
    ) {
        build_descriptors(runs, direction, host, &mut self.descriptors);
    }

    /// Whether the job copies no byte.
    pub(super) fn is_empty(&self) -> bool {
        self.descriptors.is_empty()
    }

    /// Enqueues the copies on `stream` with `batch`: batch calls of at most
    /// [`MAX_BATCH_COPIES`], or one `cuMemcpyAsync` each. On failure, copies before the
    /// failing one may be enqueued.
    ///
    /// # Safety
    ///
    /// The copies must satisfy [`CopyBackend::submit`](super::super::CopyBackend::submit)'s
    /// contract, and `stream` must be a live stream of `driver`'s current context.
    pub(super) unsafe fn enqueue(
        &mut self,
        driver: &CudaDriver,
        batch: BatchApi,
        stream: sys::CUstream,
    ) -> Result<(), CudaError> {
        let api = driver.api;
        match batch {
            BatchApi::Unavailable => {
                for (i, d) in self.descriptors.iter().enumerate() {
                    // SAFETY: the caller vouches for the addresses; the stream is ours.
                    let rc = unsafe { (api.memcpy_async)(d.dst, d.src, d.len, stream) };
                    if rc != sys::CUDA_SUCCESS {
                        return Err(driver.error(
                            format!(
                                "cuMemcpyAsync (copy {i} of {}, {} bytes)",
                                self.descriptors.len(),
                                d.len
                            ),
                            rc,
                        ));
                    }
                }
                Ok(())
            }
            BatchApi::Cuda12_8 | BatchApi::Cuda13 => {
                self.dsts.clear();
                self.srcs.clear();
                self.sizes.clear();
                for d in &self.descriptors {
                    self.dsts.push(d.dst);
                    self.srcs.push(d.src);
                    self.sizes.push(d.len);
                }
                let count = self.descriptors.len();
                let mut attrs = [sys::CUmemcpyAttributes {
                    // Stores read device blocks that the compute stream may still write
                    // until the waited-on event: the source must be read in stream order.
                    srcAccessOrder: sys::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                    srcLocHint: sys::CUmemLocation {
                        type_: sys::CU_MEM_LOCATION_TYPE_INVALID,
                        id: 0,
                    },
                    dstLocHint: sys::CUmemLocation {
                        type_: sys::CU_MEM_LOCATION_TYPE_INVALID,
                        id: 0,
                    },
                    flags: sys::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
                }];
                let mut attr_idx = [0usize];
                for start in (0..count).step_by(MAX_BATCH_COPIES) {
                    let n = MAX_BATCH_COPIES.min(count - start);
                    let mut fail_idx = usize::MAX;
                    // SAFETY: `start + n <= count`, the length of all three arrays.
                    let (dsts, srcs, sizes) = unsafe {
                        (
                            self.dsts.as_mut_ptr().add(start),
                            self.srcs.as_mut_ptr().add(start),
                            self.sizes.as_mut_ptr().add(start),
                        )
                    };
                    let rc = match (batch, api.memcpy_batch_v1, api.memcpy_batch_v2) {
                        // SAFETY: the three pointers address `n` entries each and
                        // `attrs`/`attr_idx` one each, all alive for the call (the driver
                        // copies them before returning); the caller vouches for the
                        // addresses.
                        (BatchApi::Cuda12_8, Some(f), _) => unsafe {
                            f(
                                dsts,
                                srcs,
                                sizes,
                                n,
                                attrs.as_mut_ptr(),
                                attr_idx.as_mut_ptr(),
                                1,
                                &mut fail_idx,
                                stream,
                            )
                        },
                        // SAFETY: as above.
                        (BatchApi::Cuda13, _, Some(f)) => unsafe {
                            f(
                                dsts,
                                srcs,
                                sizes,
                                n,
                                attrs.as_mut_ptr(),
                                attr_idx.as_mut_ptr(),
                                1,
                                stream,
                            )
                        },
                        // `choose_batch_api` only picks a variant whose symbol resolved.
                        _ => sys::CUDA_ERROR_NOT_FOUND,
                    };
                    if rc != sys::CUDA_SUCCESS {
                        let at = if fail_idx < n {
                            format!(", failed at copy {}", start + fail_idx)
                        } else {
                            String::new()
                        };
                        return Err(driver.error(
                            format!(
                                "{} (copies {start}..{} of {count}{at})",
                                batch.symbol(),
                                start + n
                            ),
                            rc,
                        ));
                    }
                }
                Ok(())
            }
        }
    }
}

/// Turns `runs` into driver copies: merges runs adjacent on both sides, and splits at the
/// boundaries of the host memory's pinned chunks (`host`: base, length, chunk size), since
/// one DMA must not span two registrations. Zero-length runs are dropped.
fn build_descriptors(
    runs: &[CopyRun],
    direction: Direction,
    host: Option<(u64, usize, usize)>,
    out: &mut Vec<Descriptor>,
) {
    out.clear();
    // Index of the pinned chunk holding host address `addr`, if it is in host memory.
    let chunk_of = |addr: u64| -> Option<u64> {
        let (base, len, chunk) = host?;
        let rel = addr.checked_sub(base)?;
        (rel < len as u64).then(|| rel / chunk.max(1) as u64)
    };
    let host_side = |d: &Descriptor| match direction {
        Direction::Store => d.dst,
        Direction::Load => d.src,
    };
    for run in runs {
        let mut done = 0usize;
        while done < run.len {
            let mut piece = Descriptor {
                src: run.src.wrapping_add(done as u64),
                dst: run.dst.wrapping_add(done as u64),
                len: run.len - done,
            };
            if let (Some((base, _, chunk)), Some(index)) = (host, chunk_of(host_side(&piece))) {
                let chunk_end = base
                    .saturating_add((index + 1).saturating_mul(chunk as u64))
                    .saturating_sub(host_side(&piece));
                piece.len = piece
                    .len
                    .min(usize::try_from(chunk_end).unwrap_or(usize::MAX));
            }
            done += piece.len;
            if let Some(last) = out.last_mut() {
                let adjacent = last.src.wrapping_add(last.len as u64) == piece.src
                    && last.dst.wrapping_add(last.len as u64) == piece.dst;
                let same_chunk = chunk_of(host_side(last))
                    == chunk_of(host_side(&piece).wrapping_add(piece.len as u64 - 1));
                if adjacent && same_chunk {
                    last.len += piece.len;
                    continue;
                }
            }
            out.push(piece);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn run(src: u64, dst: u64, len: usize) -> CopyRun {
        CopyRun { src, dst, len }
    }

    fn descs(
        runs: &[CopyRun],
        dir: Direction,
        host: Option<(u64, usize, usize)>,
    ) -> Vec<(u64, u64, usize)> {
        let mut out = Vec::new();
        build_descriptors(runs, dir, host, &mut out);
        out.iter().map(|d| (d.src, d.dst, d.len)).collect()
    }

    #[test]
    fn adjacent_runs_merge_and_others_do_not() {
        let runs = [
            run(0, 1000, 10),
            run(10, 1010, 5),
            run(20, 1015, 5),
            run(25, 1020, 0),
        ];
        assert_eq!(
            descs(&runs, Direction::Store, None),
            [(0, 1000, 15), (20, 1015, 5)]
        );
    }

    #[test]
    fn host_side_is_split_at_pin_chunks() {
        // Host memory at 4096, 3 chunks of 4096 bytes; a store writing host addresses
        // 8096..12096 crosses the boundary at 8192.
        let host = Some((4096u64, 3 * 4096usize, 4096usize));
        let runs = [run(0x10_0000, 4096 + 4000, 4000)];
        assert_eq!(
            descs(&runs, Direction::Store, host),
            [(0x10_0000, 8096, 96), (0x10_0000 + 96, 8192, 3904)]
        );
        // A load reads the host side: same split, applied to the source.
        let runs = [run(4096 + 4000, 0x10_0000, 4000)];
        assert_eq!(
            descs(&runs, Direction::Load, host),
            [(8096, 0x10_0000, 96), (8192, 0x10_0000 + 96, 3904)]
        );
        // Adjacent runs meeting at a boundary stay separate.
        let runs = [run(0, 4096, 4096), run(4096, 8192, 4096)];
        assert_eq!(descs(&runs, Direction::Store, host).len(), 2);
        // Within one chunk they merge.
        let runs = [run(0, 4096, 100), run(100, 4196, 100)];
        assert_eq!(descs(&runs, Direction::Store, host), [(0, 4096, 200)]);
    }
}
