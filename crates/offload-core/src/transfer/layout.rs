//! Where every block lives: the regions on the device side, the region-major host layout,
//! and the checks that keep a job inside both.

use super::error::BlockSide;
use super::error::{BuildError, JobError};
use super::region::RegionSpec;
use super::types::{Direction, TransferJob};

/// Immutable geometry of an engine.
#[derive(Debug)]
pub(crate) struct Layout {
    pub(crate) regions: Vec<RegionSpec>,
    /// Byte offset of each region's CPU area in host memory.
    pub(crate) cpu_offsets: Vec<usize>,
    pub(crate) num_cpu_blocks: u32,
    pub(crate) cpu_block_bytes: usize,
    /// The smallest region's `num_blocks`: device ids must be below it in every region.
    pub(crate) gpu_limit: u32,
}

impl Layout {
    pub(crate) fn new(regions: Vec<RegionSpec>, num_cpu_blocks: u32) -> Result<Self, BuildError> {
        let gpu_limit = regions
            .iter()
            .map(RegionSpec::num_blocks)
            .min()
            .ok_or_else(|| BuildError::InvalidConfig {
                field: "regions",
                value: "[]".into(),
                reason: "at least one region is required",
            })?;
        if num_cpu_blocks == 0 {
            return Err(BuildError::InvalidConfig {
                field: "num_cpu_blocks",
                value: "0".into(),
                reason: "must be > 0",
            });
        }
        let too_large = || BuildError::InvalidConfig {
            field: "num_cpu_blocks",
            value: num_cpu_blocks.to_string(),
            reason: "num_cpu_blocks * cpu_block_bytes overflows usize",
        };
        let mut cpu_offsets = Vec::with_capacity(regions.len());
        let mut offset = 0usize;
        for region in &regions {
            cpu_offsets.push(offset);
            let area = region
                .block_bytes()
                .checked_mul(num_cpu_blocks as usize)
                .ok_or_else(too_large)?;
            offset = offset.checked_add(area).ok_or_else(too_large)?;
        }
        let cpu_block_bytes = regions.iter().map(RegionSpec::block_bytes).sum();
        Ok(Self {
            regions,
            cpu_offsets,
            num_cpu_blocks,
            cpu_block_bytes,
            gpu_limit,
        })
    }

    pub(crate) fn host_len(&self) -> usize {
        // Cannot overflow: `new` checked every partial sum.
        self.cpu_block_bytes * self.num_cpu_blocks as usize
    }

    /// Words of the scratch bitset [`validate`] needs.
    pub(crate) fn id_bitset_words(&self) -> usize {
        (self.num_cpu_blocks.max(self.gpu_limit) as usize).div_ceil(64)
    }
}

/// Checks every id of `job` before anything is copied, so an invalid job copies nothing.
/// `seen` is a bitset over ids ([`Layout::id_bitset_words`] words), all zero on entry and on
/// return.
pub(crate) fn validate(
    layout: &Layout,
    job: &TransferJob,
    seen: &mut [u64],
) -> Result<(), JobError> {
    for &(gpu, cpu) in &job.pairs {
        if gpu >= layout.gpu_limit {
            return Err(JobError::InvalidBlock {
                side: BlockSide::Gpu,
                id: gpu,
                limit: layout.gpu_limit,
            });
        }
        if cpu >= layout.num_cpu_blocks {
            return Err(JobError::InvalidBlock {
                side: BlockSide::Cpu,
                id: cpu,
                limit: layout.num_cpu_blocks,
            });
        }
    }
    // Two reads of one block are fine; two writes to one block would race on a device and
    // mean a planner bug on any backend.
    let side = match job.direction {
        Direction::Store => BlockSide::Cpu,
        Direction::Load => BlockSide::Gpu,
    };
    let destination = |&(gpu, cpu): &(u32, u32)| match side {
        BlockSide::Cpu => cpu,
        BlockSide::Gpu => gpu,
    };
    let mut duplicate = None;
    for pair in &job.pairs {
        let id = destination(pair) as usize;
        let (word, bit) = (id / 64, 1u64 << (id % 64));
        if seen[word] & bit != 0 {
            duplicate = Some(id as u32);
            break;
        }
        seen[word] |= bit;
    }
    for pair in &job.pairs {
        let id = destination(pair) as usize;
        seen[id / 64] = 0;
    }
    match duplicate {
        Some(id) => Err(JobError::DuplicateDestination { side, id }),
        None => Ok(()),
    }
}
