//! Device-side regions and the coalescer that turns block-id pairs into byte ranges.

use super::error::RegionError;
use super::types::Direction;

/// One KV tensor (or one K/V half) on the device side: `num_blocks` blocks of `block_bytes`
/// each, `block_stride` bytes apart, block 0 at address `base`.
///
/// Construction is `unsafe` because this is where raw addresses (tensor data pointers from
/// Python) become trusted: every copy the engine does later is computed from these fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionSpec {
    base: u64,
    num_blocks: u32,
    block_bytes: usize,
    block_stride: usize,
}

impl RegionSpec {
    /// Describes a region of device (or, for the host backend, host) memory.
    ///
    /// Checks the shape only: `base != 0`, `num_blocks > 0`, `block_bytes > 0`,
    /// `block_stride >= block_bytes`, and that the last block ends inside the address space.
    ///
    /// # Safety
    ///
    /// For as long as any [`TransferEngine`](super::TransferEngine) built from this spec
    /// exists (and, if its `shutdown` timed out, until its copy thread has exited):
    /// - for every block id `i < num_blocks`, the `block_bytes` bytes at
    ///   `base + i * block_stride` must be valid for reads and writes by the engine's backend
    ///   (host memory for [`HostCopyBackend`](super::HostCopyBackend), device memory for a
    ///   device backend) and must not be freed or remapped, except between a
    ///   [`detach_regions`](super::TransferEngine::detach_regions) that returned `Ok` and the
    ///   next [`attach_regions`](super::TransferEngine::attach_regions);
    /// - while a job that reads or writes a block is in flight (submitted and its
    ///   [`Completion`](super::Completion) not yet received), nothing else may write that
    ///   block, nor read it if the job writes it (vLLM guarantees this by pinning the blocks
    ///   of in-flight requests);
    /// - the region must not overlap the engine's own host memory.
    pub unsafe fn new(
        base: u64,
        num_blocks: u32,
        block_bytes: usize,
        block_stride: usize,
    ) -> Result<Self, RegionError> {
        let bad = |reason: String| Err(RegionError { reason });
        if base == 0 {
            return bad("base address is null".into());
        }
        if num_blocks == 0 {
            return bad(format!("num_blocks must be > 0, got {num_blocks}"));
        }
        if block_bytes == 0 {
            return bad(format!("block_bytes must be > 0, got {block_bytes}"));
        }
        if block_stride < block_bytes {
            return bad(format!(
                "block_stride {block_stride} is smaller than block_bytes {block_bytes}"
            ));
        }
        let end = u64::from(num_blocks - 1)
            .checked_mul(block_stride as u64)
            .and_then(|last| last.checked_add(block_bytes as u64))
            .and_then(|extent| extent.checked_add(base));
        if end.is_none() {
            return bad(format!(
                "region at {base:#x} with {num_blocks} blocks of stride {block_stride} \
                 overflows the address space"
            ));
        }
        Ok(Self {
            base,
            num_blocks,
            block_bytes,
            block_stride,
        })
    }

    /// Address of block 0.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Number of device blocks; valid device ids are `0..num_blocks`.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Bytes of one block in this region (also its size in each CPU block).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Bytes between the starts of consecutive blocks.
    pub fn block_stride(&self) -> usize {
        self.block_stride
    }

    /// Whether every block of the region lies inside the `len` bytes starting at `start`
    /// (e.g. the storage of the tensor the region was derived from). A binding that cannot
    /// trust its caller's addresses checks this against an allocation it can vouch for.
    ///
    /// ```
    /// use offload_core::transfer::RegionSpec;
    ///
    /// // SAFETY: construction only; the spec is never handed to an engine.
    /// let spec = unsafe { RegionSpec::new(0x1000, 4, 64, 128) }.unwrap();
    /// assert!(spec.lies_within(0x1000, 3 * 128 + 64));
    /// assert!(!spec.lies_within(0x1000, 3 * 128 + 63));
    /// assert!(!spec.lies_within(0x1001, 4096));
    /// ```
    pub fn lies_within(&self, start: u64, len: usize) -> bool {
        // `new` checked that the extent does not overflow.
        let extent =
            u64::from(self.num_blocks - 1) * self.block_stride as u64 + self.block_bytes as u64;
        self.base >= start
            && (self.base - start)
                .checked_add(extent)
                .is_some_and(|end| end <= len as u64)
    }

