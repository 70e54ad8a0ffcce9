//! [`Planner`]: the scheduler-side brain and the crate's step protocol. It owns CPU block
//! ids (never bytes) and each request's block hashes, answers prefix lookups, turns
//! accepted hits into loads, selects blocks to store (eager or lazy), and applies the
//! completions that workers report.
//!
//! One call per server call, in this order within an engine step:
//! 1. [`Planner::lookup`] for waiting requests (any number of times; hits are pinned until
//!    the load completes or the request is dropped);
//! 2. [`Planner::on_alloc`] once the scheduler accepted some of the hit;
//! 3. [`Planner::schedule`] with the step's scheduled requests (and, in lazy mode, GPU
//!    blocks about to be evicted): returns the [`StepPlan`] for the workers;
//! 4. [`Planner::complete_all`] as ranks report transfers done, then
//!    [`Planner::take_completions`];
//! 5. [`Planner::request_finished`] when a request ends (its last full blocks are
//!    flushed to CPU in the next plan).
//!
//! With a remote tier ([`Planner::attach_remote`]), step 1 is [`Planner::lookup_tiered`],
//! which may answer "pending"; [`Planner::take_fetches`] goes with each plan and
//! [`Planner::complete_fetch`] takes the ranks' fetch reports (see [`crate::tier`]).
//!
//! Hashes are read through [`HashSource`] at the moment they are used, and checked
//! against what the planner read before: a list the server truncated and regrew with
//! other content (vLLM's streaming sessions) never leads to a store or a hit under a key
//! whose content changed.

mod alloc;
mod kinds;
mod ledger;
mod lookup;
mod remote;
mod request;
mod select;
mod step;
mod types;

use foldhash::fast::RandomState;
use hashbrown::HashMap;

use crate::cache::BlockCache;
use crate::error::PlanError;
use crate::events::{KvEvent, PlannerStats};
use crate::key::BlockKey;

use ledger::Ledger;
use request::{Finishing, Report, Request};
use select::{select_eager, select_lazy, PendingStore};

pub use kinds::GroupKind;
pub use remote::{FetchJob, LookupOutcome, RemoteStats};
pub use step::GroupTables;

pub use types::{
    Completions, HashSource, LazyCandidate, LoadJob, PlannerConfig, ScheduleKind, ScheduledRequest,
    StepPlan, StoreJob, TransferId,
};

/// One scheduled request of a step with a block table per KV-cache group (see
/// [`ScheduledRequest`] and [`GroupTables`]).
pub type ScheduledGroups<'a, H> = ScheduledRequest<'a, H, Vec<Vec<u32>>>;

/// The scheduler-side planner of one engine: one path for every model, a model being a
/// list of KV-cache groups (a dense model is `[GroupKind::FullAttention]`).
///
/// # Examples
/// A request computes a 64-token prompt; eager mode stores its 4 blocks, and a second
/// request with the same prefix loads them instead of recomputing:
/// ```
/// use offload_core::{
///     BlockHash, GroupKind, Planner, PlannerConfig, ScheduleKind, ScheduledRequest,
/// };
///
/// let mut planner = Planner::new(PlannerConfig::new(16, 64), &[GroupKind::FullAttention]);
/// let hashes: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
/// let step = |req, kind, computed, gpu: &[u32]| ScheduledRequest {
///     req_id: req,
///     kind,
///     num_computed_tokens: computed,
///     num_scheduled_tokens: 0,
///     gpu_blocks: gpu.to_vec(),
///     hashes: &hashes,
/// };
///
/// assert_eq!(planner.lookup("a", &hashes, 65, 0)?, 0);
/// planner.on_alloc("a", &[[10, 11, 12, 13, 14]], 0, 0)?;
/// planner.schedule([step("a", ScheduleKind::New, 0, &[10, 11, 12, 13, 14])], [])?;
/// // Next step: the 64 prompt tokens are computed, so their blocks are stored.
/// let plan = planner.schedule([step("a", ScheduleKind::Running, 64, &[])], [])?;
/// let store = plan.store.expect("the prompt's blocks");
/// assert_eq!(store.gpu_blocks, vec![10, 11, 12, 13]);
/// planner.complete(store.id, true)?;
///
/// assert_eq!(planner.lookup("b", &hashes, 65, 0)?, 64);
/// planner.on_alloc("b", &[[20, 21, 22, 23, 24]], 0, 64)?;
/// let plan = planner.schedule([step("b", ScheduleKind::New, 0, &[20, 21, 22, 23, 24])], [])?;
/// assert_eq!(plan.loads[0].gpu_blocks, vec![20, 21, 22, 23]);
/// assert_eq!(plan.loads[0].cpu_blocks, store.cpu_blocks);
/// # Ok::<(), offload_core::PlanError>(())
/// ```
#[derive(Debug)]
pub struct Planner {
    cfg: PlannerConfig,
    cache: BlockCache,
    // Request ids can be chosen by clients (an HTTP `X-Request-Id`): a keyed hasher
    // keeps crafted ids from degrading the map.
    requests: HashMap<String, Request, RandomState>,
    /// Finished requests whose transfers still run, by serial.
    finishing: HashMap<u64, Finishing, RandomState>,
    next_serial: u64,
    ledger: Ledger,
    pending_loads: Vec<LoadJob>,
    pending_store: PendingStore,
    completions: Completions,
    stats: PlannerStats,
    /// The remote tier behind the CPU tier, if one is attached.
    remote: Option<Box<remote::RemoteState>>,
    /// The kind of each KV-cache group, `kinds[g]` being group `g`'s (never empty).
    kinds: Box<[GroupKind]>,
}

