//! The `Planner` class: the scheduler side, one call per vLLM connector call. Every
//! decision is the core's (`offload_core::Planner`); this file converts.

use std::sync::Arc;

use offload_core::tier::{ProbeQueue, TierStats};
use offload_core::{BlockHash, LookupOutcome, Planner, PlannerConfig, ScheduledRequest, StepPlan};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMapping, PyTuple};

use crate::config::PyOffloadConfig;
use crate::convert::{
    block_ids, count, event_tuple, group_kind, hash_bytes, ids_to_bytes, PyHashes,
};
use crate::errors::{plan_err, INVALID_INPUT_ERROR, REMOTE_TIER_ERROR};
use crate::stats_report::{all_counters, Report, StatsReport};
use crate::tier::{check_lower, connect, hashes_to_bytes, kv_layout, Side};
use crate::transfer::ids_from_bytes;
use crate::vllm::blocks::allocated_windows;
use crate::vllm::free_queue::{self, Walk};
use crate::vllm::lazy::{lazy_candidates, LazyCandidates, LazyHashes, VllmHash};
use crate::vllm::running::RunningWatch;
use crate::vllm::schedule::plan_requests;
use crate::vllm::step::{
    all_group_ids, step_lists, step_or_none, step_to_py, StepLists, StepTuple,
};

/// `(id, req_id, keys, cpu_blocks, blocks, cpu_keys)`: 16-byte remote keys, little-endian
/// u32 block ids, each block's `(group, position)` in its request, and with events on
/// each block's CPU-tier hash as `take_events` names it (empty with events off).
type FetchTuple<'py> = (
    u64,
    String,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Vec<(u32, usize)>,
    Vec<Bound<'py, PyBytes>>,
);
/// `(finished_sending, finished_recving, load_error_blocks, released_gpu_blocks,
/// retired_stores)`.
type CompleteTuple = (Vec<String>, Vec<String>, Vec<u32>, Vec<u32>, Vec<u64>);

/// Scheduler-side planner (see `offload_core::Planner`).
#[pyclass(module = "kvoffload._native", name = "Planner")]
#[derive(Debug)]
pub(crate) struct PyPlanner {
    inner: Planner,
    /// What `take_stats_report` last reported.
    report: StatsReport,
    /// The previous step's running requests, which a step may leave out of the core.
    running: RunningWatch,
    /// With events on: vLLM's hashes of lazy candidates offered since the last plan.
    lazy_hashes: LazyHashes,
}