    /// Whether consecutive device blocks are adjacent, so runs of them can be one copy.
    pub fn is_contiguous(&self) -> bool {
        self.block_stride == self.block_bytes
    }

    /// Address of device block `id`. Wrapping so that an unvalidated id computes a wrong
    /// address instead of panicking; the engine never uses an unvalidated id.
    fn block_addr(&self, id: u32) -> u64 {
        self.base
            .wrapping_add(u64::from(id).wrapping_mul(self.block_stride as u64))
    }
}

/// One contiguous copy of `len` bytes from `src` to `dst` (absolute addresses: device or
/// host depending on the [`Direction`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRun {
    /// Source address: device for [`Direction::Store`], host for [`Direction::Load`].
    pub src: u64,
    /// Destination address: host for [`Direction::Store`], device for [`Direction::Load`].
    pub dst: u64,
    /// Bytes to copy.
    pub len: usize,
}

/// A maximal run of pairs `(gpu + k, cpu + k)` for `k < count`, independent of any region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockRun {
    gpu: u32,
    cpu: u32,
    count: u32,
}

/// Groups `pairs`, in the order given, into maximal runs where both ids advance by one.
///
/// No sorting: the scheduler already emits a request's blocks in order, and sorting would
/// cost more than it merges for the scattered case.
pub(crate) fn group_consecutive(pairs: &[(u32, u32)], out: &mut Vec<BlockRun>) {
    let mut iter = pairs.iter();
    let Some(&(gpu, cpu)) = iter.next() else {
        return;
    };
    let mut run = BlockRun { gpu, cpu, count: 1 };
    for &(gpu, cpu) in iter {
        // `count` cannot exceed `pairs.len()`, and ids are u32, so the run end cannot
        // overflow before `checked_add` refuses to extend it.
        let next_gpu = run.gpu.checked_add(run.count);
        let next_cpu = run.cpu.checked_add(run.count);
        if next_gpu == Some(gpu) && next_cpu == Some(cpu) {
            run.count += 1;
        } else {
            out.push(run);
            run = BlockRun { gpu, cpu, count: 1 };
        }
    }
    out.push(run);
}

/// Appends the copies for one region. A run of blocks becomes one copy when the region is
/// contiguous on the device; a strided region needs one copy per block because the device
/// side has gaps (the CPU side is always contiguous).
pub(crate) fn emit_runs(
    region: &RegionSpec,
    cpu_area: u64,
    direction: Direction,
    groups: &[BlockRun],
    out: &mut Vec<CopyRun>,
) {
    let bytes = region.block_bytes;
    let cpu_addr = |id: u32| cpu_area.wrapping_add(u64::from(id).wrapping_mul(bytes as u64));
    let mut push = |gpu: u64, cpu: u64, len: usize| {
        out.push(match direction {
            Direction::Store => CopyRun {
                src: gpu,
                dst: cpu,
                len,
            },
            Direction::Load => CopyRun {
                src: cpu,
                dst: gpu,
                len,
            },
        });
    };
    for run in groups {
        if region.is_contiguous() {
            let len = (run.count as usize).saturating_mul(bytes);
            push(region.block_addr(run.gpu), cpu_addr(run.cpu), len);
        } else {
            for k in 0..run.count {
                push(
                    region.block_addr(run.gpu.wrapping_add(k)),
                    cpu_addr(run.cpu.wrapping_add(k)),
                    bytes,
                );
            }
        }
    }
}

