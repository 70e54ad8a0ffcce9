//! vLLM's GPU free queue, read in place for lazy mode.
//!
//! Lazy mode stores the cached blocks about to be evicted: those in vLLM's
//! `FreeKVCacheBlockQueue`, a linked list of `KVCacheBlock` nodes. A request that
//! finishes frees a burst of a few hundred, and most of them are in the CPU tier already
//! (loaded from it, or stored before). Read here, a node costs a few attribute reads and
//! an index probe; the blocks the CPU tier lacks become [`LazyCandidates`], which Python
//! passes on to the planner without seeing their keys.

use offload_core::{BlockKey, Planner};
use pyo3::intern;
use pyo3::prelude::*;

use super::lazy::{candidate_key, LazyCandidates};
use crate::convert::block_id;

/// One walk: the last node examined (`None` when the walk examined none), whether it
/// stopped at the queue's tail, and the cached blocks the CPU tier neither holds nor is
/// storing, in queue order.
pub(crate) type Walk<'py> = (Option<Bound<'py, PyAny>>, bool, Bound<'py, LazyCandidates>);

/// Examines up to `limit` nodes from `start` on, stopping at `tail` (the queue's sentinel)
/// or at a node without a successor. A node's hash is vLLM's `BlockHashWithGroupId`:
/// `strip` trailing bytes are its KV-cache group id. Blocks without a hash are passed
/// over. The candidates keep vLLM's hash objects when `keep_hashes` (events on).
pub(crate) fn walk<'py>(
    planner: &mut Planner,
    start: Bound<'py, PyAny>,
    tail: &Bound<'py, PyAny>,
    limit: usize,
    strip: usize,
    keep_hashes: bool,
) -> PyResult<Walk<'py>> {
    let py = start.py();
    let mut node = start;
    let mut last = None;
    let mut cached: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>, BlockKey)> = Vec::new();
    for _ in 0..limit {
        if node.is(tail) || node.is_none() {
            break;
        }
        let hash = node.getattr(intern!(py, "_block_hash"))?;
        // vLLM's null block never joins the queue (the pool takes it out first and
        // `free_blocks` passes it over), nor does it get a hash.
        if !hash.is_none() {
            let key = candidate_key(&hash, strip, || {
                let id = node.getattr("block_id").map(|b| b.to_string());
                format!("free queue: GPU block {}", id.unwrap_or_default())
            })?;
            cached.push((node.clone(), hash, key));
        }
        let next = node.getattr(intern!(py, "next_free_block"))?;
        last = Some(std::mem::replace(&mut node, next));
    }
    let at_tail = node.is(tail);
    planner.retain_unstored(&mut cached, |c| &c.2);
    let mut blocks = Vec::with_capacity(cached.len());
    let mut hashes = Vec::with_capacity(if keep_hashes { cached.len() } else { 0 });
    for (block, hash, key) in cached {
        let id = block_id(
            &block.getattr(intern!(py, "block_id"))?,
            "free queue block_id",
        )?;
        blocks.push((id, key));
        if keep_hashes {
            hashes.push((id, hash.unbind()));
        }
    }
    let candidates = Bound::new(py, LazyCandidates::new(blocks, hashes))?;
    Ok((last, at_tail, candidates))
}
