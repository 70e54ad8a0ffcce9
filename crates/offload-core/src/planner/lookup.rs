//! Prefix lookups, with pinning: the longest hit every KV-cache group can serve.

use crate::cache::BlockCache;
use crate::error::{HashError, PlanError};
use crate::events::PlannerStats;
use crate::key::{BlockHash, BlockId, BlockKey};

use super::kinds::{group_id, GroupKind};
use super::request::{GroupHit, Hit, Request};
use super::types::HashSource;
use super::{live_entry, Planner};

/// Hashes converted per round in a fresh lookup: enough to pay the per-run costs once
/// for many blocks, few enough that a miss early in a chunk wastes little.
const PROBE_CHUNK: usize = 16;

/// Where a lookup runs: the request's first block after its GPU hit, the last block
/// the hit may reach, and the prompt length it answers for.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: usize,
    limit: usize,
    num_tokens: usize,
}

impl Planner {
    /// Tokens of `req` that can be loaded from CPU after its first `num_computed_tokens`
    /// (its GPU prefix hit), given that the prompt has `num_tokens` tokens and the block
    /// hashes `hashes`. Creates the request on first use.
    ///
    /// The hit is the longest run of blocks every KV-cache group can serve (see
    /// [`GroupKind`]) whose stores completed, ends at least one token before the end
    /// (the last token is always recomputed), and is pinned until [`Self::on_alloc`] or
    /// [`Self::request_finished`]. Asking again is answered from the pinned result
    /// unless the GPU hit moved, the request's hashes changed, a failed load invalidated
    /// a pinned block, or the index gained the block after it.
    pub fn lookup<H: HashSource + ?Sized>(
        &mut self,
        req: &str,
        hashes: &H,
        num_tokens: usize,
        num_computed_tokens: usize,
    ) -> Result<usize, PlanError> {
        let bs = self.block_size();
        self.stats.lookups += 1;
        let r = live_entry(&mut self.requests, &mut self.next_serial, req);
        if num_computed_tokens % bs != 0 || self.cache.capacity() == 0 {
            r.release_hit(&mut self.cache);
            return Ok(0);
        }
        let bad = |source| PlanError::BadHash {
            req_id: req.to_string(),
            source,
        };
        let need = num_tokens.saturating_sub(1) / bs;
        let limit = r
            .verify(hashes, need, &mut self.cache, &mut self.stats)
            .map_err(bad)?;
        let span = Span {
            start: num_computed_tokens / bs,
            limit,
            num_tokens,
        };
        let kinds = &self.kinds[..];
        if let Some(blocks) =
            reuse_pinned(r, hashes, span, kinds, &mut self.cache, &mut self.stats).map_err(bad)?
        {
            return Ok(blocks * bs);
        }
        r.release_hit(&mut self.cache);
        let blocks = fresh_hit(r, hashes, span, kinds, bs, &mut self.cache).map_err(bad)?;
        Ok(blocks * bs)
    }
}

