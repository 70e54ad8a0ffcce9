//! What goes into and comes out of the [`Planner`](super::Planner): its configuration,
//! the per-step input, and the plan and completions it hands back.

use crate::error::HashError;
use crate::key::{BlockHash, BlockId, BlockKey};

/// Identifies one transfer (one load of a request, or one step's stores).
pub type TransferId = u64;

/// Geometry and mode of a planner.
///
/// # Examples
/// ```
/// use offload_core::PlannerConfig;
///
/// let cfg = PlannerConfig::new(16, 1024).with_world_size(2).with_lazy(true);
/// assert_eq!(cfg.world_size, 2);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlannerConfig {
    /// Tokens per KV block (the size the server hashes blocks at).
    pub block_size: u32,
    /// CPU blocks available on every rank (the minimum across ranks).
    pub num_cpu_blocks: u32,
    /// Ranks that must report a transfer before it is retired.
    pub world_size: u32,
    /// Lazy mode: stores come only from the step's lazy candidates.
    pub lazy: bool,
    /// Buffer KV events for [`Planner::take_events`](super::Planner::take_events).
    pub events: bool,
    /// Loads complete within the step that needs them (workers wait before the forward
    /// pass), instead of the request waiting a step for an asynchronous load. Cheaper
    /// when KV lives in host memory (vLLM's CPU backend); GPUs overlap async loads.
    pub sync_loads: bool,
    /// Each step's store is copied within the step (KV in host memory): in eager mode
    /// after that step's forward pass, so blocks count as confirmed once the step's
    /// scheduled tokens fill them, including a new request's first step; in lazy mode
    /// before it, so no GPU block is held (a lazy store's blocks were free, their KV
    /// final, and the first forward pass that may write them again is the step's own).
    /// Otherwise stores read only what earlier steps computed, and run while the next
    /// forward pass may.
    pub stores_after_forward: bool,
}

impl PlannerConfig {
    /// Eager mode, one rank, no events, asynchronous loads. Zero sizes are raised to 1
    /// block size (a zero CPU pool is valid: the planner then never stores).
    pub fn new(block_size: u32, num_cpu_blocks: u32) -> Self {
        Self {
            block_size: block_size.max(1),
            num_cpu_blocks,
            world_size: 1,
            lazy: false,
            events: false,
            sync_loads: false,
            stores_after_forward: false,
        }
    }

    /// Ranks that report every transfer (at least 1).
    #[must_use]
    pub fn with_world_size(mut self, world_size: u32) -> Self {
        self.world_size = world_size.max(1);
        self
    }

    /// Lazy (`true`) or eager store selection.
    #[must_use]
    pub fn with_lazy(mut self, lazy: bool) -> Self {
        self.lazy = lazy;
        self
    }

    /// Whether KV events are buffered.
    #[must_use]
    pub fn with_events(mut self, events: bool) -> Self {
        self.events = events;
        self
    }

    /// Whether loads finish within the step that needs them.
    #[must_use]
    pub fn with_sync_loads(mut self, sync_loads: bool) -> Self {
        self.sync_loads = sync_loads;
        self
    }

    /// Whether each step's store runs after its forward pass, within the step.
    #[must_use]
    pub fn with_stores_after_forward(mut self, after_forward: bool) -> Self {
        self.stores_after_forward = after_forward;
        self
    }
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self::new(16, 0)
    }
}

/// A request's block hashes as the server holds them, read on demand.
///
/// The server owns the list and may rewrite it under the same request id (vLLM's
/// streaming-input sessions truncate it and regrow it with new content). The planner
/// keeps its own copy of the entries it used and compares it with the source at the last
/// position it is about to rely on before every use; hashes are chained (entry `k`
/// covers blocks `0..=k`), so one equal entry vouches for every entry before it.
/// Implementations only convert: `hash` is called for the few positions the planner
/// needs, never for the whole list on every step.
pub trait HashSource {
    /// Number of hashes (full blocks) the request has now, or why the list cannot be
    /// read at all.
    fn num_hashes(&self) -> Result<usize, HashError>;

    /// The hash at `index` (below [`Self::num_hashes`]).
    fn hash(&self, index: usize) -> Result<BlockHash, HashError>;

    /// The hashes at `start..start + out.len()` (all below [`Self::num_hashes`]) into
    /// `out`. A lookup reads a run of blocks at once: a source with a per-call cost
    /// (a foreign list) overrides this to pay it once per run.
    fn hashes_into(&self, start: usize, out: &mut [BlockHash]) -> Result<(), HashError> {
        for (i, o) in out.iter_mut().enumerate() {
            *o = self.hash(start + i)?;
        }
        Ok(())
    }
}

impl HashSource for [BlockHash] {
    fn num_hashes(&self) -> Result<usize, HashError> {
        Ok(<[BlockHash]>::len(self))
    }

    fn hash(&self, index: usize) -> Result<BlockHash, HashError> {
        self.get(index).copied().ok_or_else(|| HashError {
            index,
            reason: "out of range".into(),
        })
    }

    fn hashes_into(&self, start: usize, out: &mut [BlockHash]) -> Result<(), HashError> {
        let src = self
            .get(start..start.saturating_add(out.len()))
            .ok_or_else(|| HashError {
                index: start.saturating_add(out.len()).saturating_sub(1),
                reason: "out of range".into(),
            })?;
        out.copy_from_slice(src);
        Ok(())
    }
}

impl HashSource for Vec<BlockHash> {
    fn num_hashes(&self) -> Result<usize, HashError> {
        Ok(self.as_slice().len())
    }

