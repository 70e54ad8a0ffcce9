//! [`Planner`]: the scheduler-side brain. It owns CPU block ids (never bytes), answers
//! prefix lookups, turns accepted hits into loads, selects blocks to store (eager or
//! lazy), and applies the completions that workers report.
//!
//! Protocol per engine step, mirroring vLLM's connector calls:
//! 1. [`Planner::extend_hashes`] + [`Planner::lookup`] for waiting requests (any number
//!    of times; hits are pinned until the load completes or the request is dropped);
//! 2. [`Planner::on_alloc`] once the scheduler accepted some of the hit;
//! 3. [`Planner::note_scheduled`] for every scheduled request (eager stores are chosen
//!    here) or [`Planner::select_lazy`] with GPU free-queue candidates;
//! 4. [`Planner::take_step`] to hand the step's transfers to the workers;
//! 5. [`Planner::complete`] as ranks report transfers done, then
//!    [`Planner::take_completions`].

use std::collections::HashMap;

use hashbrown::HashMap as FastMap;

use crate::cache::BlockCache;
use crate::error::PlanError;
use crate::events::{KvEvent, PlannerStats};
use crate::index::{BlockHash, BlockKey, BuildKeyHasher};
use crate::pool::{BlockId, BlockState};

/// Identifies one transfer (one load of a request, or one step's stores).
pub type TransferId = u64;

/// Geometry and mode of a planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannerConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// CPU blocks available on every rank (the minimum across ranks).
    pub num_cpu_blocks: u32,
    /// Ranks that must report a transfer before it is retired.
    pub world_size: u32,
    /// Lazy mode: stores come only from [`Planner::select_lazy`].
    pub lazy: bool,
    /// Buffer KV events for [`Planner::take_events`].
    pub events: bool,
    /// Loads complete within the step that needs them (workers wait before the forward
    /// pass), instead of the request waiting a step for an asynchronous load. Cheaper
    /// when KV lives in host memory (vLLM's CPU backend); GPUs overlap async loads.
    pub sync_loads: bool,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_cpu_blocks: 0,
            world_size: 1,
            lazy: false,
            events: false,
            sync_loads: false,
        }
    }
}

/// A copy from CPU blocks into a request's GPU blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// must report it failed (so vLLM recomputes), never wait for it.
    pub valid: bool,
    /// The request runs in this step: workers finish the load before the forward pass.
    pub sync: bool,
}

/// A copy from GPU blocks into CPU blocks, one per step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoreJob {
    /// The transfer id workers report back.
    pub id: TransferId,
    /// Source GPU blocks.
    pub gpu_blocks: Vec<u32>,
    /// Destination CPU blocks, pairwise with `gpu_blocks`.
    pub cpu_blocks: Vec<BlockId>,
    /// Requests whose blocks are read (a worker fences on these when one is preempted).
    pub req_ids: Vec<String>,
}

/// What workers must do this step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepPlan {
    /// Loads accepted since the previous step.
    pub loads: Vec<LoadJob>,
    /// Stores selected since the previous step.
    pub store: Option<StoreJob>,
}

impl StepPlan {
    /// Whether the step moves nothing.
    pub fn is_empty(&self) -> bool {
        self.loads.is_empty() && self.store.is_none()
    }
}

/// What retired transfers mean for vLLM.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Completions {
    /// Finished requests whose GPU blocks may now be freed (their `request_finished`
    /// returned `true`).
    pub finished_sending: Vec<String>,
    /// Requests whose load retired (successfully or not); they may now run.
    pub finished_recving: Vec<String>,
    /// GPU blocks of failed loads: vLLM must recompute them.
    pub load_error_blocks: Vec<u32>,
    /// GPU blocks of lazy stores that retired: the caller took a reference on them when
    /// it selected them and must now drop it.
    pub released_gpu_blocks: Vec<u32>,
}

#[derive(Debug, Default)]
struct Hit {
    start: usize,
    num_tokens: usize,
    blocks: Vec<BlockId>,
}

#[derive(Debug, Default)]
struct Request {
    hashes: Vec<BlockHash>,
    gpu_blocks: Vec<u32>,
    /// Blocks before this index were considered for storing already.
    stored_upto: usize,
    hit: Option<Hit>,
    stores_in_flight: u32,
    load_in_flight: bool,
    /// `request_finished` was called; report it this way once nothing is in flight.
    finished: Option<Report>,
    /// Part of the store job being assembled for the next [`StepPlan`].
    queued: bool,
}

/// How a finished request with transfers in flight is handed back to vLLM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Report {
    /// `request_finished` returned `true`: vLLM frees the blocks on `finished_sending`.
    Sending,
    /// It finished while its load ran: vLLM delays the free itself until
    /// `finished_recving` names it.
    Recving,
}

#[derive(Debug, Clone, Copy)]
struct StoreEntry {
    block: BlockId,
    hash: BlockHash,
    parent: Option<BlockHash>,
}

#[derive(Debug)]
enum JobKind {
    Load {
        req_id: String,
        blocks: Vec<BlockId>,
        gpu_blocks: Vec<u32>,
        sync: bool,
    },
    Store {
        entries: Vec<StoreEntry>,
        req_ids: Vec<String>,
        lazy_gpu_blocks: Vec<u32>,
    },
}

#[derive(Debug)]
struct Job {
    kind: JobKind,
    acks: u32,
    failed: bool,
}

#[derive(Debug, Default)]
struct PendingStore {
    entries: Vec<StoreEntry>,
    gpu_blocks: Vec<u32>,
    req_ids: Vec<String>,
    lazy: bool,
}

/// The scheduler-side planner of one engine.
///
/// # Examples
/// ```
/// use offload_core::{BlockHash, Planner, PlannerConfig};
///
/// let cfg = PlannerConfig { num_cpu_blocks: 64, ..PlannerConfig::default() };
/// let mut planner = Planner::new(cfg);
/// let hashes: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
///
/// // First request: computes 64 tokens on the GPU; eager mode stores its 4 blocks.
/// planner.extend_hashes("a", hashes.iter().copied());
/// assert_eq!(planner.lookup("a", 65, 0).unwrap(), 0);
/// planner.on_alloc("a", &[10, 11, 12, 13, 14], 0, 0).unwrap();
/// planner.note_scheduled("a", 0, &[10, 11, 12, 13, 14], true).unwrap();
/// planner.note_scheduled("a", 64, &[], false).unwrap(); // next step: 64 tokens confirmed
/// let store = planner.take_step().store.unwrap();
/// assert_eq!(store.gpu_blocks, vec![10, 11, 12, 13]);
/// planner.complete(store.id, true).unwrap();
///
/// // A second request with the same prefix now hits all 4 blocks on CPU.
/// planner.extend_hashes("b", hashes.iter().copied());
/// assert_eq!(planner.lookup("b", 65, 0).unwrap(), 64);
/// planner.on_alloc("b", &[20, 21, 22, 23, 24], 0, 64).unwrap();
/// let load = planner.take_step().loads.remove(0);
/// assert_eq!(load.gpu_blocks, vec![20, 21, 22, 23]);
/// assert_eq!(load.cpu_blocks, store.cpu_blocks);
/// ```
#[derive(Debug)]
pub struct Planner {
    cfg: PlannerConfig,
    cache: BlockCache,
    // Request ids and transfer ids are generated by the server, not by clients, so the
    // cheap multiplicative hasher is safe and keeps per-step lookups fast.
    requests: FastMap<String, Request, BuildKeyHasher>,
    jobs: HashMap<TransferId, Job, BuildKeyHasher>,
    next_id: TransferId,
    pending_loads: Vec<LoadJob>,
    pending_store: PendingStore,
    completions: Completions,
    stats: PlannerStats,
}