impl Planner {
    /// A planner with an empty CPU pool of `cfg.num_cpu_blocks` blocks for a model whose
    /// KV-cache group `g` is of kind `kinds[g]` (no group: one full-attention group).
    ///
    /// # Examples
    /// A full-attention group and a sliding-window group of 32 tokens: a hit of 3 blocks
    /// needs all 3 full-attention blocks but only the sliding-window blocks of its
    /// window (the last 2).
    /// ```
    /// use offload_core::{GroupKind, Planner, PlannerConfig};
    ///
    /// let groups = [GroupKind::FullAttention, GroupKind::SlidingWindow { window: 32 }];
    /// let planner = Planner::new(PlannerConfig::new(16, 64), &groups);
    /// assert_eq!(planner.groups(), &groups);
    /// assert_eq!(groups[1].skipped_blocks(48, 16), 1);
    /// ```
    pub fn new(cfg: PlannerConfig, kinds: &[GroupKind]) -> Self {
        let kinds: Box<[GroupKind]> = if kinds.is_empty() {
            Box::new([GroupKind::FullAttention])
        } else {
            kinds.into()
        };
        let cfg = PlannerConfig::new(cfg.block_size, cfg.num_cpu_blocks)
            .with_world_size(cfg.world_size)
            .with_lazy(cfg.lazy)
            .with_events(cfg.events)
            .with_sync_loads(cfg.sync_loads)
            .with_stores_after_forward(cfg.stores_after_forward);
        Self {
            cache: BlockCache::new(cfg.num_cpu_blocks, cfg.events),
            cfg,
            requests: HashMap::with_hasher(RandomState::default()),
            finishing: HashMap::with_hasher(RandomState::default()),
            next_serial: 0,
            ledger: Ledger::new(),
            pending_loads: Vec::new(),
            pending_store: PendingStore::default(),
            completions: Completions::default(),
            stats: PlannerStats::default(),
            remote: None,
            kinds,
        }
    }

    /// The KV-cache groups' kinds.
    pub fn groups(&self) -> &[GroupKind] {
        &self.kinds
    }

    /// The planner's configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    /// The CPU block cache, read-only (for stats and tests).
    pub fn cache(&self) -> &BlockCache {
        &self.cache
    }

    /// Counters since construction.
    pub fn stats(&self) -> PlannerStats {
        PlannerStats {
            evicted_blocks: self.cache.evicted(),
            ..self.stats
        }
    }

    /// `req` finished with `num_computed_tokens` computed and block hashes `hashes`. In
    /// eager mode its remaining full blocks are flushed to CPU with the next plan.
    /// Returns whether the server must keep its GPU blocks until
    /// [`Completions::finished_sending`] names it (a transfer still uses them).
    ///
    /// A hash that cannot be read is reported after the request is finished without its
    /// flush, so the planner stays consistent.
    pub fn request_finished<H: HashSource + ?Sized>(
        &mut self,
        req: &str,
        hashes: &H,
        num_computed_tokens: usize,
    ) -> Result<bool, PlanError> {
        let bs = self.block_size();
        self.forget_remote(req);
        let Some(mut r) = self.requests.remove(req) else {
            return Ok(false);
        };
        let confirmed = num_computed_tokens / bs;
        let mut err = None;
        if !self.cfg.lazy && confirmed > r.stored_upto() {
            // Its last chunk ran to `num_computed_tokens`: where Mamba groups last wrote
            // a state.
            r.state_tokens = num_computed_tokens;
            // Before handing the table over, vLLM frees what fell out of the sliding
            // windows of its computed tokens (at most these; fewer while a step is in
            // flight): those blocks are free already and not stored.
            r.alloc_tokens = r.alloc_tokens.max(num_computed_tokens);
            match r.sync(hashes, confirmed, &mut self.cache, &mut self.stats) {
                Ok(usable) => {
                    // A finished request keeps what vLLM did not free until this flush's
                    // store retires.
                    let queued = select_eager(
                        req,
                        &mut r,
                        usable,
                        &self.kinds,
                        bs,
                        !self.cfg.stores_after_forward,
                        &mut self.cache,
                        &mut self.pending_store,
                        &mut self.stats,
                    );
                    if queued {
                        self.pending_store.flush_req_ids.push(req.to_string());
                    }
                }
                Err(e) => {
                    err = Some(PlanError::BadHash {
                        req_id: req.to_string(),
                        source: e,
                    });
                }
            }
        }
        r.release_hit(&mut self.cache);
        // vLLM keeps the blocks of a request aborted while loading until
        // `finished_recving`; that report waits for its stores too.
        let report = if r.load_in_flight {
            Some(Report::Recving)
        } else if r.stores_in_flight > 0 {
            Some(Report::Sending)
        } else {
            None
        };
        if let Some(report) = report {
            self.finishing.insert(
                r.serial,
                Finishing {
                    req_id: req.to_string(),
                    stores_in_flight: r.stores_in_flight,
                    load_in_flight: r.load_in_flight,
                    report,
                },
            );
        }
        let keep = report == Some(Report::Sending);
        err.map_or(Ok(keep), Err)
    }

