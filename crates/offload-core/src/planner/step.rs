//! The step loop behind [`Planner::schedule`], and the block tables a scheduled request
//! brings ([`GroupTables`]).

use crate::error::PlanError;

use super::kinds::GroupKind;
use super::request::Request;
use super::select::{select_eager, select_lazy};
use super::types::{HashSource, LazyCandidate, ScheduleKind, ScheduledRequest, StepPlan};
use super::{live_entry, Planner};

/// A scheduled request's GPU block tables, one per KV-cache group: a `Vec<Vec<u32>>`
/// (`[g]`: group `g`'s table), or a `Vec<u32>`, the one table of a model with one group.
/// Positions a group does not hold carry the server's null block id; they are never read.
pub trait GroupTables {
    /// Number of tables (0: none, the request brings no blocks).
    fn num_tables(&self) -> usize;
    /// Calls `f(g, table)` for each group's table.
    fn for_each_table(self, f: impl FnMut(usize, Vec<u32>));
}

impl GroupTables for Vec<u32> {
    fn num_tables(&self) -> usize {
        1
    }

    fn for_each_table(self, mut f: impl FnMut(usize, Vec<u32>)) {
        f(0, self);
    }
}

impl GroupTables for Vec<Vec<u32>> {
    fn num_tables(&self) -> usize {
        self.len()
    }

    fn for_each_table(self, mut f: impl FnMut(usize, Vec<u32>)) {
        for (g, t) in self.into_iter().enumerate() {
            f(g, t);
        }
    }
}

/// Records a scheduled request's `tables` in `r`: the whole table of a new or resumed
/// request, the added blocks of a running one, allocated with `computed` tokens computed.
fn record<B: GroupTables>(
    r: &mut Request,
    tables: B,
    kind: ScheduleKind,
    computed: usize,
    kinds: &[GroupKind],
) {
    if r.groups.len() != kinds.len() {
        r.groups.resize(kinds.len());
    }
    r.alloc_tokens = computed;
    let groups = &mut r.groups;
    tables.for_each_table(|g, blocks| {
        let Some(gb) = groups.get_mut(g) else {
            return;
        };
        if kind == ScheduleKind::Running {
            gb.gpu_blocks.extend_from_slice(&blocks);
        } else {
            gb.gpu_blocks = blocks;
        }
    });
}

impl Planner {
    /// Records the step's scheduled requests and returns what workers must do.
    ///
    /// New and resumed requests bring their whole GPU block tables; running ones the
    /// blocks added this step (see [`GroupTables`]). In eager mode every block confirmed
    /// by `num_computed_tokens` that is not on CPU or in flight is stored, in every group
    /// whose table still holds it: a sliding-window group's blocks before the window of
    /// `num_computed_tokens` were freed by the server in this step's allocation and are
    /// skipped. A new or resumed request's computed tokens are its GPU prefix hit, which
    /// may name blocks another request computes in this very step (vLLM hashes blocks
    /// when it allocates them), so they are confirmed from its next step on. With
    /// [`PlannerConfig::stores_after_forward`](super::PlannerConfig) the store runs after
    /// this step's forward pass, so the blocks this step fills are confirmed already,
    /// first step included. Otherwise stores run while later steps may reuse blocks, and
    /// the blocks they read from groups the server frees from running requests (sliding
    /// window, Mamba) are listed in the plan's `held_gpu_blocks`: the caller keeps them
    /// until [`Completions::released_gpu_blocks`](super::Completions) names them.
    ///
    /// In lazy mode, `lazy_candidates` (GPU blocks about to be evicted, least recently
    /// used first) are stored instead, and the plan's `held_gpu_blocks` says which ones
    /// the caller must keep: none with `stores_after_forward`, whose lazy store is copied
    /// before this step's forward pass, the first that may write them again.
    ///
    /// Hashes are read only for requests with newly confirmed blocks. A hash that cannot
    /// be read, or tables that do not fit the planner's groups, are an error naming the
    /// request; the other requests of the step are recorded, and their stores are handed
    /// out with the next plan.
    pub fn schedule<'a, H: HashSource, B: GroupTables>(
        &mut self,
        scheduled: impl IntoIterator<Item = ScheduledRequest<'a, H, B>>,
        lazy_candidates: impl IntoIterator<Item = LazyCandidate>,
    ) -> Result<StepPlan, PlanError> {
        let bs = self.block_size();
        let after_forward = self.cfg.stores_after_forward;
        let kinds = &self.kinds[..];
        let mut first_err = None;
        for s in scheduled {
            let n = s.gpu_blocks.num_tables();
            if n != kinds.len() && n != 0 {
                first_err.get_or_insert(PlanError::GroupMismatch {
                    req_id: s.req_id.to_string(),
                    expected: kinds.len(),
                    got: n,
                });
                continue;
            }
            let req_id = s.req_id;
            let r = live_entry(&mut self.requests, &mut self.next_serial, req_id);
            record(r, s.gpu_blocks, s.kind, s.num_computed_tokens, kinds);
            r.state_tokens = s.num_computed_tokens
                + if after_forward {
                    s.num_scheduled_tokens
                } else {
                    0
                };
            if s.kind != ScheduleKind::Running && !after_forward {
                continue;
            }
            let confirmed = if after_forward {
                (s.num_computed_tokens + s.num_scheduled_tokens) / bs
            } else {
                s.num_computed_tokens / bs
            };
            if self.cfg.lazy || confirmed <= r.stored_upto() {
                continue;
            }
            match r.sync(&s.hashes, confirmed, &mut self.cache, &mut self.stats) {
                Ok(usable) => {
                    select_eager(
                        req_id,
                        r,
                        usable,
                        kinds,
                        bs,
                        !after_forward,
                        &mut self.cache,
                        &mut self.pending_store,
                        &mut self.stats,
                    );
                }
                Err(e) => {
                    first_err.get_or_insert(PlanError::BadHash {
                        req_id: req_id.to_string(),
                        source: e,
                    });
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let held = if self.cfg.lazy {
            let candidates: Vec<LazyCandidate> = lazy_candidates.into_iter().collect();
            let chosen = select_lazy(
                &candidates,
                &mut self.cache,
                &mut self.pending_store,
                &mut self.stats,
            );
            // Copied before the step's forward pass (see `Planner::schedule`).
            if after_forward {
                Vec::new()
            } else {
                chosen
            }
        } else {
            Vec::new()
        };
        Ok(self.issue(held))
    }
}