/// The pinned result of an earlier lookup, if it still answers this one: the GPU hit
/// may have grown meanwhile (vLLM asks again every step while the request waits), so
/// what the GPU now covers is dropped, and the run is extended if the index gained the
/// blocks after it. Only where every group keeps every block: a window moves with the
/// hit's end. Returns the hit's length in blocks.
fn reuse_pinned<H: HashSource + ?Sized>(
    r: &mut Request,
    hashes: &H,
    span: Span,
    kinds: &[GroupKind],
    cache: &mut BlockCache,
    stats: &mut PlannerStats,
) -> Result<Option<usize>, HashError> {
    let Span {
        start,
        limit,
        num_tokens,
    } = span;
    let Some(hit) = &r.hit else {
        return Ok(None);
    };
    if !kinds.iter().all(|k| k.keeps_every_block()) {
        return Ok(None);
    }
    let end = hit.end;
    let same_run = match hit.last {
        Some(last) if end > 0 && end <= limit => hashes.hash(end - 1)? == last,
        _ => true,
    };
    // A failed load elsewhere may have invalidated pinned blocks meanwhile.
    let still_ready = || {
        hit.groups
            .iter()
            .all(|g| g.blocks.iter().all(|&b| cache.is_ready(b)))
    };
    if !(same_run
        && hit.num_tokens == num_tokens
        && hit.start <= start
        && start <= end
        && end <= limit
        && still_ready())
    {
        return Ok(None);
    }
    let covered = start - hit.start;
    let mut grew: Vec<BlockId> = Vec::new();
    let mut grown = 0;
    let mut last = hit.last;
    'blocks: for i in end..limit {
        let h = r.hash_at(hashes, i)?;
        let at = grew.len();
        for g in 0..kinds.len() {
            let Some(b) = cache.get_ready(&BlockKey::new(group_id(g), h)) else {
                grew.truncate(at);
                break 'blocks;
            };
            grew.push(b);
        }
        grown += 1;
        last = Some(h);
    }
    let Some(hit) = &mut r.hit else {
        return Ok(None);
    };
    if hit.groups.is_empty() && grown > 0 {
        hit.groups = vec![GroupHit::default(); kinds.len()];
    }
    for g in &mut hit.groups {
        for b in g.blocks.drain(..covered.min(g.blocks.len())) {
            let _ = cache.unpin(b);
        }
        g.from = start;
    }
    hit.start = start;
    hit.end += grown;
    hit.last = last;
    if covered == 0 && grown == 0 {
        stats.cached_lookups += 1;
    }
    for (i, b) in grew.into_iter().enumerate() {
        // The block is ready, hence in range and pinnable.
        let _ = cache.pin(b);
        hit.groups[i % kinds.len()].blocks.push(b);
    }
    Ok(Some(hit.end - start))
}

/// A lookup from scratch: pins and records the longest hit every group can serve and
/// returns its length in blocks.
///
/// Full-attention groups bound the hit by their longest stored run; the first one reads
/// hashes from the first block the lookup needs, a chunk at a time, and only until the
/// chunk with the first miss. A prefix stored in one go sits in consecutive CPU blocks,
/// in prefix order (eager stores) or reversed (lazy stores take blocks in the order vLLM
/// frees them, a request's last block first): each block is first looked for beside the
/// previous hit, in the direction of the two before (pool reads in order), and in the
/// index only when it is not there. The other groups then shorten the hit to the
/// longest one whose window (or state at its end) they have.
fn fresh_hit<H: HashSource + ?Sized>(
    r: &mut Request,
    hashes: &H,
    span: Span,
    kinds: &[GroupKind],
    bs: usize,
    cache: &mut BlockCache,
) -> Result<usize, HashError> {
    let Span {
        start,
        limit,
        num_tokens,
    } = span;
    // Hashes of blocks `start..start + hs.len()`, and each group's blocks from `start`
    // (`BlockId::MAX` where a windowed group has none).
    // Kept only when another group reads them.
    let mut hs: Vec<BlockHash> = Vec::new();
    let mut end = limit.max(start);
    let first_full = kinds.iter().position(|k| k.keeps_every_block());
    // A model of one full-attention group reads no hash past the probe.
    let other_groups = first_full.is_none() || kinds.len() > 1;
    let mut last = None;
    let first_run = match first_full {
        Some(g) => {
            let keep = other_groups.then_some(&mut hs);
            let run = probe_run(r, hashes, group_id(g), start, end, cache, keep, &mut last)?;
            end = start + run.len();
            run
        }
        None => Vec::new(),
    };
    // Empty when the first full-attention group has no run (nothing was pinned then).
    let mut groups: Vec<GroupHit> = Vec::new();
    if end > start {
        groups.resize_with(kinds.len(), || GroupHit {
            from: start,
            blocks: Vec::new(),
        });
        if let Some(g) = first_full {
            groups[g].blocks = first_run;
        }
    }
    if other_groups {
        for i in start + hs.len()..end {
            hs.push(r.hash_at(hashes, i)?);
        }
    }
    // The other full-attention groups bound the run further.
    for (g, kind) in kinds.iter().enumerate() {
        if end == start || !kind.keeps_every_block() || Some(g) == first_full {
            continue;
        }
        let run = &mut groups[g].blocks;
        for h in &hs[..end - start] {
            match cache.get_ready(&BlockKey::new(group_id(g), *h)) {
                Some(b) => run.push(b),
                None => break,
            }
        }
        end = start + run.len();
    }
    // Per sliding-window or Mamba group, where the blocks found are; then the longest
    // `n` whose window (or state at `n`) every group has.
    for (g, kind) in kinds.iter().enumerate() {
        if end == start || kind.keeps_every_block() {
            continue;
        }
        groups[g].blocks = hs[..end - start]
            .iter()
            .map(|h| {
                cache
                    .get_ready(&BlockKey::new(group_id(g), *h))
                    .unwrap_or(BlockId::MAX)
            })
            .collect();
    }
    let window_ok = |n: usize| {
        kinds.iter().zip(&groups).all(|(kind, g)| {
            kind.keeps_every_block()
                || (kind.first_needed(start, n, bs)..n).all(|i| g.blocks[i - start] != BlockId::MAX)
        })
    };
    let n = (start + 1..=end)
        .rev()
        .find(|&n| window_ok(n))
        .unwrap_or(start);
    // The first full-attention group's run was pinned as it was probed; the rest of its
    // blocks past the hit go back.
    if let Some(probed) = first_full.and_then(|g| groups.get(g)) {
        for &b in probed.blocks.get(n - start..).unwrap_or_default() {
            let _ = cache.unpin(b);
        }
    }
    if n == start {
        groups.clear();
    }
    for (i, (kind, g)) in kinds.iter().zip(&mut groups).enumerate() {
        g.from = kind.first_needed(start, n, bs);
        g.blocks.truncate(n - start);
        g.blocks.drain(..g.from - start);
        if Some(i) == first_full {
            continue;
        }
        for &b in &g.blocks {
            // The block is ready, hence in range and pinnable.
            let _ = cache.pin(b);
        }
    }
    r.hit = Some(Hit {
        start,
        end: n,
        num_tokens,
        last: if n == start {
            None
        } else if !other_groups {
            last
        } else {
            Some(hs[n - start - 1])
        },
        groups,
    });
    Ok(n - start)
}

