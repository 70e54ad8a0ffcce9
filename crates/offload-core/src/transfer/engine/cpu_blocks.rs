//! The engine's CPU blocks as bytes, for callers other than the copy thread: whole blocks
//! for the remote tier ([`HostBlocks`]), and one region's slice of a block for tests and
//! debugging, only while no job is in flight.

use std::sync::Arc;

use super::super::error::BlockAccessError;
use super::super::host_blocks::HostBlocks;
use super::TransferEngine;

impl TransferEngine {
    /// Whole CPU blocks of this engine's host memory, for callers outside the copy thread
    /// (the remote tier); see [`HostBlocks`] for who may touch which block when.
    pub fn host_blocks(&self) -> HostBlocks {
        HostBlocks::new(Arc::clone(&self.layout), Arc::clone(&self.memory))
    }

    /// The bytes of CPU block `cpu_id` of region `region`, for tests and debugging.
    ///
    /// `&mut self` keeps new jobs from being submitted while the slice lives, and the call
    /// fails with [`BlockAccessError::Busy`] while any job is in flight, so the copy thread
    /// cannot be touching the bytes.
    pub fn cpu_block_slice(
        &mut self,
        region: usize,
        cpu_id: u32,
    ) -> Result<&[u8], BlockAccessError> {
        let (ptr, len) = self.idle_block(region, cpu_id)?;
        // SAFETY: `idle_block` checked the block lies inside our mapping and that no job is in
        // flight; `&mut self` prevents new ones until the borrow ends.
        Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
    }

    /// Mutable access to the bytes of CPU block `cpu_id` of region `region`, for tests and
    /// debugging. Same conditions as [`cpu_block_slice`](Self::cpu_block_slice).
    pub fn cpu_block_slice_mut(
        &mut self,
        region: usize,
        cpu_id: u32,
    ) -> Result<&mut [u8], BlockAccessError> {
        let (ptr, len) = self.idle_block(region, cpu_id)?;
        // SAFETY: as in `cpu_block_slice`; `&mut self` also makes this the only slice.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    fn idle_block(&self, region: usize, cpu_id: u32) -> Result<(*mut u8, usize), BlockAccessError> {
        let layout = &self.layout;
        let spec = layout
            .regions
            .get(region)
            .ok_or(BlockAccessError::NoSuchRegion {
                region,
                count: layout.regions.len(),
            })?;
        if cpu_id >= layout.num_cpu_blocks {
            return Err(BlockAccessError::InvalidBlock {
                id: cpu_id,
                limit: layout.num_cpu_blocks,
            });
        }
        let unfinished = self.shared.unfinished();
        if unfinished != 0 {
            return Err(BlockAccessError::Busy { unfinished });
        }
        let offset = layout.cpu_offsets[region] + cpu_id as usize * spec.block_bytes();
        // SAFETY: `offset + block_bytes <= host_len` by the layout's construction, so the
        // pointer stays inside the mapping.
        let ptr = unsafe { self.memory.as_mut_ptr().add(offset) };
        Ok((ptr, spec.block_bytes()))
    }
}