/// The KV-cache group the planner works on. vLLM puts every layer of a full-attention
/// model into one group; models with several groups are rejected by the connector.
const GROUP: u32 = 0;

impl Planner {
    /// A planner with an empty CPU pool of `cfg.num_cpu_blocks` blocks.
    pub fn new(cfg: PlannerConfig) -> Self {
        Self {
            cache: BlockCache::new(cfg.num_cpu_blocks, cfg.events),
            cfg: PlannerConfig {
                world_size: cfg.world_size.max(1),
                block_size: cfg.block_size.max(1),
                ..cfg
            },
            requests: FastMap::with_hasher(BuildKeyHasher),
            jobs: HashMap::with_hasher(BuildKeyHasher),
            next_id: 1,
            pending_loads: Vec::new(),
            pending_store: PendingStore::default(),
            completions: Completions::default(),
            stats: PlannerStats::default(),
        }
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

    /// Number of hashes known for `req` (0 for an unknown request): the caller passes
    /// only the hashes after these to [`Self::extend_hashes`].
    pub fn num_hashes(&self, req: &str) -> usize {
        self.requests.get(req).map_or(0, |r| r.hashes.len())
    }

    /// Appends block hashes to `req`, creating the request on first use.
    pub fn extend_hashes(&mut self, req: &str, hashes: impl IntoIterator<Item = BlockHash>) {
        self.requests
            .entry_ref(req)
            .or_default()
            .hashes
            .extend(hashes);
    }

    /// Tokens of `req` that can be loaded from CPU after its first `num_computed_tokens`
    /// (its GPU prefix hit), given that the prompt has `num_tokens` tokens.
    ///
    /// The hit is the longest run of consecutive blocks whose stores completed, ends at
    /// least one token before the end (the last token is always recomputed), and is
    /// pinned until [`Self::on_alloc`] or [`Self::request_finished`]. Asking again with
    /// the same arguments is answered from the pinned result unless the index gained
    /// the block after it.
    pub fn lookup(
        &mut self,
        req: &str,
        num_tokens: usize,
        num_computed_tokens: usize,
    ) -> Result<usize, PlanError> {
        let bs = self.block_size();
        self.stats.lookups += 1;
        let r = self
            .requests
            .get_mut(req)
            .ok_or_else(|| PlanError::UnknownRequest(req.to_string()))?;
        if num_computed_tokens % bs != 0 || self.cache.capacity() == 0 {
            release_hit(&mut self.cache, r);
            return Ok(0);
        }
        let start = num_computed_tokens / bs;
        let limit = (num_tokens.saturating_sub(1) / bs).min(r.hashes.len());
        if let Some(hit) = &mut r.hit {
            let end = hit.start + hit.blocks.len();
            // vLLM asks again every step while the request waits; its GPU hit may have
            // grown meanwhile. The pinned run stays valid: drop what the GPU now covers
            // and extend it only if the index gained the blocks after it.
            if hit.num_tokens == num_tokens && hit.start <= start && start <= end && end <= limit {
                let covered = start - hit.start;
                for b in hit.blocks.drain(..covered) {
                    let _ = self.cache.unpin(b);
                }
                hit.start = start;
                let mut grew = false;
                for h in &r.hashes[end..limit] {
                    let Some(b) = self.cache.get_ready(&BlockKey::new(GROUP, *h)) else {
                        break;
                    };
                    // The block is ready, hence in range and pinnable.
                    let _ = self.cache.pin(b);
                    hit.blocks.push(b);
                    grew = true;
                }
                if covered == 0 && !grew {
                    self.stats.cached_lookups += 1;
                }
                return Ok(hit.blocks.len() * bs);
            }
        }
        release_hit(&mut self.cache, r);
        // Probe the whole run first, then pin: independent probes overlap their cache
        // misses, and the pins then find the lines warm.
        let mut blocks = Vec::new();
        for h in &r.hashes[start.min(limit)..limit] {
            let Some(b) = self.cache.get_ready(&BlockKey::new(GROUP, *h)) else {
                break;
            };
            blocks.push(b);
        }
        for &b in &blocks {
            // The block is ready, hence in range and pinnable.
            let _ = self.cache.pin(b);
        }
        let tokens = blocks.len() * bs;
        r.hit = Some(Hit {
            start,
            num_tokens,
            blocks,
        });
        Ok(tokens)
    }

    /// The scheduler allocated GPU blocks for `req` and accepted `num_external_tokens`
    /// of its hit (possibly fewer than offered, possibly none).
    ///
    /// `gpu_blocks` are all of the request's GPU block ids, starting at token 0;
    /// `num_computed_tokens` is its GPU prefix hit, used only when no lookup result is
    /// pinned (the hit records where it starts). An accepted hit becomes a load in
    /// the next [`StepPlan`]; pins on the part not accepted are released. A load asked
    /// for without a matching pinned hit becomes an invalid [`LoadJob`] that workers
    /// report failed, so the request is recomputed instead of waiting forever.
    pub fn on_alloc(
        &mut self,
        req: &str,
        gpu_blocks: &[u32],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> Result<(), PlanError> {
        let bs = self.block_size();
        let r = self
            .requests
            .get_mut(req)
            .ok_or_else(|| PlanError::UnknownRequest(req.to_string()))?;
        if num_external_tokens == 0 {
            release_hit(&mut self.cache, r);
            return Ok(());
        }
        let k = num_external_tokens.div_ceil(bs);
        let (mut hit, start) = match r.hit.take() {
            Some(hit) => {
                let start = hit.start;
                (hit, start)
            }
            None => (Hit::default(), num_computed_tokens / bs),
        };
        let valid =
            num_external_tokens % bs == 0 && k <= hit.blocks.len() && start + k <= gpu_blocks.len();
        let id = self.next_id;
        self.next_id += 1;
        let gpu = gpu_blocks
            .get(start..(start + k).min(gpu_blocks.len()))
            .unwrap_or_default()
            .to_vec();
        let blocks = if valid {
            for b in hit.blocks.drain(k..) {
                let _ = self.cache.unpin(b);
            }
            std::mem::take(&mut hit.blocks)
        } else {
            log::warn!(
                "kvoffload: load of {num_external_tokens} tokens for request {req} has no \
                 matching CPU hit; reporting it failed so vLLM recomputes"
            );
            for b in hit.blocks.drain(..) {
                let _ = self.cache.unpin(b);
            }
            Vec::new()
        };
        self.stats.hit_tokens += num_external_tokens as u64;
        self.stats.load_blocks += blocks.len() as u64;
        let sync = self.cfg.sync_loads;
        // A synchronous load is over before the request's forward pass: vLLM never waits
        // on it, so it is not the request's business after this step.
        r.load_in_flight = !sync;
        self.pending_loads.push(LoadJob {
            id,
            req_id: req.to_string(),
            gpu_blocks: gpu.clone(),
            cpu_blocks: blocks.clone(),
            valid,
            sync,
        });
        self.jobs.insert(
            id,
            Job {
                kind: JobKind::Load {
                    req_id: req.to_string(),
                    blocks,
                    gpu_blocks: gpu,
                    sync,
                },
                acks: 0,
                failed: !valid,
            },
        );
        Ok(())
    }

    /// Records that `req` runs this step with `num_computed_tokens` tokens computed before
    /// it, and GPU blocks `new_blocks` added (`replace`: the list is the whole block
    /// table, for new or resumed requests). In eager mode every newly confirmed full
    /// block not on CPU or in flight is selected for storing; a new or resumed request's
    /// blocks are confirmed from its second scheduled step (or its finish) on.
    ///
    /// Returns `true` when confirmed blocks lack hashes (vLLM computes a block's hash once
    /// it is full): pass them with [`Self::extend_hashes`], then call
    /// [`Self::store_confirmed`]. One map lookup per call otherwise, as this runs for every
    /// running request every step.
    pub fn note_scheduled(
        &mut self,
        req: &str,
        num_computed_tokens: usize,
        new_blocks: &[u32],
        replace: bool,
    ) -> Result<bool, PlanError> {
        let bs = self.block_size();
        let r = self.requests.entry_ref(req).or_default();
        if replace {
            r.gpu_blocks.clear();
        }
        r.gpu_blocks.extend_from_slice(new_blocks);
        // A new or resumed request's computed tokens are its GPU prefix hit, which may
        // name blocks another request computes in this very step (vLLM hashes blocks
        // when it allocates them). They are confirmed from its next step on.
        if self.cfg.lazy || replace {
            return Ok(false);
        }
        if num_computed_tokens / bs > r.hashes.len() {
            return Ok(true);
        }
        select_eager(
            req,
            r,
            num_computed_tokens / bs,
            &mut self.cache,
            &mut self.pending_store,
            &mut self.stats,
        );
        Ok(false)
    }

    /// Eager mode: selects `req`'s blocks confirmed by `num_computed_tokens` that are not
    /// on CPU or in flight (after [`Self::note_scheduled`] asked for more hashes).
    pub fn store_confirmed(&mut self, req: &str, num_computed_tokens: usize) {
        let bs = self.block_size();
        if self.cfg.lazy {
            return;
        }
        if let Some(r) = self.requests.get_mut(req) {
            select_eager(
                req,
                r,
                num_computed_tokens / bs,
                &mut self.cache,
                &mut self.pending_store,
                &mut self.stats,
            );
        }
    }

    /// `req` finished with `num_computed_tokens` computed. In eager mode its remaining
    /// full blocks are flushed to CPU. Returns whether vLLM must keep its GPU blocks
    /// until [`Completions::finished_sending`] names it (a transfer still uses them).
    pub fn request_finished(
        &mut self,
        req: &str,
        num_computed_tokens: usize,
    ) -> Result<bool, PlanError> {
        if !self.requests.contains_key(req) {
            return Ok(false);
        }
        self.store_confirmed(req, num_computed_tokens);
        let Some(r) = self.requests.get_mut(req) else {
            return Ok(false);
        };
        release_hit(&mut self.cache, r);
        if r.load_in_flight {
            // vLLM keeps the blocks of a request aborted while loading until
            // `finished_recving`; that report waits for its stores too.
            r.finished = Some(Report::Recving);
            Ok(false)
        } else if r.stores_in_flight > 0 {
            r.finished = Some(Report::Sending);
            Ok(true)
        } else {
            self.requests.remove(req);
            Ok(false)
        }
    }

    /// Lazy mode: considers GPU blocks about to be evicted, in the order given (least
    /// recently used first), and selects those not on CPU or in flight. Returns the
    /// selected GPU block ids: the caller must keep them from being reused until they
    /// come back in [`Completions::released_gpu_blocks`].
    pub fn select_lazy(
        &mut self,
        candidates: impl IntoIterator<Item = (u32, BlockKey)>,
    ) -> Vec<u32> {
        let mut chosen = Vec::new();
        for (gpu, key) in candidates {
            if self.cache.contains(&key) {
                self.stats.dedup_skipped += 1;
                continue;
            }
            let Some(block) = self.cache.reserve(key) else {
                self.stats.no_space_skipped += 1;
                break;
            };
            self.pending_store.entries.push(StoreEntry {
                block,
                hash: key.hash,
                parent: None,
            });
            self.pending_store.gpu_blocks.push(gpu);
            self.pending_store.lazy = true;
            chosen.push(gpu);
        }
        chosen
    }

    /// Hands over the transfers chosen since the previous call.
    pub fn take_step(&mut self) -> StepPlan {
        let loads = std::mem::take(&mut self.pending_loads);
        let pending = std::mem::take(&mut self.pending_store);
        if pending.entries.is_empty() {
            return StepPlan { loads, store: None };
        }
        let id = self.next_id;
        self.next_id += 1;
        self.stats.store_blocks += pending.entries.len() as u64;
        for req in &pending.req_ids {
            if let Some(r) = self.requests.get_mut(req.as_str()) {
                r.queued = false;
            }
        }
        let store = StoreJob {
            id,
            gpu_blocks: pending.gpu_blocks.clone(),
            cpu_blocks: pending.entries.iter().map(|e| e.block).collect(),
            req_ids: pending.req_ids.clone(),
        };
        self.jobs.insert(
            id,
            Job {
                kind: JobKind::Store {
                    entries: pending.entries,
                    req_ids: pending.req_ids,
                    lazy_gpu_blocks: if pending.lazy {
                        pending.gpu_blocks
                    } else {
                        Vec::new()
                    },
                },
                acks: 0,
                failed: false,
            },
        );
        StepPlan {
            loads,
            store: Some(store),
        }
    }

    /// One rank reports transfer `id` done (`ok`) or failed. Once every rank reported,
    /// the transfer retires: stored blocks are published (or dropped if any rank
    /// failed), loaded blocks unpinned, and [`Self::take_completions`] says what vLLM
    /// must learn.
    pub fn complete(&mut self, id: TransferId, ok: bool) -> Result<(), PlanError> {
        let job = self
            .jobs
            .get_mut(&id)
            .ok_or(PlanError::UnknownTransfer(id))?;
        job.acks += 1;
        job.failed |= !ok;
        if job.acks < self.cfg.world_size {
            return Ok(());
        }
        let Some(job) = self.jobs.remove(&id) else {
            return Ok(());
        };
        match job.kind {
            JobKind::Load {
                req_id,
                blocks,
                gpu_blocks,
                sync,
            } => {
                for b in blocks {
                    let _ = self.cache.unpin(b);
                }
                if job.failed {
                    self.stats.failed_loads += 1;
                    self.completions.load_error_blocks.extend(gpu_blocks);
                }
                if sync {
                    return Ok(());
                }
                match self.requests.get_mut(&req_id) {
                    Some(r) if r.finished.is_some() => {
                        r.load_in_flight = false;
                        self.retire_if_done(&req_id);
                    }
                    Some(r) => {
                        r.load_in_flight = false;
                        self.completions.finished_recving.push(req_id);
                    }
                    None => self.completions.finished_recving.push(req_id),
                }
            }
            JobKind::Store {
                entries,
                req_ids,
                lazy_gpu_blocks,
            } => {
                if job.failed {
                    self.stats.failed_stores += 1;
                    for e in &entries {
                        let _ = self.cache.abort(e.block);
                    }
                } else {
                    self.publish(&entries);
                }
                self.completions.released_gpu_blocks.extend(lazy_gpu_blocks);
                for req in &req_ids {
                    if let Some(r) = self.requests.get_mut(req) {
                        r.stores_in_flight = r.stores_in_flight.saturating_sub(1);
                    }
                    self.retire_if_done(req);
                }
            }
        }
        Ok(())
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

    /// Takes what retired transfers mean for vLLM since the previous call.
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
            // Keep where each pinned hit started, so a load vLLM still asks for is
            // reported failed against the right GPU blocks.
            if let Some(hit) = &mut r.hit {
                for b in hit.blocks.drain(..) {
                    let _ = self.cache.unpin(b);
                }
            }
        }
        self.cache.clear();
    }

    /// Whether any transfer is issued but not retired, or chosen but not yet issued.
    pub fn has_work_in_flight(&self) -> bool {
        !self.jobs.is_empty()
            || !self.pending_loads.is_empty()
            || !self.pending_store.entries.is_empty()
    }

    /// Number of requests the planner tracks.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    fn block_size(&self) -> usize {
        self.cfg.block_size as usize
    }