/// The longest run of ready blocks of `group` at positions `start..limit`, read a chunk
/// at a time and pinned as found; their hashes are appended to `hs` if given, and the
/// last one is `last`.
#[allow(clippy::too_many_arguments)]
fn probe_run<H: HashSource + ?Sized>(
    r: &mut Request,
    hashes: &H,
    group: u32,
    start: usize,
    limit: usize,
    cache: &mut BlockCache,
    mut hs: Option<&mut Vec<BlockHash>>,
    last: &mut Option<BlockHash>,
) -> Result<Vec<BlockId>, HashError> {
    let mut blocks = Vec::new();
    let mut guess = BlockId::MAX;
    let mut chunk_hs = [BlockHash::default(); PROBE_CHUNK];
    let mut i = start;
    'chunks: while i < limit {
        // The first block alone: most lookups that miss, miss there, and converting
        // a chunk behind it would be wasted.
        let chunk = if blocks.is_empty() { 1 } else { PROBE_CHUNK };
        let n = (limit - i).min(chunk);
        r.hashes_into(hashes, i, &mut chunk_hs[..n])?;
        for h in &chunk_hs[..n] {
            let Some(b) = cache.get_ready_near(&BlockKey::new(group, *h), guess) else {
                break 'chunks;
            };
            if blocks.is_empty() {
                // A hit: room for the rest of the prefix at once.
                blocks.reserve(limit - i);
                if let Some(hs) = hs.as_deref_mut() {
                    hs.reserve(limit - i);
                }
                r.hashes.reserve(limit - i);
            }
            guess = match blocks.last() {
                Some(&prev) if prev == b.wrapping_add(1) => b.wrapping_sub(1),
                _ => b.wrapping_add(1),
            };
            // The block is ready, hence in range and pinnable.
            let _ = cache.pin(b);
            blocks.push(b);
            if let Some(hs) = hs.as_deref_mut() {
                hs.push(*h);
            }
            *last = Some(*h);
        }
        i += n;
    }
    Ok(blocks)
}
