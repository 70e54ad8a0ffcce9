//! Lazy mode's candidates on their way from vLLM's free queue to the planner.
//!
//! A candidate's key is parsed once, from vLLM's `BlockHashWithGroupId`, where the walk
//! reads it ([`super::free_queue`]), and goes to the planner without crossing back into
//! Python: Python holds a [`LazyCandidates`] handle and passes it on. KV events need
//! vLLM's own hash of each lazily stored block (the planner keys on its first 128 bits
//! only); with events on, the handle keeps the hash objects vLLM gave, and
//! [`LazyHashes`] hands each stored block's out once, with the plan that stores it.

use std::collections::HashMap;

use offload_core::{BlockHash, BlockKey, LazyCandidate};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::step::same_len;
use crate::convert::{block_id, type_name};
use crate::errors::INVALID_INPUT_ERROR;

/// vLLM's hash of one candidate GPU block, as vLLM keeps it.
pub(crate) type VllmHash = (u32, Py<PyAny>);

/// GPU blocks about to be evicted, for `Planner.offer_lazy` or the next `schedule*`
/// call, which take them (a second use finds none).
#[pyclass(module = "kvoffload._native", name = "LazyCandidates")]
#[derive(Debug, Default)]
pub(crate) struct LazyCandidates {
    blocks: Vec<LazyCandidate>,
    /// With events on: each block's id and vLLM's hash; empty otherwise.
    hashes: Vec<VllmHash>,
}

#[pymethods]
impl LazyCandidates {
    fn __len__(&self) -> usize {
        self.blocks.len()
    }

    /// The candidates' GPU block ids, in the order they are offered (least recently
    /// used first).
    #[getter]
    fn gpu_block_ids(&self) -> Vec<u32> {
        self.blocks.iter().map(|c| c.0).collect()
    }
}

impl LazyCandidates {
    pub(crate) fn new(blocks: Vec<LazyCandidate>, hashes: Vec<VllmHash>) -> Self {
        Self { blocks, hashes }
    }

    /// The candidates and, with events on, their hashes.
    pub(crate) fn into_parts(self) -> (Vec<LazyCandidate>, Vec<VllmHash>) {
        (self.blocks, self.hashes)
    }

    /// [`Self::into_parts`] of a handle, which is left empty; `None` takes nothing.
    pub(crate) fn take(
        candidates: Option<&Bound<'_, Self>>,
    ) -> (Vec<LazyCandidate>, Vec<VllmHash>) {
        candidates.map_or_else(Default::default, |c| {
            std::mem::take(&mut *c.borrow_mut()).into_parts()
        })
    }
}

/// Candidates from plain parallel lists of GPU block ids and their hashes (`bytes`
/// with `strip` trailing bytes of KV-cache group id), for callers that are not walking
/// vLLM's queue; the hashes are kept when `keep_hashes` (events on).
pub(crate) fn lazy_candidates(
    ids: Option<&Bound<'_, PyList>>,
    hashes: Option<&Bound<'_, PyList>>,
    strip: usize,
    keep_hashes: bool,
) -> PyResult<LazyCandidates> {
    let (Some(ids), Some(hashes)) = (ids, hashes) else {
        return Ok(LazyCandidates::default());
    };
    same_len(
        "lazy_gpu_block_ids and lazy_block_hashes",
        &[ids.len(), hashes.len()],
    )?;
    let mut blocks = Vec::with_capacity(ids.len());
    let mut kept = Vec::new();
    for (i, (id, h)) in ids.iter().zip(hashes.iter()).enumerate() {
        let key = candidate_key(&h, strip, || format!("lazy_block_hashes[{i}]"))?;
        let id = block_id(&id, "lazy_gpu_block_ids")?;
        blocks.push((id, key));
        if keep_hashes {
            kept.push((id, h.unbind()));
        }
    }
    Ok(LazyCandidates::new(blocks, kept))
}

/// The key of a lazy candidate's hash: vLLM's `BlockHashWithGroupId`, `bytes` whose last
/// `strip` bytes are the KV-cache group id (4 bytes, big-endian; group 0 without them).
/// `what` names the value in an error.
pub(crate) fn candidate_key(
    h: &Bound<'_, PyAny>,
    strip: usize,
    what: impl Fn() -> String,
) -> PyResult<BlockKey> {
    let b = h
        .cast::<PyBytes>()
        .map_err(|_| {
            INVALID_INPUT_ERROR.err(format!(
                "{}: block hash must be bytes, got {}",
                what(),
                type_name(h)
            ))
        })?
        .as_bytes();
    let hash = BlockHash::from_bytes(&b[..b.len().saturating_sub(strip)])
        .ok_or_else(|| INVALID_INPUT_ERROR.err(format!("{}: empty block hash", what())))?;
    let group = b
        .len()
        .checked_sub(strip)
        .and_then(|at| <[u8; 4]>::try_from(&b[at..]).ok())
        .map_or(0, u32::from_be_bytes);
    Ok(BlockKey::new(group, hash))
}

/// With events on: vLLM's hashes of the candidates offered since the last plan, until
/// that plan says which of them it stores.
#[derive(Debug, Default)]
pub(crate) struct LazyHashes {
    offered: Vec<VllmHash>,
}

impl LazyHashes {
    /// Whether no offered candidate's hash is kept.
    pub(crate) fn is_empty(&self) -> bool {
        self.offered.is_empty()
    }

    /// Keeps the hashes of candidates offered between steps.
    pub(crate) fn offer(&mut self, hashes: Vec<VllmHash>) {
        self.offered.extend(hashes);
    }

    /// Pairwise with a store's `gpu_blocks`: vLLM's hash of each lazy block (a `None`
    /// source), from the candidates `walked` for this plan or, older, those offered
    /// since the last one; `None` for the others. Empty when no candidate was kept (an
    /// eager planner, events off). What was offered is forgotten: a block offered and
    /// not stored may come back under another hash.
    pub(crate) fn for_store(
        &mut self,
        walked: Vec<VllmHash>,
        gpu_blocks: &[u32],
        sources: &[Option<(u32, u32)>],
    ) -> Vec<Option<Py<PyAny>>> {
        if walked.is_empty() && self.offered.is_empty() {
            return Vec::new();
        }
        let mut by_block: HashMap<u32, Py<PyAny>> = self.offered.drain(..).collect();
        by_block.extend(walked);
        gpu_blocks
            .iter()
            .zip(sources)
            .map(|(gpu, src)| match src {
                None => by_block.remove(gpu),
                Some(_) => None,
            })
            .collect()
    }

    /// Forgets what was offered (a plan without a store).
    pub(crate) fn clear(&mut self) {
        self.offered.clear();
    }
}
