//! vLLM's allocated blocks (`KVCacheBlocks.blocks`): the ids a load fills, read where
//! the load needs them and nowhere else.

use std::ops::Range;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::convert::block_id;

/// Each KV-cache group's block ids at positions `window` of `blocks`: a tuple of one
/// sequence of `KVCacheBlock`s per group, or the sequence of a model with one group.
pub(crate) fn allocated_windows(
    blocks: &Bound<'_, PyAny>,
    window: Range<usize>,
) -> PyResult<Vec<Vec<u32>>> {
    match blocks.cast::<PyTuple>() {
        Ok(groups) => groups
            .iter()
            .map(|g| window_ids(&g, window.clone()))
            .collect(),
        Err(_) => Ok(vec![window_ids(blocks, window)?]),
    }
}

/// The `block_id`s of `blocks` (a sequence of vLLM's `KVCacheBlock`) at positions
/// `window`, cut short where the sequence ends.
fn window_ids(blocks: &Bound<'_, PyAny>, window: Range<usize>) -> PyResult<Vec<u32>> {
    let end = window.end.min(blocks.len()?);
    let name = intern!(blocks.py(), "block_id");
    // A long prompt's hit is a hundred blocks or more: one allocation, and vLLM's
    // list indexed directly.
    let mut ids = Vec::with_capacity(end.saturating_sub(window.start));
    let list = blocks.cast::<PyList>().ok();
    for i in window.start..end {
        let block = match list {
            Some(list) => list.get_item(i)?,
            None => blocks.get_item(i)?,
        };
        ids.push(block_id(&block.getattr(name)?, "blocks")?);
    }
    Ok(ids)
}
