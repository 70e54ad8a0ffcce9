//! Turning accepted hits into loads.

use crate::error::PlanError;
use crate::key::BlockId;

use super::kinds::GroupKind;
use super::ledger::{Job, JobKind};
use super::request::GroupHit;
use super::types::LoadJob;
use super::Planner;

impl Planner {
    /// The scheduler allocated GPU blocks for `req` and accepted `num_external_tokens`
    /// of its hit (possibly fewer than offered, possibly none).
    ///
    /// `gpu_blocks[g]` is KV-cache group `g`'s block table of the request, from token 0
    /// (null blocks included); `num_computed_tokens` is its GPU prefix hit, used only
    /// when no lookup result is pinned (the hit records where it starts).
    ///
    /// The load copies, in every group, each block vLLM allocated for the accepted
    /// tokens: all of them in full-attention groups, those inside the window of the
    /// hit's end in sliding-window groups, the block ending at the hit's end in Mamba
    /// groups (vLLM allocates that one, and nulls the earlier ones). An accepted hit
    /// becomes a load in the next [`StepPlan`](super::StepPlan); pins on the part not
    /// accepted are released (if the scheduler accepted fewer tokens than offered, a
    /// sliding-window group's window moves before the pinned blocks). A load asked for
    /// without a matching pinned hit becomes an invalid [`LoadJob`] that workers report
    /// failed, so the request is recomputed instead of waiting forever. A request never
    /// looked up that accepts nothing is not an error.
    pub fn on_alloc<B: AsRef<[u32]>>(
        &mut self,
        req: &str,
        gpu_blocks: &[B],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> Result<(), PlanError> {
        let w = self.alloc_window(req, num_computed_tokens, num_external_tokens);
        let window = |g: usize| {
            let t = gpu_blocks[g].as_ref();
            t.get(w.start..w.end.min(t.len())).unwrap_or_default()
        };
        self.load_windows(req, w.start, gpu_blocks.len(), window, num_external_tokens)
    }

    /// The positions of the block tables vLLM allocated for `req` that a load of
    /// `num_external_tokens` may fill, the only ones [`Self::on_alloc`] reads (from the
    /// pinned hit's first block, else `num_computed_tokens`' block).
    pub fn alloc_window(
        &self,
        req: &str,
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> std::ops::Range<usize> {
        let bs = self.block_size();
        let start = self
            .requests
            .get(req)
            .and_then(|r| r.hit.as_ref())
            .map_or(num_computed_tokens / bs, |h| h.start);
        start..start + num_external_tokens.div_ceil(bs)
    }

    /// [`Self::on_alloc`] given only each group's ids at [`Self::alloc_window`]
    /// (`windows[g]`, starting at block `window_start`; cut short where a table ends:
    /// the load is then reported failed), so a caller converting vLLM's blocks reads
    /// the window alone.
    pub fn on_alloc_window<B: AsRef<[u32]>>(
        &mut self,
        req: &str,
        window_start: usize,
        windows: &[B],
        num_external_tokens: usize,
    ) -> Result<(), PlanError> {
        let window = |g: usize| windows[g].as_ref();
        self.load_windows(
            req,
            window_start,
            windows.len(),
            window,
            num_external_tokens,
        )
    }

    /// [`Self::on_alloc_window`] with group `g`'s window given by `window(g)` for `g` in
    /// `0..num_windows`, so that [`Self::on_alloc`] slices the tables where they are
    /// instead of collecting the slices first.
    fn load_windows<'w>(
        &mut self,
        req: &str,
        window_start: usize,
        num_windows: usize,
        window: impl Fn(usize) -> &'w [u32],
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
        if num_windows != self.kinds.len() {
            return Err(PlanError::GroupMismatch {
                req_id: req.to_string(),
                expected: self.kinds.len(),
                got: num_windows,
            });
        }
        let r = self
            .requests
            .get_mut(req)
            .ok_or_else(|| PlanError::UnknownRequest(req.to_string()))?;
        let mut hit = r.hit.take().unwrap_or_default();
        let start = window_start;
        let end = start + num_external_tokens.div_ceil(bs);
        // Each group's accepted part: where it lies in the group's pinned blocks and in
        // its window of the table. The lookup of this scheduling pass vouched that the
        // pinned blocks are ready (pins keep them so).
        let parts = |kind: &GroupKind, ghit: &GroupHit, window: &[u32]| {
            let first = kind.first_needed(start, end, bs);
            let pinned = first.checked_sub(ghit.from)?..end.checked_sub(ghit.from)?;
            let allocated = first - start..end - start;
            (pinned.end <= ghit.blocks.len() && allocated.end <= window.len())
                .then_some((pinned, allocated))
        };
        let valid = num_external_tokens % bs == 0
            && hit.groups.len() == self.kinds.len()
            && hit.start == start
            && end <= hit.end
            && self
                .kinds
                .iter()
                .zip(&hit.groups)
                .enumerate()
                .all(|(g, (kind, ghit))| parts(kind, ghit, window(g)).is_some());
        let mut gpu = Vec::new();
        let mut cpu: Vec<BlockId> = Vec::new();
        if valid {
            for (g, (kind, ghit)) in self.kinds.iter().zip(&mut hit.groups).enumerate() {
                let window = window(g);
                let Some((pinned, allocated)) = parts(kind, ghit, window) else {
                    continue;
                };
                // Pins outside the accepted part are released; the part itself is moved.
                for &b in ghit.blocks[pinned.end..]
                    .iter()
                    .chain(&ghit.blocks[..pinned.start])
                {
                    let _ = self.cache.unpin(b);
                }
                ghit.blocks.truncate(pinned.end);
                ghit.blocks.drain(..pinned.start);
                if cpu.is_empty() {
                    cpu = std::mem::take(&mut ghit.blocks);
                } else {
                    cpu.extend_from_slice(&ghit.blocks);
                }
                gpu.extend_from_slice(&window[allocated]);
            }
        } else {
            log::warn!(
                "kvoffload: load of {num_external_tokens} tokens for request {req} has no \
                 matching CPU hit in every KV-cache group; reporting it failed so it is \
                 recomputed"
            );
            // Every group's blocks of the accepted range, so the server recomputes them all.
            for (g, kind) in self.kinds.iter().enumerate() {
                let from = kind.first_needed(start, end, bs) - start;
                gpu.extend(window(g).get(from..).unwrap_or_default());
            }
            hit.unpin_all(&mut self.cache);
        }
        self.push_load(req, gpu, cpu, valid, num_external_tokens);
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