/// Appends to `out` the copies that move `pairs` of `(device block, CPU block)` for one
/// region whose CPU area starts at `cpu_area`, merging runs where both ids are consecutive.
///
/// This only computes addresses; it copies nothing and does not validate ids (the engine
/// validates every job before calling it). Pairs are taken in the order given: a run is
/// merged only if it is consecutive in that order.
pub fn coalesce(
    region: &RegionSpec,
    cpu_area: u64,
    direction: Direction,
    pairs: &[(u32, u32)],
    out: &mut Vec<CopyRun>,
) {
    let mut groups = Vec::new();
    group_consecutive(pairs, &mut groups);
    emit_runs(region, cpu_area, direction, &groups, out);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const GPU: u64 = 0x10_0000;
    const CPU: u64 = 0x80_0000;

    fn region(num_blocks: u32, bytes: usize, stride: usize) -> RegionSpec {
        // SAFETY: these tests only compute addresses; nothing is ever copied.
        unsafe { RegionSpec::new(GPU, num_blocks, bytes, stride) }.unwrap()
    }

    fn runs(r: &RegionSpec, dir: Direction, pairs: &[(u32, u32)]) -> Vec<CopyRun> {
        let mut out = Vec::new();
        coalesce(r, CPU, dir, pairs, &mut out);
        out
    }

    #[test]
    fn consecutive_pairs_merge_into_one_run() {
        let r = region(16, 100, 100);
        let got = runs(&r, Direction::Store, &[(2, 5), (3, 6), (4, 7)]);
        assert_eq!(
            got,
            vec![CopyRun {
                src: GPU + 200,
                dst: CPU + 500,
                len: 300
            }]
        );
    }

    #[test]
    fn load_swaps_source_and_destination() {
        let r = region(16, 100, 100);
        let got = runs(&r, Direction::Load, &[(2, 5), (3, 6)]);
        assert_eq!(
            got,
            vec![CopyRun {
                src: CPU + 500,
                dst: GPU + 200,
                len: 200
            }]
        );
    }

    #[test]
    fn non_consecutive_pairs_stay_separate() {
        let r = region(16, 10, 10);
        // gpu consecutive but cpu not, then cpu consecutive but gpu not.
        let got = runs(&r, Direction::Store, &[(0, 0), (1, 5), (7, 6)]);
        assert_eq!(got.len(), 3);
        assert_eq!(
            got[1],
            CopyRun {
                src: GPU + 10,
                dst: CPU + 50,
                len: 10
            }
        );
    }

    #[test]
    fn reversed_order_is_not_merged() {
        let r = region(16, 10, 10);
        let got = runs(&r, Direction::Store, &[(3, 3), (2, 2), (1, 1)]);
        assert_eq!(got.len(), 3);
        assert!(got.iter().all(|run| run.len == 10));
        assert_eq!(got[0].src, GPU + 30);
        assert_eq!(got[2].src, GPU + 10);
    }

    #[test]
    fn strided_region_copies_block_by_block() {
        let r = region(16, 10, 32);
        let got = runs(&r, Direction::Store, &[(1, 4), (2, 5)]);
        assert_eq!(
            got,
            vec![
                CopyRun {
                    src: GPU + 32,
                    dst: CPU + 40,
                    len: 10
                },
                CopyRun {
                    src: GPU + 64,
                    dst: CPU + 50,
                    len: 10
                },
            ]
        );
    }

    #[test]
    fn runs_split_and_resume() {
        let r = region(64, 8, 8);
        let got = runs(
            &r,
            Direction::Store,
            &[(0, 10), (1, 11), (5, 12), (6, 13), (7, 14)],
        );
        assert_eq!(
            got,
            vec![
                CopyRun {
                    src: GPU,
                    dst: CPU + 80,
                    len: 16
                },
                CopyRun {
                    src: GPU + 40,
                    dst: CPU + 96,
                    len: 24
                },
            ]
        );
    }

    #[test]
    fn empty_and_max_ids_do_not_panic() {
        let r = region(16, 8, 8);
        assert!(runs(&r, Direction::Store, &[]).is_empty());
        // u32::MAX followed by 0 must not be treated as consecutive.
        let got = runs(&r, Direction::Store, &[(u32::MAX, u32::MAX), (0, 0)]);
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn region_shape_errors_name_the_value() {
        // SAFETY: construction only; these specs are rejected or never used.
        let err = unsafe { RegionSpec::new(GPU, 4, 64, 32) }.unwrap_err();
        assert!(err.to_string().contains("block_stride 32"), "{err}");
        // SAFETY: as above.
        let err = unsafe { RegionSpec::new(0, 4, 64, 64) }.unwrap_err();
        assert!(err.to_string().contains("null"), "{err}");
        // SAFETY: as above.
        let err = unsafe { RegionSpec::new(GPU, 0, 64, 64) }.unwrap_err();
        assert!(err.to_string().contains("num_blocks"), "{err}");
        // SAFETY: as above.
        let err = unsafe { RegionSpec::new(GPU, 4, 0, 64) }.unwrap_err();
        assert!(err.to_string().contains("block_bytes"), "{err}");
        // SAFETY: as above.
        let err = unsafe { RegionSpec::new(u64::MAX - 10, 4, 64, 64) }.unwrap_err();
        assert!(err.to_string().contains("overflows"), "{err}");
    }
}