    /// [`Self::complete`] for each `(id, ok)` report; every report is applied even when
    /// one names an unknown transfer, and the first such error is returned.
    pub fn complete_all(
        &mut self,
        reports: impl IntoIterator<Item = (TransferId, bool)>,
    ) -> Result<(), PlanError> {
        let mut first_err = None;
        for (id, ok) in reports {
            if let Err(e) = self.complete(id, ok) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Takes what retired transfers mean for the server since the previous call.
    pub fn take_completions(&mut self) -> Completions {
        std::mem::take(&mut self.completions)
    }

    /// Takes the buffered KV events.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.cache.drain_events()
    }

    /// Drops every CPU block and every pinned lookup result. Transfers in flight finish,
    /// but nothing stored before the reset is served after it.
    pub fn reset(&mut self) {
        for r in self.requests.values_mut() {
            // Keep where each pinned hit started, so a load the server still asks for is
            // reported failed against the right GPU blocks.
            if let Some(hit) = &mut r.hit {
                hit.unpin_all(&mut self.cache);
            }
        }
        self.cache.clear();
    }

    /// Whether any transfer is issued but not retired, or chosen but not yet issued.
    pub fn has_work_in_flight(&self) -> bool {
        !self.ledger.is_empty() || !self.pending_loads.is_empty() || !self.pending_store.is_empty()
    }

    /// Lazy mode: selects GPU blocks about to be evicted for the store that the next
    /// [`Self::schedule`] hands out, as `schedule`'s own `lazy_candidates` are. Returns
    /// the selected GPU block ids the caller must keep from now on (they are in that
    /// store's `held` blocks, released when it retires, but not in the next plan's
    /// `held_gpu_blocks`): none with [`PlannerConfig::stores_after_forward`], whose lazy
    /// store is copied before the next forward pass, the first that may write them.
    ///
    /// vLLM frees finished requests' blocks after the step's plan is built, and the next
    /// step may evict them before that plan's walk sees them; offering them when they
    /// are freed keeps them. Candidates carry their KV-cache group in their key, and each
    /// is stored under its group. Nothing is selected by an eager
    /// planner.
    pub fn offer_lazy(&mut self, candidates: impl IntoIterator<Item = LazyCandidate>) -> Vec<u32> {
        if !self.cfg.lazy {
            return Vec::new();
        }
        // Collecting a vector's iterator reuses its allocation.
        let candidates: Vec<LazyCandidate> = candidates.into_iter().collect();
        let chosen = select_lazy(
            &candidates,
            &mut self.cache,
            &mut self.pending_store,
            &mut self.stats,
        );
        if self.cfg.stores_after_forward {
            return Vec::new();
        }
        self.pending_store.offered.extend_from_slice(&chosen);
        chosen
    }

    /// Lazy mode: drops, in place and keeping the order of the rest, the candidates whose
    /// key the CPU tier holds or is storing already; [`Self::offer_lazy`] and
    /// [`Self::schedule`] would skip them, and they are counted as those calls count
    /// them (`dedup_skipped`). An eager planner, which selects no lazy candidate, keeps
    /// none.
    ///
    /// A caller that reads candidates out of a long free queue filters before it builds
    /// what it offers: most blocks a finished request frees were loaded from the CPU tier
    /// or stored to it before, and only the rest need their ids and hashes handed over.
    ///
    /// ```
    /// use offload_core::{BlockHash, BlockKey, GroupKind, Planner, PlannerConfig};
    ///
    /// let cfg = PlannerConfig::new(16, 8).with_lazy(true);
    /// let mut p = Planner::new(cfg, &[GroupKind::FullAttention]);
    /// let k = |h| BlockKey::new(0, BlockHash(h));
    /// assert_eq!(p.offer_lazy([(7, k(1))]), vec![7]);
    /// let mut freed = vec![(9, k(2)), (7, k(1)), (8, k(3))];
    /// p.retain_unstored(&mut freed, |c| &c.1);
    /// assert_eq!(freed, vec![(9, k(2)), (8, k(3))]);
    /// assert_eq!(p.stats().dedup_skipped, 1);
    /// ```
    pub fn retain_unstored<T>(&mut self, candidates: &mut Vec<T>, key: impl Fn(&T) -> &BlockKey) {
        if !self.cfg.lazy {
            candidates.clear();
            return;
        }
        // The index is far larger than the cache: its buckets are fetched for all the
        // candidates before the first is probed.
        for c in candidates.iter() {
            self.cache.prefetch_key(key(c));
        }
        let before = candidates.len();
        let cache = &self.cache;
        candidates.retain(|c| !cache.contains(key(c)));
        self.stats.dedup_skipped += (before - candidates.len()) as u64;
    }

    /// Whether [`Self::schedule`] reads the step's scheduled requests. A lazy planner
    /// stores only the lazy candidates and learns each request's GPU blocks from
    /// [`Self::on_alloc`], so its caller may pass no requests and skip building their
    /// lists every step.
    pub fn reads_scheduled_requests(&self) -> bool {
        !self.cfg.lazy
    }

    /// The tokens running request `req` must have confirmed before [`Self::schedule`] has
    /// anything to do for it in a step that brings it no new GPU blocks; `None` where
    /// every scheduled request must be passed every step (lazy planners, models with a
    /// group whose blocks the server frees from running requests, whose stores depend on
    /// each step's allocation; a request the planner does not track).
    ///
    /// Confirmed tokens are `num_computed_tokens`, plus `num_scheduled_tokens` with
    /// [`PlannerConfig::stores_after_forward`]. Below the answer, a step that leaves the
    /// request out plans exactly what a step passing it plans: most running requests
    /// of a decode step fill no block, and a server with hundreds of them may skip
    /// them without a lookup each.
    ///
    /// The answer moves only when a step passes the request, except when its hashes are
    /// found rewritten (a streaming session's next input, which vLLM schedules as a new
    /// or resumed request: passed anyway). A caller that keeps an answer from before
    /// such a rewrite only delays storing the rewritten blocks to the request's next
    /// block boundary, or to its finish, which flushes them.
    ///
    /// ```
    /// use offload_core::{GroupKind, Planner, PlannerConfig, ScheduleKind, ScheduledRequest};
    ///
    /// let mut p = Planner::new(PlannerConfig::new(16, 64), &[GroupKind::FullAttention]);
    /// let none: Vec<offload_core::BlockHash> = Vec::new();
    /// let new = ScheduledRequest {
    ///     req_id: "a",
    ///     kind: ScheduleKind::New,
    ///     num_computed_tokens: 0,
    ///     num_scheduled_tokens: 20,
    ///     gpu_blocks: vec![7, 8],
    ///     hashes: none,
    /// };
    /// p.schedule([new], []).unwrap();
    /// // Nothing confirmed or stored yet: its first full block is due at 16 tokens.
    /// assert_eq!(p.store_due("a"), Some(16));
    /// assert_eq!(p.store_due("unknown"), None);
    /// ```
    pub fn store_due(&self, req: &str) -> Option<usize> {
        if self.cfg.lazy || self.kinds.iter().any(|k| k.frees_running_blocks()) {
            return None;
        }
        let r = self.requests.get(req)?;
        Some((r.stored_upto() + 1) * self.block_size())
    }

    /// Whether transfers were chosen that the next [`Self::schedule`] hands out.
    pub fn has_pending_plan(&self) -> bool {
        !self.pending_loads.is_empty() || !self.pending_store.is_empty()
    }

    /// Number of requests the planner tracks (finished ones included until their
    /// transfers retire).
    pub fn num_requests(&self) -> usize {
        self.requests.len() + self.finishing.len()
    }

    fn block_size(&self) -> usize {
        self.cfg.block_size as usize
    }
}

/// The live request `req`, created with a fresh serial on first use.
fn live_entry<'a>(
    requests: &'a mut HashMap<String, Request, RandomState>,
    next_serial: &mut u64,
    req: &str,
) -> &'a mut Request {
    match requests.entry_ref(req) {
        hashbrown::hash_map::EntryRef::Occupied(e) => e.into_mut(),
        hashbrown::hash_map::EntryRef::Vacant(e) => {
            *next_serial += 1;
            e.insert(Request::new(*next_serial))
        }
    }
}