    fn publish(&mut self, entries: &[StoreEntry]) {
        let block_size = self.cfg.block_size;
        let mut chain: Option<(Vec<BlockHash>, Option<BlockHash>)> = None;
        for e in entries {
            // A block detached by a reset while in flight is released, not published.
            let published = self.cache.pool().state(e.block) == Some(BlockState::Pending);
            let _ = self.cache.publish(e.block);
            if !published {
                continue;
            }
            self.stats.stored_blocks += 1;
            if !self.cache.events_mut().enabled() {
                continue;
            }
            match &mut chain {
                Some((hashes, _)) if hashes.last().copied() == e.parent && e.parent.is_some() => {
                    hashes.push(e.hash);
                }
                _ => {
                    if let Some((hashes, parent)) = chain.take() {
                        self.cache.events_mut().push(KvEvent::Stored {
                            group: GROUP,
                            hashes,
                            parent,
                            block_size,
                        });
                    }
                    chain = Some((vec![e.hash], e.parent));
                }
            }
        }
        if let Some((hashes, parent)) = chain {
            self.cache.events_mut().push(KvEvent::Stored {
                group: GROUP,
                hashes,
                parent,
                block_size,
            });
        }
    }

    fn retire_if_done(&mut self, req: &str) {
        let report = match self.requests.get(req) {
            Some(r) if r.stores_in_flight == 0 && !r.load_in_flight => r.finished,
            _ => None,
        };
        let Some(report) = report else {
            return;
        };
        self.requests.remove(req);
        match report {
            Report::Sending => self.completions.finished_sending.push(req.to_string()),
            Report::Recving => self.completions.finished_recving.push(req.to_string()),
        }
    }
}

