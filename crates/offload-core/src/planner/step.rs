//! The step loop behind [`Planner::schedule`] and [`Planner::schedule_groups`]. The
//! single-group and the multi-group planner differ only in how a request keeps its GPU
//! blocks ([`Tables`]: one table, or one per group) and in how its stores are chosen
//! ([`Selector`]); the loop around them is this one.

use crate::cache::BlockCache;
use crate::error::PlanError;
use crate::events::PlannerStats;

use super::groups::{select_groups, GroupBlocks, GroupKind};
use super::request::Request;
use super::select::{select_eager, select_lazy, PendingStore};
use super::types::{HashSource, LazyCandidate, ScheduleKind, ScheduledRequest, StepPlan};
use super::{live_entry, Planner};

/// How stores are chosen for one planner kind.
#[derive(Debug, Clone, Copy)]
pub(super) enum Selector<'k> {
    /// One full-attention group (the planner of [`Planner::new`]).
    Single,
    /// Several groups, `kinds[g]` being group `g`'s kind.
    Groups(&'k [GroupKind]),
}

impl Selector<'_> {
    /// Blocks before this index were considered for storing (in every group).
    pub(super) fn stored_upto(self, r: &Request) -> usize {
        match self {
            Self::Single => r.stored_upto,
            Self::Groups(_) => r.groups.iter().map(|g| g.stored_upto).min().unwrap_or(0),
        }
    }

    /// Selects `r`'s blocks up to `confirmed` that are neither on CPU nor in flight into
    /// the store job being assembled (see [`select_eager`], [`select_groups`]; `hold`:
    /// the server may reuse blocks it frees before the store runs). Returns whether `r`
    /// has a store in the pending job.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn select(
        self,
        req: &str,
        r: &mut Request,
        confirmed: usize,
        bs: usize,
        hold: bool,
        cache: &mut BlockCache,
        pending: &mut PendingStore,
        stats: &mut PlannerStats,
    ) -> bool {
        match self {
            Self::Single => select_eager(req, r, confirmed, cache, pending, stats),
            Self::Groups(kinds) => {
                select_groups(req, r, confirmed, kinds, bs, hold, cache, pending, stats)
            }
        }
    }
}

/// A scheduled request's block tables: one (the single-group planner) or one per group.
pub(super) trait Tables {
    /// Refuses tables that do not fit the planner's `kinds` (the request is then not
    /// recorded at all).
    fn check(&self, req_id: &str, kinds: &[GroupKind]) -> Result<(), PlanError>;
    /// Records the tables in `r`: the whole table of a new or resumed request, the added
    /// blocks of a running one, allocated with `computed` tokens computed.
    fn record(self, r: &mut Request, kind: ScheduleKind, computed: usize, kinds: &[GroupKind]);
}

impl Tables for Vec<u32> {
    fn check(&self, _: &str, _: &[GroupKind]) -> Result<(), PlanError> {
        Ok(())
    }

    fn record(self, r: &mut Request, kind: ScheduleKind, _: usize, _: &[GroupKind]) {
        if kind == ScheduleKind::Running {
            r.gpu_blocks.extend_from_slice(&self);
        } else {
            r.gpu_blocks = self;
        }
    }
}

impl Tables for Vec<Vec<u32>> {
    fn check(&self, req_id: &str, kinds: &[GroupKind]) -> Result<(), PlanError> {
        if self.len() != kinds.len() && !self.is_empty() {
            return Err(PlanError::GroupMismatch {
                req_id: req_id.to_string(),
                expected: kinds.len(),
                got: self.len(),
            });
        }
        Ok(())
    }

    fn record(self, r: &mut Request, kind: ScheduleKind, computed: usize, kinds: &[GroupKind]) {
        r.groups.resize_with(kinds.len(), GroupBlocks::default);
        r.alloc_tokens = computed;
        for (g, blocks) in r.groups.iter_mut().zip(self) {
            if kind == ScheduleKind::Running {
                g.gpu_blocks.extend_from_slice(&blocks);
            } else {
                g.gpu_blocks = blocks;
            }
        }
    }
}

impl Planner {
    /// The step loop of [`Self::schedule`]: `scheduled` requests carry the tables of
    /// this planner's kind (one on the single-group planner, one per group otherwise).
    pub(super) fn schedule_rows<'a, H: HashSource, B: Tables>(
        &mut self,
        scheduled: impl IntoIterator<Item = ScheduledRequest<'a, H, B>>,
        lazy_candidates: impl IntoIterator<Item = LazyCandidate>,
    ) -> Result<StepPlan, PlanError> {
        let bs = self.block_size();
        let after_forward = self.cfg.stores_after_forward;
        let (sel, kinds) = match self.groups.as_deref() {
            Some(kinds) => (Selector::Groups(kinds), kinds),
            None => (Selector::Single, &[][..]),
        };
        let mut first_err = None;
        for s in scheduled {
            if let Err(e) = s.gpu_blocks.check(s.req_id, kinds) {
                first_err.get_or_insert(e);
                continue;
            }
            let req_id = s.req_id;
            let r = live_entry(&mut self.requests, &mut self.next_serial, req_id);
            s.gpu_blocks.record(r, s.kind, s.num_computed_tokens, kinds);
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
            if self.cfg.lazy || confirmed <= sel.stored_upto(r) {
                continue;
            }
            match r.sync(&s.hashes, confirmed, &mut self.cache, &mut self.stats) {
                Ok(usable) => {
                    sel.select(
                        req_id,
                        r,
                        usable,
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
