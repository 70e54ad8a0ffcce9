//! Prefix lookups (with pinning) and turning accepted hits into loads.

use crate::error::PlanError;
use crate::key::{BlockHash, BlockId, BlockKey};

use super::ledger::{Job, JobKind};
use super::request::Hit;
use super::types::{HashSource, LoadJob};
use super::{live_entry, Planner, GROUP};

/// Hashes converted per round in a fresh lookup: enough to pay the per-run costs once
/// for many blocks, few enough that a miss early in a chunk wastes little.
const PROBE_CHUNK: usize = 16;

impl Planner {
    /// Tokens of `req` that can be loaded from CPU after its first `num_computed_tokens`
    /// (its GPU prefix hit), given that the prompt has `num_tokens` tokens and the block
    /// hashes `hashes`. Creates the request on first use.
    ///
    /// The hit is the longest run of consecutive blocks whose stores completed, ends at
    /// least one token before the end (the last token is always recomputed), and is
    /// pinned until [`Self::on_alloc`] or [`Self::request_finished`]. Asking again is
    /// answered from the pinned result unless the GPU hit moved, the request's hashes
    /// changed, a failed load invalidated a pinned block, or the index gained the block
    /// after it.
    pub fn lookup<H: HashSource + ?Sized>(
        &mut self,
        req: &str,
        hashes: &H,
        num_tokens: usize,
        num_computed_tokens: usize,
    ) -> Result<usize, PlanError> {
        if let Some(kinds) = self.groups.clone() {
            return self.lookup_groups(req, hashes, num_tokens, num_computed_tokens, &kinds);
        }
        let bs = self.block_size();
        self.stats.lookups += 1;
        let r = live_entry(&mut self.requests, &mut self.next_serial, req);
        if num_computed_tokens % bs != 0 || self.cache.capacity() == 0 {
            r.release_hit(&mut self.cache);
            return Ok(0);
        }
        let start = num_computed_tokens / bs;
        let bad = |source| PlanError::BadHash {
            req_id: req.to_string(),
            source,
        };
        let need = num_tokens.saturating_sub(1) / bs;
        let limit = r
            .verify(hashes, need, &mut self.cache, &mut self.stats)
            .map_err(bad)?;
        if let Some(hit) = &r.hit {
            let end = hit.start + hit.blocks.len();
            // vLLM asks again every step while the request waits; its GPU hit may have
            // grown meanwhile. The pinned run stays valid: drop what the GPU now covers
            // and extend it only if the index gained the blocks after it.
            let same_run = match hit.last {
                Some(last) if end > 0 && end <= limit => hashes.hash(end - 1).map_err(bad)? == last,
                _ => true,
            };
            // A failed load elsewhere may have invalidated pinned blocks meanwhile.
            let still_ready = || hit.blocks.iter().all(|&b| self.cache.is_ready(b));
            if same_run
                && hit.num_tokens == num_tokens
                && hit.start <= start
                && start <= end
                && end <= limit
                && still_ready()
            {
                let covered = start - hit.start;
                let mut grew = Vec::new();
                let mut last = hit.last;
                for i in end..limit {
                    let h = r.hash_at(hashes, i).map_err(bad)?;
                    let Some(b) = self.cache.get_ready(&BlockKey::new(GROUP, h)) else {
                        break;
                    };
                    grew.push(b);
                    last = Some(h);
                }
                let Some(hit) = &mut r.hit else {
                    return Ok(0);
                };
                for b in hit.blocks.drain(..covered) {
                    let _ = self.cache.unpin(b);
                }
                hit.start = start;
                hit.last = last;
                if covered == 0 && grew.is_empty() {
                    self.stats.cached_lookups += 1;
                }
                for b in grew {
                    // The block is ready, hence in range and pinnable.
                    let _ = self.cache.pin(b);
                    hit.blocks.push(b);
                }
                return Ok(hit.blocks.len() * bs);
            }
        }
        r.release_hit(&mut self.cache);
        // Hashes are read from the first block the lookup needs, a chunk at a time, and
        // only until the chunk with the first miss. A prefix stored in one go sits in
        // consecutive CPU blocks, in prefix order (eager stores) or reversed (lazy stores
        // take blocks in the order vLLM frees them, a request's last block first): each
        // block is first looked for beside the previous hit, in the direction of the two
        // before (pool reads in order), and in the index only when it is not there.
        let mut blocks = Vec::new();
        let mut last = None;
        let mut guess = BlockId::MAX;
        let mut hs = [BlockHash::default(); PROBE_CHUNK];
        let mut i = start.min(limit);
        'chunks: while i < limit {
            // The first block alone: most lookups that miss, miss there, and converting
            // a chunk behind it would be wasted.
            let chunk = if blocks.is_empty() { 1 } else { PROBE_CHUNK };
            let n = (limit - i).min(chunk);
            r.hashes_into(hashes, i, &mut hs[..n]).map_err(bad)?;
            for h in &hs[..n] {
                let Some(b) = self.cache.get_ready_near(&BlockKey::new(GROUP, *h), guess) else {
                    break 'chunks;
                };
                if blocks.is_empty() {
                    // A hit: room for the rest of the prefix at once.
                    blocks.reserve(limit - i);
                    r.hashes.reserve(limit - i);
                }
                guess = match blocks.last() {
                    Some(&prev) if prev == b.wrapping_add(1) => b.wrapping_sub(1),
                    _ => b.wrapping_add(1),
                };
                // The block is ready, hence in range and pinnable.
                let _ = self.cache.pin(b);
                blocks.push(b);
                last = Some(*h);
            }
            i += n;
        }
        let tokens = blocks.len() * bs;
        r.hit = Some(Hit {
            start,
            num_tokens,
            blocks,
            last,
            groups: Vec::new(),
        });
        Ok(tokens)
    }

    /// The scheduler allocated GPU blocks for `req` and accepted `num_external_tokens`
    /// of its hit (possibly fewer than offered, possibly none).
    ///
    /// `gpu_blocks` are all of the request's GPU block ids, starting at token 0;
    /// `num_computed_tokens` is its GPU prefix hit, used only when no lookup result is
    /// pinned (the hit records where it starts). An accepted hit becomes a load in
    /// the next [`StepPlan`](super::StepPlan); pins on the part not accepted are released.
    /// A load asked for without a matching pinned hit becomes an invalid [`LoadJob`]
    /// that workers report failed, so the request is recomputed instead of waiting
    /// forever. A request never looked up that accepts nothing is not an error.
    pub fn on_alloc(
        &mut self,
        req: &str,
        gpu_blocks: &[u32],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> Result<(), PlanError> {
        if self.groups.is_some() {
            // One block table: right for a planner with one (sliding-window) group only.
            return self.on_alloc_groups(
                req,
                &[gpu_blocks],
                num_computed_tokens,
                num_external_tokens,
            );
        }
        let window = self
            .alloc_window(req, num_computed_tokens, num_external_tokens)
            .map_or(&[][..], |w| {
                let end = w.end.min(gpu_blocks.len());
                gpu_blocks.get(w.start..end).unwrap_or_default()
            });
        self.on_alloc_window(req, window, num_external_tokens)
    }

    /// The positions of the block table vLLM allocated for `req` that a load of
    /// `num_external_tokens` fills, the only ones [`Self::on_alloc`] reads (from the
    /// pinned hit's first block, else `num_computed_tokens`' block). `None` for planners
    /// with KV-cache groups, which read every group's table.
    pub fn alloc_window(
        &self,
        req: &str,
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> Option<std::ops::Range<usize>> {
        if self.groups.is_some() {
            return None;
        }
        let bs = self.block_size();
        let start = self
            .requests
            .get(req)
            .and_then(|r| r.hit.as_ref())
            .map_or(num_computed_tokens / bs, |h| h.start);
        Some(start..start + num_external_tokens.div_ceil(bs))
    }

    /// [`Self::on_alloc`] given only the table's ids at [`Self::alloc_window`] (cut
    /// short where the table ends: the load is then reported failed), so a caller
    /// converting vLLM's blocks reads the window alone.
    pub fn on_alloc_window(
        &mut self,
        req: &str,
        window: &[u32],
        num_external_tokens: usize,
    ) -> Result<(), PlanError> {
        let bs = self.block_size();
        self.remote_allocated(req);
        if num_external_tokens == 0 {
            if let Some(r) = self.requests.get_mut(req) {
                r.release_hit(&mut self.cache);
            }
            return Ok(());
        }
        let r = self
            .requests
            .get_mut(req)
            .ok_or_else(|| PlanError::UnknownRequest(req.to_string()))?;
        let k = num_external_tokens.div_ceil(bs);
        let mut hit = r.hit.take().unwrap_or_default();
        let valid = num_external_tokens % bs == 0 && k <= hit.blocks.len() && window.len() == k;
        let gpu = window.to_vec();
        let blocks = if valid {
            for b in hit.blocks.drain(k..) {
                let _ = self.cache.unpin(b);
            }
            std::mem::take(&mut hit.blocks)
        } else {
            log::warn!(
                "kvoffload: load of {num_external_tokens} tokens for request {req} has no \
                 matching CPU hit; reporting it failed so it is recomputed"
            );
            for b in hit.blocks.drain(..) {
                let _ = self.cache.unpin(b);
            }
            Vec::new()
        };
        self.push_load(req, gpu, blocks, valid, num_external_tokens);
        Ok(())
    }

    /// Queues the load of `blocks` into `gpu` for `req` (known to the planner) for the
    /// next plan, and records it in the ledger.
    pub(super) fn push_load(
        &mut self,
        req: &str,
        gpu: Vec<u32>,
        blocks: Vec<BlockId>,
        valid: bool,
        num_external_tokens: usize,
    ) {
        let id = self.ledger.next_id();
        self.stats.hit_tokens += num_external_tokens as u64;
        self.stats.load_blocks += blocks.len() as u64;
        let sync = self.cfg.sync_loads;
        let Some(r) = self.requests.get_mut(req) else {
            return;
        };
        // A synchronous load is over before the request's forward pass: the server never
        // waits on it, so it is not the request's business after this step.
        r.load_in_flight = !sync;
        self.pending_loads.push(LoadJob {
            id,
            req_id: req.to_string(),
            gpu_blocks: gpu.clone(),
            cpu_blocks: blocks.clone(),
            valid,
            sync,
        });
        let serial = r.serial;
        self.ledger.insert(
            id,
            Job::new(
                JobKind::Load {
                    req_id: req.to_string(),
                    serial,
                    blocks,
                    gpu_blocks: gpu,
                    sync,
                },
                !valid,
            ),
        );
    }
}