    fn hash(&self, index: usize) -> Result<BlockHash, HashError> {
        self.as_slice().hash(index)
    }
}

impl<H: HashSource + ?Sized> HashSource for &H {
    fn num_hashes(&self) -> Result<usize, HashError> {
        (**self).num_hashes()
    }

    fn hash(&self, index: usize) -> Result<BlockHash, HashError> {
        (**self).hash(index)
    }

    fn hashes_into(&self, start: usize, out: &mut [BlockHash]) -> Result<(), HashError> {
        (**self).hashes_into(start, out)
    }
}

/// How a request appears in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ScheduleKind {
    /// First scheduled: `gpu_blocks` is its whole block table.
    New,
    /// Scheduled again after a preemption: `gpu_blocks` is its whole new block table.
    Resumed,
    /// Was running in the previous step: `gpu_blocks` are the blocks added this step.
    Running,
}

/// One scheduled request of a step.
#[derive(Debug, Clone)]
pub struct ScheduledRequest<'a, H, B = Vec<u32>> {
    /// The request id.
    pub req_id: &'a str,
    /// New, resumed or running.
    pub kind: ScheduleKind,
    /// Tokens computed before this step (their KV is in GPU memory by the time the
    /// step's forward pass ran).
    pub num_computed_tokens: usize,
    /// Tokens this step computes (read only with
    /// [`PlannerConfig::stores_after_forward`]).
    pub num_scheduled_tokens: usize,
    /// GPU block ids: the whole table (new, resumed) or the blocks added (running); one
    /// table, or one per KV-cache group in a [`ScheduledGroups`](super::ScheduledGroups).
    pub gpu_blocks: B,
    /// The request's block hashes.
    pub hashes: H,
}

/// A copy from CPU blocks into a request's GPU blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadJob {
    /// The transfer id workers report back.
    pub id: TransferId,
    /// The request being loaded.
    pub req_id: String,
    /// Destination GPU blocks.
    pub gpu_blocks: Vec<u32>,
    /// Source CPU blocks, pairwise with `gpu_blocks`.
    pub cpu_blocks: Vec<BlockId>,
    /// `false` when the scheduler asked for a load the planner had no hit for: workers
    /// must report it failed (so the server recomputes), never wait for it.
    pub valid: bool,
    /// The request runs in this step: workers finish the load before the forward pass.
    pub sync: bool,
}

/// A copy from GPU blocks into CPU blocks, one per step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StoreJob {
    /// The transfer id workers report back.
    pub id: TransferId,
    /// Source GPU blocks.
    pub gpu_blocks: Vec<u32>,
    /// Destination CPU blocks, pairwise with `gpu_blocks`.
    pub cpu_blocks: Vec<BlockId>,
    /// Requests whose blocks are read (a worker fences on these when one is preempted).
    pub req_ids: Vec<String>,
    /// Requests that finished and whose GPU blocks wait for this copy: workers whose KV
    /// lives in host memory finish it within the step, so an idle engine holds nothing.
    pub flush_req_ids: Vec<String>,
    /// With events on, pairwise with `cpu_blocks`: where each block comes from, as its
    /// request's index in `req_ids` and its block position in that request, or `None`
    /// for a lazy candidate. The caller snapshots what vLLM's events need (tokens, full
    /// hash, LoRA) while it still holds the request. Empty with events off.
    pub sources: Vec<Option<(u32, u32)>>,
    /// With events on, pairwise with `cpu_blocks`: the hash each block is stored under,
    /// as the [`KvEvent`](crate::KvEvent)s about it name it, so a caller matches its
    /// snapshots to the events without knowing how a key is made from a server's hash.
    /// Empty with events off.
    pub hashes: Vec<BlockHash>,
    /// Multi-group planners: each block's KV-cache group, pairwise with `cpu_blocks`
    /// (workers copy a block id the same whatever its group). Empty on one group.
    pub groups: Vec<u32>,
}

/// What workers must do this step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StepPlan {
    /// Loads accepted since the previous step.
    pub loads: Vec<LoadJob>,
    /// Stores selected since the previous step.
    pub store: Option<StoreJob>,
    /// Lazy mode: GPU blocks selected from the step's candidates. The caller keeps them
    /// from being reused until they come back in [`Completions::released_gpu_blocks`].
    pub held_gpu_blocks: Vec<u32>,
}

impl StepPlan {
    /// Whether the step moves nothing.
    pub fn is_empty(&self) -> bool {
        self.loads.is_empty() && self.store.is_none()
    }
}

/// What retired transfers mean for the server.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Completions {
    /// Finished requests whose GPU blocks may now be freed (their `request_finished`
    /// returned `true`).
    pub finished_sending: Vec<String>,
    /// Requests whose load retired (successfully or not); they may now run.
    pub finished_recving: Vec<String>,
    /// GPU blocks of failed loads: the server must recompute them.
    pub load_error_blocks: Vec<u32>,
    /// GPU blocks of lazy stores that retired: the caller held them when they were
    /// selected and must now release them.
    pub released_gpu_blocks: Vec<u32>,
    /// With events on: store transfers that retired (published or failed). Their
    /// [`KvEvent::Stored`](crate::KvEvent::Stored) events, if any, are buffered already,
    /// so a caller may drop what it kept for them.
    pub retired_stores: Vec<TransferId>,
}

/// A lazy-mode candidate: a GPU block about to be evicted and the key of its content.
pub type LazyCandidate = (u32, BlockKey);