/// Selects `r`'s blocks `stored_upto..confirmed` that are neither on CPU nor in flight
/// into the store job being assembled. A free function over the planner's fields so the
/// request stays borrowed from the map (one lookup per scheduled request).
fn select_eager(
    req: &str,
    r: &mut Request,
    confirmed: usize,
    cache: &mut BlockCache,
    pending: &mut PendingStore,
    stats: &mut PlannerStats,
) {
    let confirmed = confirmed.min(r.hashes.len()).min(r.gpu_blocks.len());
    if confirmed <= r.stored_upto {
        return;
    }
    let mut selected = false;
    for i in r.stored_upto..confirmed {
        let key = BlockKey::new(GROUP, r.hashes[i]);
        if cache.contains(&key) {
            stats.dedup_skipped += 1;
            continue;
        }
        match cache.reserve(key) {
            Some(block) => {
                pending.entries.push(StoreEntry {
                    block,
                    hash: r.hashes[i],
                    parent: i.checked_sub(1).map(|p| r.hashes[p]),
                });
                pending.gpu_blocks.push(r.gpu_blocks[i]);
                selected = true;
            }
            None => {
                // Every CPU block is pinned or in flight; the rest would not fit either.
                stats.no_space_skipped += (confirmed - i) as u64;
                break;
            }
        }
    }
    r.stored_upto = confirmed;
    // A request selected twice in one step (scheduled, then finished) joins the step's
    // store job once; its in-flight count is per job.
    if selected && !r.queued {
        r.queued = true;
        r.stores_in_flight += 1;
        pending.req_ids.push(req.to_string());
    }
}