#[pymethods]
impl PyPlanner {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (
        block_size, num_cpu_blocks, world_size = 1, lazy = false, events = false,
        sync_loads = false, stores_after_forward = false, groups = None
    ))]
    fn new(
        block_size: i64,
        num_cpu_blocks: i64,
        world_size: i64,
        lazy: bool,
        events: bool,
        sync_loads: bool,
        stores_after_forward: bool,
        groups: Option<Vec<(String, Option<i64>)>>,
    ) -> PyResult<Self> {
        let pos = |v: i64, what: &str, min: u32| {
            u32::try_from(v)
                .ok()
                .filter(|v| *v >= min)
                .ok_or_else(|| INVALID_INPUT_ERROR.err(format!("Planner: invalid {what}: {v}")))
        };
        let cfg = PlannerConfig::new(
            pos(block_size, "block_size", 1)?,
            pos(num_cpu_blocks, "num_cpu_blocks", 0)?,
        )
        .with_world_size(pos(world_size, "world_size", 1)?)
        .with_lazy(lazy)
        .with_events(events)
        .with_sync_loads(sync_loads)
        .with_stores_after_forward(stores_after_forward);
        let kinds = groups
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, (kind, window))| group_kind(i, &kind, window))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self {
            inner: Planner::new(cfg, &kinds),
            report: StatsReport::default(),
            running: RunningWatch::default(),
            lazy_hashes: LazyHashes::default(),
        })
    }

    /// Tokens loadable from CPU after the GPU hit; `block_hashes` is the request's
    /// hash list (read only where the planner needs it). `None` while a remote tier is
    /// being asked: ask again next step.
    fn lookup(
        &mut self,
        req_id: &str,
        block_hashes: Bound<'_, PyAny>,
        num_tokens: i64,
        num_computed_tokens: i64,
    ) -> PyResult<Option<usize>> {
        let num_tokens = count(num_tokens, "num_tokens")?;
        let num_computed_tokens = count(num_computed_tokens, "num_computed_tokens")?;
        let out = self
            .inner
            .lookup_tiered(
                req_id,
                &PyHashes::new(block_hashes),
                num_tokens,
                num_computed_tokens,
            )
            .map_err(plan_err)?;
        Ok(match out {
            LookupOutcome::Hit { tokens, .. } => Some(tokens),
            _ => None,
        })
    }

    /// Connects the tiers below the CPU (disk, remote store; blocking up to the remote
    /// deadline) with the keys of `layout` (a mapping of `offload_core::tier::KvLayout`'s
    /// fields) and uses them in lookups.
    fn attach_remote(
        &mut self,
        py: Python<'_>,
        config: &PyOffloadConfig,
        layout: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        check_lower(config)?;
        let layout = kv_layout(layout)?;
        let stats = Arc::new(TierStats::default());
        let probes = py.detach(|| -> PyResult<ProbeQueue> {
            let tier = connect(config, &layout, &stats, Side::Scheduler)?;
            ProbeQueue::spawn(tier)
                .map_err(|e| REMOTE_TIER_ERROR.err(format!("cannot start the remote tier: {e}")))
        })?;
        self.inner.attach_remote(probes, stats);
        Ok(())
    }

    /// Fetches planned since the last call, for the workers (see [`FetchTuple`]).
    fn take_fetches<'py>(&mut self, py: Python<'py>) -> Vec<FetchTuple<'py>> {
        self.inner
            .take_fetches()
            .into_iter()
            .map(|f| {
                (
                    f.id,
                    f.req_id,
                    hashes_to_bytes(py, f.hashes),
                    ids_to_bytes(py, &f.cpu_blocks),
                    f.blocks,
                    f.cpu_hashes
                        .into_iter()
                        .map(|h| hash_bytes(py, h))
                        .collect(),
                )
            })
            .collect()
    }

    /// Applies per-rank fetch reports `(transfer_id, leading blocks filled)` and returns
    /// the fetches every rank has now reported; every report is applied, and the first one
    /// naming an unknown fetch is raised after.
    fn complete_fetches(&mut self, reports: Vec<(u64, usize)>) -> PyResult<Vec<u64>> {
        let mut first = None;
        let mut retired = Vec::new();
        for (id, filled) in reports {
            match self.inner.complete_fetch(id, filled) {
                Ok(true) => retired.push(id),
                Ok(false) => {}
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(retired), |e| Err(plan_err(e)))
    }

    /// The remote keys' hashes of CPU blocks (little-endian u32 ids) as 16-byte chunks;
    /// blocks that hold no hash are left out of both returned lists.
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        cpu_blocks: &[u8],
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let ids = ids_from_bytes(cpu_blocks, "cpu_blocks")?;
        let (ids, hashes): (Vec<u32>, Vec<BlockHash>) = ids
            .iter()
            .zip(self.inner.block_hashes(&ids))
            .filter_map(|(&b, h)| h.map(|h| (b, h)))
            .unzip();
        Ok((hashes_to_bytes(py, hashes), ids_to_bytes(py, &ids)))
    }

    #[getter]
    fn has_remote(&self) -> bool {
        self.inner.has_remote()
    }

    /// Tokens of the request's hit its fetch from the tier below the CPU brought (they
    /// follow the tokens that were on CPU already); 0 without one.
    fn remote_hit_tokens(&self, req_id: &str) -> usize {
        self.inner.remote_hit_tokens(req_id)
    }

    /// The scheduler allocated `gpu_block_ids` (a tuple of one list per KV-cache group,
    /// or the list of a model with one group) and accepted `num_external_tokens`.
    fn on_alloc(
        &mut self,
        req_id: &str,
        gpu_block_ids: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
        num_external_tokens: i64,
    ) -> PyResult<()> {
        let nct = count(num_computed_tokens, "num_computed_tokens")?;
        let ext = count(num_external_tokens, "num_external_tokens")?;
        let tables = if gpu_block_ids.is_none() || gpu_block_ids.is_instance_of::<PyTuple>() {
            all_group_ids(gpu_block_ids)?
        } else {
            vec![block_ids(gpu_block_ids, "gpu_block_ids")?]
        };
        self.inner
            .on_alloc(req_id, &tables, nct, ext)
            .map_err(plan_err)
    }

    /// `on_alloc` given vLLM's allocated blocks (`KVCacheBlocks.blocks`: a tuple of one
    /// sequence of objects with a `block_id` per KV-cache group, or the sequence of a
    /// model with one group): only the blocks the load fills are read, not the whole
    /// tables (a long prompt's GPU hit included).
    fn on_alloc_blocks(
        &mut self,
        req_id: &str,
        blocks: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
        num_external_tokens: i64,
    ) -> PyResult<()> {
        let nct = count(num_computed_tokens, "num_computed_tokens")?;
        let ext = count(num_external_tokens, "num_external_tokens")?;
        let window = self.inner.alloc_window(req_id, nct, ext);
        // Nothing accepted: the tables are not read.
        let windows = if ext == 0 {
            Vec::new()
        } else {
            allocated_windows(blocks, window.clone())?
        };
        self.inner
            .on_alloc_window(req_id, window.start, &windows, ext)
            .map_err(plan_err)
    }

    /// Records the step's scheduled requests (vLLM's `NewRequestData` fields and
    /// `CachedRequestData` lists; `hash_lists` maps request ids to their
    /// `block_hashes`) and, in lazy mode, GPU blocks about to be evicted with their
    /// hashes (`strip`: trailing bytes to drop from each, vLLM's 4-byte group id), for
    /// callers that do not walk vLLM's queue. `num_scheduled_tokens`
    /// (`{request_id: tokens}`, vLLM's own dict) is read for planners whose stores run
    /// after the forward pass. Returns a [`StepTuple`].
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (
        new_req_ids, new_num_computed, new_block_ids, cached_req_ids, cached_num_computed,
        cached_new_block_ids, resumed_req_ids, hash_lists, lazy_gpu_block_ids = None,
        lazy_block_hashes = None, strip = 0, num_scheduled_tokens = None
    ))]
    fn schedule<'py>(
        &mut self,
        py: Python<'py>,
        new_req_ids: &Bound<'py, PyList>,
        new_num_computed: &Bound<'py, PyList>,
        new_block_ids: &Bound<'py, PyList>,
        cached_req_ids: &Bound<'py, PyList>,
        cached_num_computed: &Bound<'py, PyList>,
        cached_new_block_ids: &Bound<'py, PyList>,
        resumed_req_ids: &Bound<'py, PyAny>,
        hash_lists: &Bound<'py, PyMapping>,
        lazy_gpu_block_ids: Option<&Bound<'py, PyList>>,
        lazy_block_hashes: Option<&Bound<'py, PyList>>,
        strip: usize,
        num_scheduled_tokens: Option<&Bound<'py, PyMapping>>,
    ) -> PyResult<StepTuple<'py>> {
        let lists = StepLists {
            new_req_ids: new_req_ids.clone(),
            new_num_computed: new_num_computed.clone(),
            new_block_ids: new_block_ids.clone(),
            cached_req_ids: cached_req_ids.clone(),
            cached_num_computed: cached_num_computed.clone(),
            cached_new_block_ids: cached_new_block_ids.clone(),
            resumed_req_ids: resumed_req_ids.clone(),
            num_scheduled_tokens: num_scheduled_tokens.map(|m| m.clone().into_any()),
        };
        let keep = self.inner.config().events;
        let (lazy, walked) =
            lazy_candidates(lazy_gpu_block_ids, lazy_block_hashes, strip, keep)?.into_parts();
        let plan = plan_requests(&mut self.inner, &mut self.running, &lists, hash_lists, lazy)?;
        let hashes = self.lazy_hashes_of(&plan, walked);
        Ok(step_to_py(py, plan, hashes))
    }

    /// [`schedule`](Self::schedule) for vLLM: the request lists are read from its
    /// `SchedulerOutput` (and its `num_scheduled_tokens` with `after_forward`, for
    /// planners whose stores run after the forward pass), the lazy candidates are those
    /// a free-queue walk found; `None` when the step moves and holds nothing.
    #[pyo3(signature = (scheduler_output, hash_lists, lazy = None, after_forward = false))]
    fn schedule_output<'py>(
        &mut self,
        py: Python<'py>,
        scheduler_output: &Bound<'py, PyAny>,
        hash_lists: &Bound<'py, PyMapping>,
        lazy: Option<&Bound<'py, LazyCandidates>>,
        after_forward: bool,
    ) -> PyResult<Option<StepTuple<'py>>> {
        let lists = step_lists(scheduler_output, after_forward)?;
        let (lazy, walked) = LazyCandidates::take(lazy);
        let plan = plan_requests(&mut self.inner, &mut self.running, &lists, hash_lists, lazy)?;
        let hashes = self.lazy_hashes_of(&plan, walked);
        Ok(step_or_none(py, plan, hashes))
    }

    /// [`schedule`](Self::schedule) for a planner that does not read the scheduled
    /// requests (`reads_scheduled_requests` is false: lazy mode): only the step's lazy
    /// candidates (a free-queue walk's), not eight empty request arguments every step.
    #[pyo3(signature = (lazy = None))]
    fn schedule_lazy<'py>(
        &mut self,
        py: Python<'py>,
        lazy: Option<&Bound<'py, LazyCandidates>>,
    ) -> PyResult<Option<StepTuple<'py>>> {
        if self.inner.reads_scheduled_requests() {
            return Err(INVALID_INPUT_ERROR.err(
                "schedule_lazy: this planner reads the scheduled requests (eager mode); call \
                 schedule or schedule_output",
            ));
        }
        let (lazy, walked) = LazyCandidates::take(lazy);
        let none = std::iter::empty::<ScheduledRequest<'_, PyHashes<'py>, Vec<Vec<u32>>>>();
        let plan = self.inner.schedule(none, lazy).map_err(plan_err)?;
        let hashes = self.lazy_hashes_of(&plan, walked);
        Ok(step_or_none(py, plan, hashes))
    }

    /// `req_id` finished; returns whether vLLM must keep its GPU blocks.
    fn request_finished(
        &mut self,
        req_id: &str,
        block_hashes: Bound<'_, PyAny>,
        num_computed_tokens: i64,
    ) -> PyResult<bool> {
        let nct = count(num_computed_tokens, "num_computed_tokens")?;
        self.inner
            .request_finished(req_id, &PyHashes::new(block_hashes), nct)
            .map_err(plan_err)
    }

    /// Applies per-rank reports `(transfer_id, ok)`; returns
    /// `(finished_sending, finished_recving, load_error_blocks, released_gpu_blocks,
    /// retired_stores)` (`retired_stores`: with events on, the store ids that retired).
    fn complete(&mut self, transfer_ids: Vec<u64>, ok: Vec<bool>) -> PyResult<CompleteTuple> {
        if transfer_ids.len() != ok.len() {
            return Err(INVALID_INPUT_ERROR.err(format!(
                "complete: {} transfer ids but {} results",
                transfer_ids.len(),
                ok.len()
            )));
        }
        // Bookkeeping only (microseconds): releasing the GIL around it would cost more
        // than it lets other threads run.
        let res = self.inner.complete_all(transfer_ids.into_iter().zip(ok));
        let c = self.inner.take_completions();
        let out = (
            c.finished_sending,
            c.finished_recving,
            c.load_error_blocks,
            c.released_gpu_blocks,
            c.retired_stores,
        );
        // Reports are applied even if one was unknown; that one is still an error.
        res.map_err(plan_err)?;
        Ok(out)
    }

    /// Buffered KV events as tuples: `("stored", group, [hash], parent | None,
    /// block_size)`, `("removed", group, [hash])`, `("cleared",)`.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.inner
            .take_events()
            .into_iter()
            .map(|e| event_tuple(py, e))
            .collect()
    }

    /// Drops every CPU block; transfers in flight finish but are not served.
    fn reset(&mut self) {
        self.inner.reset();
        self.running.clear();
    }

    fn has_work_in_flight(&self) -> bool {
        self.inner.has_work_in_flight()
    }

    fn has_pending_plan(&self) -> bool {
        self.inner.has_pending_plan()
    }

    /// Lazy mode: selects GPU blocks among `candidates` (a free-queue walk's, taken)
    /// for the next step's store now; returns the ids the caller must hold from now on
    /// (none when stores are copied within the step, see
    /// `offload_core::Planner::offer_lazy`).
    fn offer_lazy(&mut self, candidates: &Bound<'_, LazyCandidates>) -> Vec<u32> {
        let (lazy, hashes) = LazyCandidates::take(Some(candidates));
        self.lazy_hashes.offer(hashes);
        self.inner.offer_lazy(lazy)
    }

    /// Lazy mode: walks vLLM's GPU free queue from node `start` (see `free_queue::walk`);
    /// returns `(last_node, at_tail, candidates)`, the candidates without those the CPU
    /// tier holds already, for `offer_lazy` or `schedule_lazy`/`schedule_output`.
    fn walk_free_queue<'py>(
        &mut self,
        start: Bound<'py, PyAny>,
        tail: Bound<'py, PyAny>,
        limit: usize,
        strip: usize,
    ) -> PyResult<Walk<'py>> {
        let keep_hashes = self.inner.config().events;
        free_queue::walk(&mut self.inner, start, &tail, limit, strip, keep_hashes)
    }

    /// Whether `schedule` reads the request lists (see
    /// `offload_core::Planner::reads_scheduled_requests`).
    #[getter]
    fn reads_scheduled_requests(&self) -> bool {
        self.inner.reads_scheduled_requests()
    }

    /// Number of KV-cache groups.
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.groups().len()
    }

    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }

    #[getter]
    fn num_cpu_blocks(&self) -> u32 {
        self.inner.cache().capacity()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.cache().pool().num_free()
    }

    /// Counters since construction, by name.
    fn stats(&self) -> Vec<(&'static str, u64)> {
        all_counters(&self.inner)
    }

    /// What changed since the previous call, as vLLM's stats payload parts: the counters
    /// that grew (`{name: increase}`) and the gauges whose value changed
    /// (`cpu_blocks_used`: cached or being written; `cpu_blocks_capacity`); `None` when
    /// nothing did.
    fn take_stats_report<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Report<'py>>> {
        self.report.take(py, &self.inner)
    }
}

impl PyPlanner {
    /// vLLM's hash of each lazy block of `plan`'s store (see `LazyHashes::for_store`):
    /// `walked`, the hashes of the candidates given to this plan.
    fn lazy_hashes_of(&mut self, plan: &StepPlan, walked: Vec<VllmHash>) -> Vec<Option<Py<PyAny>>> {
        // Events off, an eager planner, or nothing offered: every step of most engines.
        if walked.is_empty() && self.lazy_hashes.is_empty() {
            return Vec::new();
        }
        match &plan.store {
            Some(s) => self
                .lazy_hashes
                .for_store(walked, &s.gpu_blocks, &s.sources),
            None => {
                self.lazy_hashes.clear();
                Vec::new()
            }
        }
    }
}
