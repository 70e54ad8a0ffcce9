//! [`HostBlocks`]: whole CPU blocks of an engine's host memory, read and written by
//! callers other than the copy thread (the remote tier's fetches and write-behind).
//!
//! A CPU block is one slice per region (the layout is region-major), so a block's bytes
//! are those slices concatenated in region order: the form the remote tier stores.

use std::sync::Arc;

use super::error::BlockAccessError;
use super::layout::Layout;
use crate::memory::HostMemory;

/// Access to whole CPU blocks; keeps the host memory mapped while it lives.
///
/// The engine's copy thread writes and reads the same memory, and nothing here can see
/// which blocks it is using: the caller's protocol must guarantee it. In kvoffload the
/// scheduler does: a block being fetched is reserved for that fetch (no copy uses it until
/// every rank reported the fetch), and a block is read for writing behind between its
/// store's completion and the report of that completion (no copy may reuse it before the
/// scheduler learns the store finished).
#[derive(Debug, Clone)]
pub struct HostBlocks {
    layout: Arc<Layout>,
    memory: Arc<HostMemory>,
}

impl HostBlocks {
    pub(crate) fn new(layout: Arc<Layout>, memory: Arc<HostMemory>) -> Self {
        Self { layout, memory }
    }

    /// Bytes of one CPU block over all regions.
    pub fn block_bytes(&self) -> usize {
        self.layout.cpu_block_bytes
    }

    /// Number of CPU blocks.
    pub fn num_blocks(&self) -> u32 {
        self.layout.num_cpu_blocks
    }

    fn check(&self, cpu_id: u32) -> Result<(), BlockAccessError> {
        if cpu_id >= self.layout.num_cpu_blocks {
            return Err(BlockAccessError::InvalidBlock {
                id: cpu_id,
                limit: self.layout.num_cpu_blocks,
            });
        }
        Ok(())
    }

    /// Each region's slice of block `cpu_id`: offset into host memory and length.
    fn parts(&self, cpu_id: u32) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.layout
            .regions
            .iter()
            .zip(&self.layout.cpu_offsets)
            .map(move |(r, off)| (off + cpu_id as usize * r.block_bytes(), r.block_bytes()))
    }

    /// Appends the bytes of block `cpu_id` to `out`.
    ///
    /// # Safety
    /// No thread may write block `cpu_id` during the call (see the type's docs).
    pub unsafe fn read_block(
        &self,
        cpu_id: u32,
        out: &mut Vec<u8>,
    ) -> Result<(), BlockAccessError> {
        self.check(cpu_id)?;
        out.reserve(self.block_bytes());
        for (offset, len) in self.parts(cpu_id) {
            // SAFETY: the layout keeps `offset + len` within the mapping (checked at its
            // construction, `cpu_id` checked above); the caller guarantees no writer.
            let part = unsafe { std::slice::from_raw_parts(self.memory.as_ptr().add(offset), len) };
            out.extend_from_slice(part);
        }
        Ok(())
    }

    /// Block `cpu_id`'s bytes as one mutable slice per region, in region order: the
    /// destination a fetch fills in place ([`RemoteTier::fetch_into`](crate::tier::RemoteTier::fetch_into)).
    ///
    /// # Safety
    /// While the slices live, no other thread may read or write block `cpu_id` and no
    /// other slice of it may be taken (see the type's docs).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn block_parts_mut(&self, cpu_id: u32) -> Result<Vec<&mut [u8]>, BlockAccessError> {
        self.check(cpu_id)?;
        Ok(self
            .parts(cpu_id)
            .map(|(offset, len)| {
                // SAFETY: the layout keeps `offset + len` within the mapping, which lives
                // as long as `self` (checked at its construction, `cpu_id` checked above);
                // regions' slices of one block never overlap, and the caller guarantees
                // these are the only references to the block while they live.
                unsafe { std::slice::from_raw_parts_mut(self.memory.as_mut_ptr().add(offset), len) }
            })
            .collect())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::transfer::{RegionSpec, TransferConfig, TransferEngine};

    #[test]
    fn blocks_are_the_regions_slices_in_order_and_bad_ids_are_refused() {
        let mut device = vec![0u8; 2 * 4 * 8];
        let base = device.as_mut_ptr() as u64;
        // SAFETY: `device` outlives the engine and no job is submitted.
        let regions = unsafe {
            vec![
                RegionSpec::new(base, 4, 8, 8).unwrap(),
                RegionSpec::new(base + 32, 4, 4, 4).unwrap(),
            ]
        };
        let mut engine = TransferEngine::new(regions, 3, TransferConfig::default()).unwrap();
        let blocks = engine.host_blocks();
        assert_eq!((blocks.block_bytes(), blocks.num_blocks()), (12, 3));
        let data: Vec<u8> = (1..=12).collect();
        // SAFETY: no job is in flight and no other thread uses the blocks; each block's
        // slices are dropped before the block is touched again.
        unsafe {
            let mut parts = blocks.block_parts_mut(2).unwrap();
            assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), [8, 4]);
            parts[0].copy_from_slice(&data[..8]);
            parts[1].copy_from_slice(&data[8..]);
            drop(parts);
            assert!(matches!(
                blocks.block_parts_mut(3),
                Err(BlockAccessError::InvalidBlock { id: 3, limit: 3 })
            ));
            let mut out = vec![0xee];
            blocks.read_block(2, &mut out).unwrap();
            assert_eq!(out[1..], data[..]);
            assert!(blocks.read_block(3, &mut out).is_err());
        }
        assert_eq!(engine.cpu_block_slice(0, 2).unwrap(), &data[..8]);
        assert_eq!(engine.cpu_block_slice(1, 2).unwrap(), &data[8..]);
        drop(engine);
        drop(device);
    }
}