fn release_hit(cache: &mut BlockCache, r: &mut Request) {
    if let Some(hit) = r.hit.take() {
        for b in hit.blocks {
            let _ = cache.unpin(b);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use proptest::prelude::*;

    use super::*;

    const BS: usize = 16;

    fn planner(blocks: u32, world: u32, lazy: bool) -> Planner {
        Planner::new(PlannerConfig {
            block_size: BS as u32,
            num_cpu_blocks: blocks,
            world_size: world,
            lazy,
            events: true,
            sync_loads: false,
        })
    }

    fn hashes(prefix: u128, n: u128) -> Vec<BlockHash> {
        (0..n).map(|i| BlockHash(prefix * 1000 + i)).collect()
    }

    /// Runs `req` through a full prefill + finish and completes its stores.
    fn store_prompt(p: &mut Planner, req: &str, h: &[BlockHash], first_gpu: u32) {
        p.extend_hashes(req, h.iter().copied());
        p.lookup(req, h.len() * BS + 1, 0).unwrap();
        let gpu: Vec<u32> = (first_gpu..first_gpu + h.len() as u32 + 1).collect();
        p.on_alloc(req, &gpu, 0, 0).unwrap();
        p.note_scheduled(req, 0, &gpu, true).unwrap();
        p.request_finished(req, h.len() * BS).unwrap();
        let store = p.take_step().store.unwrap();
        for _ in 0..p.config().world_size {
            p.complete(store.id, true).unwrap();
        }
    }

    #[test]
    fn last_token_is_always_recomputed() {
        let mut p = planner(16, 1, false);
        let h = hashes(1, 4);
        store_prompt(&mut p, "a", &h, 0);
        p.extend_hashes("b", h.iter().copied());
        // 64 tokens = exactly 4 blocks: the 4th block holds the last token, so 3 hit.
        assert_eq!(p.lookup("b", 64, 0).unwrap(), 48);
        assert_eq!(p.lookup("b", 65, 0).unwrap(), 64);
    }

    #[test]
    fn hit_starts_after_the_gpu_prefix() {
        let mut p = planner(16, 1, false);
        let h = hashes(1, 4);
        store_prompt(&mut p, "a", &h, 0);
        p.extend_hashes("b", h.iter().copied());
        assert_eq!(p.lookup("b", 65, 32).unwrap(), 32);
        p.on_alloc("b", &[7, 8, 9, 10, 11], 32, 32).unwrap();
        let load = p.take_step().loads.remove(0);
        assert_eq!(load.gpu_blocks, vec![9, 10]);
        assert!(load.valid);
        // A GPU prefix that is not block aligned gets no CPU hit.
        p.extend_hashes("c", h.iter().copied());
        assert_eq!(p.lookup("c", 65, 20).unwrap(), 0);
    }

    #[test]
    fn repeated_lookups_are_cached_until_the_index_grows() {
        let mut p = planner(16, 1, false);
        let h = hashes(1, 4);
        store_prompt(&mut p, "a", &h[..2], 0);
        p.extend_hashes("b", h.iter().copied());
        assert_eq!(p.lookup("b", 65, 0).unwrap(), 32);
        assert_eq!(p.lookup("b", 65, 0).unwrap(), 32);
        assert_eq!(p.stats().cached_lookups, 1);
        // Pins are not taken twice for one request.
        let b0 = p.cache().get_ready(&BlockKey::new(0, h[0])).unwrap();
        assert_eq!(p.cache().pool().ref_count(b0), Some(1));
        store_prompt(&mut p, "c", &h, 10);
        assert_eq!(p.lookup("b", 65, 0).unwrap(), 64);
        assert_eq!(p.cache().pool().ref_count(b0), Some(1));
    }

    #[test]
    fn a_grown_gpu_hit_reuses_the_pinned_run() {
        let mut p = planner(16, 1, false);
        let h = hashes(1, 4);
        store_prompt(&mut p, "a", &h, 0);
        p.extend_hashes("b", h.iter().copied());
        assert_eq!(p.lookup("b", 65, 0).unwrap(), 64);
        // The GPU now caches the first two blocks: only the last two come from CPU.
        assert_eq!(p.lookup("b", 65, 32).unwrap(), 32);
        let pinned: u32 = (0..16)
            .map(|b| p.cache().pool().ref_count(b).unwrap())
            .sum();
        assert_eq!(pinned, 2);
        // It shrinks again: a fresh lookup from the new start.
        assert_eq!(p.lookup("b", 65, 16).unwrap(), 48);
        let pinned: u32 = (0..16)
            .map(|b| p.cache().pool().ref_count(b).unwrap())
            .sum();
        assert_eq!(pinned, 3);
        p.on_alloc("b", &[9, 9, 9, 9, 9], 16, 48).unwrap();
        let load = p.take_step().loads.remove(0);
        assert_eq!(load.cpu_blocks.len(), 3);
    }

    #[test]
    fn partially_accepted_hit_unpins_the_rest() {
        let mut p = planner(16, 1, false);
        let h = hashes(1, 4);
        store_prompt(&mut p, "a", &h, 0);
        p.extend_hashes("b", h.iter().copied());
        assert_eq!(p.lookup("b", 65, 0).unwrap(), 64);
        p.on_alloc("b", &[20, 21, 22, 23, 24], 0, 16).unwrap();
        let load = p.take_step().loads.remove(0);
        assert_eq!(load.cpu_blocks.len(), 1);
        let pinned: u32 = (0..16)
            .map(|b| p.cache().pool().ref_count(b).unwrap())
            .sum();
        assert_eq!(pinned, 1);
        p.complete(load.id, true).unwrap();
        let pinned: u32 = (0..16)
            .map(|b| p.cache().pool().ref_count(b).unwrap())
            .sum();
        assert_eq!(pinned, 0);
    }

    #[test]
    fn load_without_a_hit_is_reported_failed_not_stranded() {
        let mut p = planner(16, 1, false);
        p.extend_hashes("b", hashes(1, 4));
        assert_eq!(p.lookup("b", 65, 0).unwrap(), 0);
        p.on_alloc("b", &[5, 6, 7, 8, 9], 0, 32).unwrap();
        let load = p.take_step().loads.remove(0);
        assert!(!load.valid);
        assert_eq!(load.gpu_blocks, vec![5, 6]);
        p.complete(load.id, false).unwrap();
        let c = p.take_completions();
        assert_eq!(c.finished_recving, vec!["b".to_string()]);
        assert_eq!(c.load_error_blocks, vec![5, 6]);
        assert_eq!(p.stats().failed_loads, 1);
    }

    #[test]
    fn prefix_hit_blocks_of_a_new_request_wait_one_step() {
        let mut p = planner(16, 1, false);
        p.extend_hashes("a", hashes(1, 2));
        // Its 32 computed tokens are a GPU hit on blocks computed in this same step.
        p.note_scheduled("a", 32, &[0, 1, 2], true).unwrap();
        assert!(p.take_step().store.is_none());
        p.note_scheduled("a", 40, &[], false).unwrap();
        assert_eq!(p.take_step().store.unwrap().gpu_blocks, vec![0, 1]);
    }

    #[test]
    fn blocks_without_hashes_are_asked_for_then_stored() {
        let mut p = planner(16, 1, false);
        let h = hashes(1, 3);
        p.extend_hashes("a", h[..1].iter().copied());
        assert!(!p.note_scheduled("a", 0, &[0, 1, 2], true).unwrap());
        // Decoding filled blocks 1 and 2 since vLLM last showed us the hash list.
        assert!(p.note_scheduled("a", 48, &[], false).unwrap());
        assert!(p.take_step().store.is_none());
        p.extend_hashes("a", h[1..].iter().copied());
        p.store_confirmed("a", 48);
        assert_eq!(p.take_step().store.unwrap().gpu_blocks, vec![0, 1, 2]);
        assert!(!p.note_scheduled("a", 48, &[], false).unwrap());
    }

    #[test]
    fn shared_prefix_is_stored_once() {
        let mut p = planner(16, 1, false);
        let h = hashes(1, 2);
        for (req, gpu) in [("a", [0u32, 1, 2]), ("b", [3, 4, 5])] {
            p.extend_hashes(req, h.iter().copied());
            p.note_scheduled(req, 0, &gpu, true).unwrap();
            p.note_scheduled(req, 32, &[], false).unwrap();
        }
        let store = p.take_step().store.unwrap();
        assert_eq!(store.gpu_blocks, vec![0, 1]);
        assert_eq!(store.req_ids, vec!["a".to_string()]);
        assert_eq!(p.stats().dedup_skipped, 2);
    }

    #[test]
    fn stores_publish_only_after_every_rank() {
        let mut p = planner(16, 2, false);
        let h = hashes(1, 2);
        p.extend_hashes("a", h.iter().copied());
        p.note_scheduled("a", 0, &[0, 1, 2], true).unwrap();
        p.note_scheduled("a", 32, &[], false).unwrap();
        let store = p.take_step().store.unwrap();
        p.complete(store.id, true).unwrap();
        assert_eq!(p.cache().ready_prefix(0, &h), 0);
        p.complete(store.id, true).unwrap();
        assert_eq!(p.cache().ready_prefix(0, &h), 2);
        assert_eq!(
            p.complete(store.id, true),
            Err(PlanError::UnknownTransfer(store.id))
        );
    }

    #[test]
    fn store_failed_on_one_rank_is_never_published() {
        let mut p = planner(16, 2, false);
        let h = hashes(1, 2);
        p.extend_hashes("a", h.iter().copied());
        p.note_scheduled("a", 0, &[0, 1, 2], true).unwrap();
        p.note_scheduled("a", 32, &[], false).unwrap();
        let store = p.take_step().store.unwrap();
        p.complete(store.id, false).unwrap();
        p.complete(store.id, true).unwrap();
        assert_eq!(p.cache().ready_prefix(0, &h), 0);
        assert_eq!(p.cache().pool().num_free(), 16);
        assert_eq!(p.stats().failed_stores, 1);
    }

    #[test]
    fn finished_request_waits_for_its_stores() {
        let mut p = planner(16, 1, false);
        p.extend_hashes("a", hashes(1, 3));
        p.note_scheduled("a", 0, &[0, 1, 2], true).unwrap();
        p.note_scheduled("a", 32, &[], false).unwrap();
        let first = p.take_step().store.unwrap();
        // Finishing flushes block 2 too; vLLM must keep the GPU blocks meanwhile.
        assert!(p.request_finished("a", 48).unwrap());
        let flush = p.take_step().store.unwrap();
        assert_eq!(flush.gpu_blocks, vec![2]);
        p.complete(first.id, true).unwrap();
        assert!(p.take_completions().finished_sending.is_empty());
        p.complete(flush.id, true).unwrap();
        assert_eq!(p.take_completions().finished_sending, vec!["a".to_string()]);
        assert_eq!(p.num_requests(), 0);
    }

    #[test]
    fn request_aborted_while_loading_is_reported_by_recving_only() {
        let mut p = planner(16, 1, false);
        let h = hashes(1, 2);
        store_prompt(&mut p, "a", &h, 0);
        p.extend_hashes("b", h.iter().copied());
        assert_eq!(p.lookup("b", 33, 0).unwrap(), 32);
        p.on_alloc("b", &[5, 6, 7], 0, 32).unwrap();
        let load = p.take_step().loads.remove(0);
        // vLLM delays the free of a loading request itself.
        assert!(!p.request_finished("b", 0).unwrap());
        assert!(p.take_completions().finished_recving.is_empty());
        p.complete_all([(load.id, true), (9999, true)]).unwrap_err();
        let c = p.take_completions();
        assert_eq!(c.finished_recving, vec!["b".to_string()]);
        assert!(c.finished_sending.is_empty());
        assert_eq!(p.num_requests(), 0);
    }

    #[test]
    fn sync_loads_are_not_reported_to_vllm_as_received() {
        let mut p = Planner::new(PlannerConfig {
            num_cpu_blocks: 16,
            sync_loads: true,
            ..PlannerConfig::default()
        });
        let h = hashes(1, 2);
        store_prompt(&mut p, "a", &h, 0);
        p.take_completions();
        p.extend_hashes("b", h.iter().copied());
        assert_eq!(p.lookup("b", 33, 0).unwrap(), 32);
        p.on_alloc("b", &[5, 6, 7], 0, 32).unwrap();
        let load = p.take_step().loads.remove(0);
        assert!(load.sync);
        // It finishes in the step of its load: vLLM frees its blocks right away.
        assert!(!p.request_finished("b", 33).unwrap());
        p.complete(load.id, true).unwrap();
        let c = p.take_completions();
        assert!(c.finished_recving.is_empty() && c.finished_sending.is_empty());
        let pinned: u32 = (0..16)
            .map(|b| p.cache().pool().ref_count(b).unwrap())
            .sum();
        assert_eq!(pinned, 0);
    }

    #[test]
    fn request_without_transfers_is_freed_at_once() {
        let mut p = planner(16, 1, false);
        p.extend_hashes("a", hashes(1, 1));
        assert!(!p.request_finished("a", 8).unwrap());
        assert!(!p.request_finished("never-seen", 8).unwrap());
        assert_eq!(p.num_requests(), 0);
    }

    #[test]
    fn reset_hides_everything_stored_before_it() {
        let mut p = planner(16, 1, false);
        let h = hashes(1, 2);
        store_prompt(&mut p, "a", &h, 0);
        p.extend_hashes("b", h.iter().copied());
        assert_eq!(p.lookup("b", 33, 0).unwrap(), 32);
        // A store in flight across the reset.
        p.extend_hashes("c", hashes(2, 1));
        p.note_scheduled("c", 0, &[9, 10], true).unwrap();
        p.note_scheduled("c", 16, &[], false).unwrap();
        let late = p.take_step().store.unwrap();
        p.reset();
        p.complete(late.id, true).unwrap();
        assert_eq!(p.lookup("b", 33, 0).unwrap(), 0);
        assert_eq!(p.cache().ready_prefix(0, &hashes(2, 1)), 0);
        assert_eq!(p.cache().pool().num_free(), 16);
        p.cache().check_invariants().unwrap();
    }

    #[test]
    fn lazy_mode_stores_only_candidates_and_releases_them() {
        let mut p = planner(4, 1, true);
        p.extend_hashes("a", hashes(1, 2));
        p.note_scheduled("a", 0, &[0, 1, 2], true).unwrap();
        p.note_scheduled("a", 32, &[], false).unwrap();
        assert!(p.take_step().is_empty());
        let k = |h| BlockKey::new(0, BlockHash(h));
        let chosen = p.select_lazy([(7, k(1)), (8, k(2)), (9, k(1))]);
        assert_eq!(chosen, vec![7, 8]);
        let store = p.take_step().store.unwrap();
        assert!(store.req_ids.is_empty());
        p.complete(store.id, true).unwrap();
        assert_eq!(p.take_completions().released_gpu_blocks, vec![7, 8]);
        assert_eq!(p.select_lazy([(7, k(1))]), Vec::<u32>::new());
    }

    #[test]
    fn stored_events_chain_parents_and_removals_follow_evictions() {
        let mut p = planner(2, 1, false);
        let h = hashes(1, 2);
        store_prompt(&mut p, "a", &h, 0);
        assert_eq!(
            p.take_events(),
            vec![KvEvent::Stored {
                group: 0,
                hashes: h.clone(),
                parent: None,
                block_size: BS as u32
            }]
        );
        store_prompt(&mut p, "b", &hashes(2, 1), 10);
        let events = p.take_events();
        assert_eq!(
            events[0],
            KvEvent::Removed {
                group: 0,
                hashes: vec![h[0]]
            }
        );
    }

    // ---- state machine: planner + simulated workers against a reference model ----

    #[derive(Debug, Clone)]
    enum Op {
        /// A new request over prompt family `0`, `1` blocks long (+ unique tail `2`).
        Arrive(u8, u8, bool),
        Lookup(u8),
        /// Allocate with the given fraction (0..=4 quarters) of the hit accepted.
        Alloc(u8, u8),
        /// Schedule `1` more blocks of computation.
        Run(u8, u8),
        Finish(u8),
        Step,
        /// Rank reports a random in-flight transfer; `1`: success.
        Complete(u8, bool),
        Reset,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u8..3, 1u8..8, any::<bool>()).prop_map(|(f, n, u)| Op::Arrive(f, n, u)),
            4 => any::<u8>().prop_map(Op::Lookup),
            3 => (any::<u8>(), 0u8..5).prop_map(|(r, q)| Op::Alloc(r, q)),
            4 => (any::<u8>(), 1u8..4).prop_map(|(r, n)| Op::Run(r, n)),
            2 => any::<u8>().prop_map(Op::Finish),
            3 => Just(Op::Step),
            6 => (any::<u8>(), prop::bool::weighted(0.9)).prop_map(|(i, ok)| Op::Complete(i, ok)),
            1 => Just(Op::Reset),
        ]
    }

    #[derive(Debug)]
    struct ModelReq {
        id: String,
        hashes: Vec<BlockHash>,
        gpu: Vec<u32>,
        computed: usize,
        allocated: bool,
        offered: usize,
        loading: bool,
        finished: bool,
        /// A reset happened between the lookup and the allocation.
        stale: bool,
    }

    #[derive(Debug)]
    struct Flight {
        id: TransferId,
        pairs: Vec<(u32, BlockId)>,
        store: bool,
        valid: bool,
        expect: Vec<BlockHash>,
        acks: u32,
    }

    fn run_model(ops: Vec<Op>, world: u32, lazy: bool) -> Result<(), TestCaseError> {
        const CAP: u32 = 12;
        let mut p = planner(CAP, world, lazy);
        let mut reqs: Vec<ModelReq> = Vec::new();
        // What each GPU block holds (written when a request computes it or loads it).
        let mut gpu_mem: HashMap<u32, BlockHash> = HashMap::new();
        // What each CPU block holds (written when a store copy runs).
        let mut cpu_mem: HashMap<BlockId, BlockHash> = HashMap::new();
        let mut flights: Vec<Flight> = Vec::new();
        let mut next_gpu = 0u32;
        let mut next_req = 0u32;
        for op in ops {
            match op {
                Op::Arrive(family, n, unique) => {
                    let mut h = hashes(u128::from(family) + 1, u128::from(n));
                    if unique {
                        h.push(BlockHash(1_000_000 + u128::from(next_req)));
                    }
                    let id = format!("r{next_req}");
                    next_req += 1;
                    p.extend_hashes(&id, h.iter().copied());
                    reqs.push(ModelReq {
                        id,
                        hashes: h,
                        gpu: Vec::new(),
                        computed: 0,
                        allocated: false,
                        offered: 0,
                        loading: false,
                        finished: false,
                        stale: false,
                    });
                }
                Op::Lookup(i) if !reqs.is_empty() => {
                    let count = reqs.len();
                    let r = &mut reqs[usize::from(i) % count];
                    if r.allocated || r.finished {
                        continue;
                    }
                    let tokens = r.hashes.len() * BS + 1;
                    let hit = p.lookup(&r.id, tokens, 0).unwrap();
                    prop_assert!(hit % BS == 0 && hit < tokens);
                    // Every hit block is servable: ready and holding the right bytes.
                    for (i, h) in r.hashes[..hit / BS].iter().enumerate() {
                        let b = p.cache().get_ready(&BlockKey::new(0, *h));
                        prop_assert!(b.is_some(), "hit block {} not ready", i);
                    }
                    r.offered = hit;
                    r.stale = false;
                }
                Op::Alloc(i, quarters) if !reqs.is_empty() => {
                    let count = reqs.len();
                    let r = &mut reqs[usize::from(i) % count];
                    if r.allocated || r.finished {
                        continue;
                    }
                    let accept = (r.offered / BS * usize::from(quarters) / 4) * BS;
                    r.gpu = (next_gpu..next_gpu + r.hashes.len() as u32 + 1).collect();
                    next_gpu += r.gpu.len() as u32;
                    p.on_alloc(&r.id, &r.gpu, 0, accept).unwrap();
                    p.note_scheduled(&r.id, 0, &r.gpu, true).unwrap();
                    r.allocated = true;
                    r.loading = accept > 0;
                    r.computed = accept;
                }
                Op::Run(i, n) if !reqs.is_empty() => {
                    let count = reqs.len();
                    let r = &mut reqs[usize::from(i) % count];
                    if !r.allocated || r.loading || r.finished {
                        continue;
                    }
                    // This step computes `n` more blocks: the planner only sees the
                    // tokens computed in earlier steps.
                    p.note_scheduled(&r.id, r.computed, &[], false).unwrap();
                    let end = (r.computed / BS + usize::from(n)).min(r.hashes.len());
                    for b in r.computed / BS..end {
                        gpu_mem.insert(r.gpu[b], r.hashes[b]);
                    }
                    r.computed = end * BS;
                }
                Op::Finish(i) if !reqs.is_empty() => {
                    let count = reqs.len();
                    let r = &mut reqs[usize::from(i) % count];
                    if r.finished || r.loading {
                        continue;
                    }
                    p.request_finished(&r.id, r.computed).unwrap();
                    r.finished = true;
                }
                Op::Step => {
                    if lazy {
                        // Offer every computed block of finished requests, oldest first.
                        let cands: Vec<(u32, BlockKey)> = reqs
                            .iter()
                            .filter(|r| r.finished)
                            .flat_map(|r| {
                                (0..r.computed / BS)
                                    .map(|b| (r.gpu[b], BlockKey::new(0, r.hashes[b])))
                            })
                            .collect();
                        p.select_lazy(cands);
                    }
                    let plan = p.take_step();
                    for l in plan.loads {
                        let r = reqs.iter().find(|r| r.id == l.req_id).unwrap();
                        let expect = r.hashes[..l.cpu_blocks.len()].to_vec();
                        // Only a reset between lookup and allocation invalidates a hit.
                        prop_assert!(l.valid || r.stale);
                        flights.push(Flight {
                            id: l.id,
                            pairs: l.gpu_blocks.into_iter().zip(l.cpu_blocks).collect(),
                            store: false,
                            valid: l.valid,
                            expect,
                            acks: 0,
                        });
                    }
                    if let Some(s) = plan.store {
                        let expect = s.gpu_blocks.iter().map(|g| gpu_mem[g]).collect();
                        flights.push(Flight {
                            id: s.id,
                            pairs: s.gpu_blocks.into_iter().zip(s.cpu_blocks).collect(),
                            store: true,
                            valid: true,
                            expect,
                            acks: 0,
                        });
                    }
                    // No CPU block is written by two transfers, or read while written.
                    let mut written = HashSet::new();
                    for f in flights.iter().filter(|f| f.store) {
                        for (_, c) in &f.pairs {
                            prop_assert!(written.insert(*c), "CPU block {} written twice", c);
                        }
                    }
                    for f in flights.iter().filter(|f| !f.store) {
                        for (_, c) in &f.pairs {
                            prop_assert!(
                                !written.contains(c),
                                "CPU block {} read while written",
                                c
                            );
                        }
                    }
                }
                Op::Complete(i, ok) if !flights.is_empty() => {
                    let k = usize::from(i) % flights.len();
                    let f = &mut flights[k];
                    // Workers report invalid loads failed without copying.
                    let ok = ok && f.valid;
                    // The copy runs on this rank now.
                    for ((gpu, cpu), h) in f.pairs.iter().zip(&f.expect) {
                        if f.store {
                            prop_assert_eq!(gpu_mem.get(gpu), Some(h));
                            if ok {
                                cpu_mem.insert(*cpu, *h);
                            }
                        } else {
                            prop_assert_eq!(cpu_mem.get(cpu), Some(h), "load read wrong bytes");
                            if ok {
                                gpu_mem.insert(*gpu, *h);
                            }
                        }
                    }
                    f.acks += 1;
                    let id = f.id;
                    if f.acks == world {
                        flights.remove(k);
                    }
                    p.complete(id, ok).unwrap();
                    let c = p.take_completions();
                    for req in c.finished_recving {
                        let r = reqs.iter_mut().find(|r| r.id == req).unwrap();
                        r.loading = false;
                    }
                    if !c.load_error_blocks.is_empty() {
                        // vLLM recomputes the failed blocks.
                        for r in reqs.iter_mut() {
                            if r.gpu.iter().any(|g| c.load_error_blocks.contains(g)) {
                                r.computed = 0;
                            }
                        }
                    }
                }
                Op::Reset => {
                    p.reset();
                    for r in reqs.iter_mut() {
                        r.stale = true;
                    }
                }
                _ => {}
            }
            if let Err(e) = p.cache().check_invariants() {
                prop_assert!(false, "{}", e);
            }
        }
        // Drain: finish everything, complete every transfer; every pin must be gone.
        for r in &reqs {
            if !r.finished && !r.loading {
                p.request_finished(&r.id, r.computed).unwrap();
            }
        }
        let plan = p.take_step();
        let mut ids: Vec<TransferId> = flights
            .iter()
            .flat_map(|f| std::iter::repeat_n(f.id, (world - f.acks) as usize))
            .collect();
        ids.extend(
            plan.loads
                .iter()
                .flat_map(|l| std::iter::repeat_n(l.id, world as usize)),
        );
        ids.extend(
            plan.store
                .iter()
                .flat_map(|s| std::iter::repeat_n(s.id, world as usize)),
        );
        for id in ids {
            p.complete(id, true).unwrap();
        }
        for r in &reqs {
            if r.loading {
                p.request_finished(&r.id, r.computed).unwrap();
            }
        }
        let plan = p.take_step();
        for id in plan
            .loads
            .iter()
            .map(|l| l.id)
            .chain(plan.store.iter().map(|s| s.id))
        {
            for _ in 0..world {
                p.complete(id, true).unwrap();
            }
        }
        prop_assert!(!p.has_work_in_flight());
        prop_assert_eq!(p.num_requests(), 0);
        for b in 0..CAP {
            prop_assert_eq!(
                p.cache().pool().ref_count(b),
                Some(0),
                "pin leaked on {}",
                b
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn eager_planner_never_serves_unstored_or_wrong_blocks(ops in prop::collection::vec(op(), 1..120)) {
            run_model(ops, 1, false)?;
        }

        #[test]
        fn eager_planner_over_two_ranks(ops in prop::collection::vec(op(), 1..120)) {
            run_model(ops, 2, false)?;
        }

        #[test]
        fn lazy_planner_never_serves_unstored_or_wrong_blocks(ops in prop::collection::vec(op(), 1..120)) {
            run_model(ops, 1, true)?;
        }
    }
}
