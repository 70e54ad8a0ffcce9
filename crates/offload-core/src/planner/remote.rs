//! The remote tier on the scheduler side: lookups that continue past the local CPU hit
//! into a shared store, the fetch jobs that bring found blocks into CPU blocks, and the
//! memory of blocks that failed to come (see [`crate::tier`] for the whole path).
//!
//! Nothing here runs without [`Planner::attach_remote`]: [`Planner::lookup_tiered`] is
//! then [`Planner::lookup`] and one branch. A remote hit is what every KV-cache group can
//! serve, exactly as a CPU hit is: the blocks each group's kind needs past the local hit
//! are probed and fetched into the CPU tier, and the lookup that follows offers what is
//! then local in every group.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use foldhash::fast::RandomState;
use hashbrown::HashMap;

use crate::error::PlanError;
use crate::events::StoredChain;
use crate::key::{BlockHash, BlockId, BlockKey};
use crate::pool::BlockState;
use crate::tier::{ProbeQueue, TierSnapshot, TierStats};

use super::kinds::group_id;
use super::types::{HashSource, TransferId};
use super::Planner;

/// Block hashes whose fetch failed that are remembered, so a chain is cut before them:
/// enough for every prefix in flight, small enough to never matter in memory.
const FAILED_MEMORY: usize = 1 << 16;

/// What a lookup answers when a remote tier may hold more of the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LookupOutcome {
    /// `tokens` can be loaded from CPU (as [`Planner::lookup`] answers); `remote_tokens`
    /// of them came from the remote tier for this request.
    Hit {
        /// Tokens loadable from CPU.
        tokens: usize,
        /// Of those, tokens fetched from the remote tier.
        remote_tokens: usize,
    },
    /// The remote tier is being asked (or fetched from): ask again next step.
    Pending,
}

/// A fetch for the workers: bring blocks `hashes` from the remote tier into `cpu_blocks`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FetchJob {
    /// Transfer id; each rank reports it with the number of leading blocks it filled.
    pub id: TransferId,
    /// The request the fetch is for.
    pub req_id: String,
    /// The blocks' keys in the remote tier, in request order (a block of KV-cache group
    /// 0 is keyed by its hash; see [`Planner::block_hashes`]).
    pub hashes: Vec<BlockHash>,
    /// The CPU blocks reserved for them.
    pub cpu_blocks: Vec<BlockId>,
    /// The first block's position in the request's chain of block hashes (what a KV event
    /// for the fetched blocks needs to name their tokens).
    pub first_block: usize,
    /// Pairwise with `cpu_blocks`: each block's KV-cache group and position in the
    /// request's chain of block hashes.
    pub blocks: Vec<(u32, usize)>,
    /// With events on, pairwise with `cpu_blocks`: each block's hash in the CPU tier, as
    /// the [`KvEvent::Stored`](crate::KvEvent::Stored) announcing it once fetched names
    /// it (`hashes` are the remote tier's keys). Empty with events off.
    pub cpu_hashes: Vec<BlockHash>,
}

/// Counters of the scheduler's side of the remote tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RemoteStats {
    /// Lookups answered "pending" (probe or fetch in flight).
    pub pending_lookups: u64,
    /// Fetch jobs issued.
    pub fetches: u64,
    /// Blocks asked for by fetch jobs.
    pub fetch_blocks: u64,
    /// Blocks every rank fetched, published to the CPU tier.
    pub fetched_blocks: u64,
    /// Blocks some rank could not fetch (missing, corrupt, timed out): recomputed.
    pub failed_fetch_blocks: u64,
    /// Tokens of remote-fetched blocks offered in lookups (a request counts once).
    pub remote_hit_tokens: u64,
    /// Chains cut at a block whose fetch failed before.
    pub skipped_failed: u64,
}

#[derive(Debug)]
enum Phase {
    /// A fetch for the request is in flight.
    Fetching(TransferId),
    /// The request had its remote attempt for a prompt of `need` full blocks; `pinned`
    /// are fetched blocks held until the lookup that offers them.
    Tried {
        need: usize,
        pinned: Vec<BlockId>,
        remote_blocks: usize,
        counted: bool,
    },
}

/// One block a fetch brings: its CPU tier key, the hash of the block before it in its
/// request (for the stored chain's event) and its position there.
#[derive(Debug, Clone, Copy)]
struct Wanted {
    key: BlockKey,
    parent: Option<BlockHash>,
    pos: usize,
}

#[derive(Debug)]
struct Fetch {
    req_id: String,
    need: usize,
    wanted: Vec<Wanted>,
    blocks: Vec<BlockId>,
    acks: u32,
    filled: usize,
}

/// A bounded set, oldest entries forgotten first.
#[derive(Debug, Default)]
struct FailedHashes {
    set: HashSet<BlockHash>,
    order: VecDeque<BlockHash>,
}

impl FailedHashes {
    fn insert(&mut self, h: BlockHash) {
        if !self.set.insert(h) {
            return;
        }
        self.order.push_back(h);
        if self.order.len() > FAILED_MEMORY {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }
}

/// The remote tier's scheduler-side state.
#[derive(Debug)]
pub(super) struct RemoteState {
    probes: ProbeQueue,
    tier_stats: Arc<TierStats>,
    reqs: HashMap<String, Phase, RandomState>,
    fetches: HashMap<TransferId, Fetch, RandomState>,
    pending: Vec<FetchJob>,
    failed: FailedHashes,
    stats: RemoteStats,
}

impl Planner {
    /// Adds a remote tier behind the CPU tier: `probes` answers existence checks (its tier's
    /// counters are `tier_stats`), and [`Self::lookup_tiered`] uses it.
    pub fn attach_remote(&mut self, probes: ProbeQueue, tier_stats: Arc<TierStats>) {
        self.remote = Some(Box::new(RemoteState {
            probes,
            tier_stats,
            reqs: HashMap::with_hasher(RandomState::default()),
            fetches: HashMap::with_hasher(RandomState::default()),
            pending: Vec::new(),
            failed: FailedHashes::default(),
            stats: RemoteStats::default(),
        }));
    }

    /// Whether a remote tier is attached.
    pub fn has_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// Tokens of `req`'s hit that the tier below the CPU brought for it: the blocks its
    /// fetch filled, which follow the blocks that were on CPU already (the hit's
    /// `LookupOutcome::Hit::remote_tokens` before it is capped to the hit). 0 without a
    /// fetch for the request's current prompt.
    pub fn remote_hit_tokens(&self, req: &str) -> usize {
        match self.remote.as_deref().and_then(|r| r.reqs.get(req)) {
            Some(Phase::Tried { remote_blocks, .. }) => {
                remote_blocks * self.cfg.block_size as usize
            }
            _ => 0,
        }
    }

    /// [`Self::lookup`], continued into the remote tier when one is attached and the local
    /// hit ends before the prompt's last full block (the last token is always computed).
    ///
    /// The rest of the chain is probed in one round trip on the probe thread; while it (or
    /// the fetch that follows) is in flight the answer is [`LookupOutcome::Pending`], and
    /// the server asks again next step. Found blocks get CPU blocks reserved and a
    /// [`FetchJob`] (see [`Self::take_fetches`]); once every rank reported it
    /// ([`Self::complete_fetch`]), the next lookup offers them as a local hit. A request
    /// gets one remote attempt per prompt length: whatever the store did, the next answer
    /// after it is a hit, never another wait.
    pub fn lookup_tiered<H: HashSource + ?Sized>(
        &mut self,
        req: &str,
        hashes: &H,
        num_tokens: usize,
        num_computed_tokens: usize,
    ) -> Result<LookupOutcome, PlanError> {
        let tokens = self.lookup(req, hashes, num_tokens, num_computed_tokens)?;
        let hit = LookupOutcome::Hit {
            tokens,
            remote_tokens: 0,
        };
        let Some(remote) = self.remote.as_deref_mut() else {
            return Ok(hit);
        };
        let bs = self.cfg.block_size as usize;
        if num_computed_tokens % bs != 0 || self.cache.capacity() == 0 {
            return Ok(hit);
        }
        let end = num_computed_tokens / bs + tokens / bs;
        let need = num_tokens.saturating_sub(1) / bs;
        match remote.reqs.get_mut(req) {
            Some(Phase::Fetching(_)) => {
                remote.stats.pending_lookups += 1;
                return Ok(LookupOutcome::Pending);
            }
            Some(Phase::Tried {
                need: n,
                pinned,
                remote_blocks,
                counted,
            }) if *n == need => {
                // The lookup above pinned what it offers; the fetch's hold can go.
                for b in pinned.drain(..) {
                    let _ = self.cache.unpin(b);
                }
                let remote_tokens = (*remote_blocks * bs).min(tokens);
                if !std::mem::replace(counted, true) {
                    remote.stats.remote_hit_tokens += remote_tokens as u64;
                }
                return Ok(LookupOutcome::Hit {
                    tokens,
                    remote_tokens,
                });
            }
            Some(Phase::Tried { pinned, .. }) => {
                // The prompt changed since that attempt: a new one replaces it.
                for b in pinned.drain(..) {
                    let _ = self.cache.unpin(b);
                }
            }
            None => {}
        }
        if end >= need {
            return Ok(hit);
        }
        let bad = |source| PlanError::BadHash {
            req_id: req.to_string(),
            source,
        };
        // Past the local hit, the blocks each group needs for a hit reaching `need`,
        // block by block: a block some group has ready already is not fetched again; one
        // being stored, or whose fetch failed before, ends the run.
        let start = num_computed_tokens / bs;
        let mut wanted: Vec<Wanted> = Vec::new();
        let mut parent = match end.checked_sub(1) {
            Some(i) => Some(hashes.hash(i).map_err(bad)?),
            None => None,
        };
        'blocks: for pos in end..need {
            let h = hashes.hash(pos).map_err(bad)?;
            for (g, kind) in self.kinds.iter().enumerate() {
                if pos < kind.first_needed(start, need, bs) {
                    continue;
                }
                let key = BlockKey::new(group_id(g), h);
                if self.cache.get_ready(&key).is_some() {
                    continue;
                }
                if self.cache.contains(&key) {
                    break 'blocks;
                }
                if remote.failed.set.contains(&key.remote_hash()) {
                    remote.stats.skipped_failed += 1;
                    break 'blocks;
                }
                wanted.push(Wanted { key, parent, pos });
            }
            parent = Some(h);
        }
        let keys: Vec<[u8; 16]> = wanted
            .iter()
            .map(|w| w.key.remote_hash().0.to_le_bytes())
            .collect();
        let Some(found) = remote.probes.poll(req, &keys) else {
            remote.stats.pending_lookups += 1;
            return Ok(LookupOutcome::Pending);
        };
        remote.probes.forget(req);
        let mut blocks = Vec::new();
        for w in &wanted[..found.min(wanted.len())] {
            // A block another request reserved meanwhile ends the run: it will be local
            // soon, and a block is never reserved twice.
            let Some(b) = self.cache.reserve(w.key) else {
                break;
            };
            blocks.push(b);
        }
        if blocks.is_empty() {
            remote.reqs.insert(
                req.to_string(),
                Phase::Tried {
                    need,
                    pinned: Vec::new(),
                    remote_blocks: 0,
                    counted: true,
                },
            );
            return Ok(hit);
        }
        let id = self.ledger.next_id();
        wanted.truncate(blocks.len());
        remote.stats.fetches += 1;
        remote.stats.fetch_blocks += blocks.len() as u64;
        remote.pending.push(FetchJob {
            id,
            req_id: req.to_string(),
            hashes: wanted.iter().map(|w| w.key.remote_hash()).collect(),
            cpu_blocks: blocks.clone(),
            first_block: end,
            blocks: wanted.iter().map(|w| (w.key.group, w.pos)).collect(),
            cpu_hashes: if self.cfg.events {
                wanted.iter().map(|w| w.key.hash).collect()
            } else {
                Vec::new()
            },
        });
        remote.fetches.insert(
            id,
            Fetch {
                req_id: req.to_string(),
                need,
                wanted,
                blocks,
                acks: 0,
                filled: usize::MAX,
            },
        );
        remote.reqs.insert(req.to_string(), Phase::Fetching(id));
        remote.stats.pending_lookups += 1;
        Ok(LookupOutcome::Pending)
    }

    /// Takes the fetch jobs planned since the last call, for the step's metadata.
    pub fn take_fetches(&mut self) -> Vec<FetchJob> {
        self.remote
            .as_deref_mut()
            .map(|r| std::mem::take(&mut r.pending))
            .unwrap_or_default()
    }

    /// One rank reports fetch `id` done with its first `filled` blocks in place. Once
    /// every rank reported, the blocks all of them filled are published (held for the
    /// request's next lookup, announced by a [`KvEvent::Stored`](crate::KvEvent::Stored)
    /// like any block the CPU tier stores); the rest are dropped and their first hash is
    /// remembered, so no later lookup is offered the same failing block.
    ///
    /// Returns whether this report retired the fetch (every rank reported).
    pub fn complete_fetch(&mut self, id: TransferId, filled: usize) -> Result<bool, PlanError> {
        let world = self.cfg.world_size;
        let remote = self
            .remote
            .as_deref_mut()
            .ok_or(PlanError::UnknownTransfer(id))?;
        let f = remote
            .fetches
            .get_mut(&id)
            .ok_or(PlanError::UnknownTransfer(id))?;
        f.acks += 1;
        f.filled = f.filled.min(filled);
        if f.acks < world {
            return Ok(false);
        }
        let Some(f) = remote.fetches.remove(&id) else {
            return Ok(false);
        };
        let n = f.filled.min(f.blocks.len());
        let waiting = matches!(remote.reqs.get(&f.req_id), Some(Phase::Fetching(i)) if *i == id);
        let mut pinned = Vec::new();
        let mut chain = StoredChain::new(0, self.cfg.block_size);
        for (&b, w) in f.blocks[..n].iter().zip(&f.wanted) {
            // A block a reset dropped meanwhile is neither held nor announced.
            let present = self.cache.pool().state(b) == Some(BlockState::Pending);
            if present && waiting {
                let _ = self.cache.pin(b);
                pinned.push(b);
            }
            let _ = self.cache.publish(b);
            if present {
                if w.key.group != chain.group() {
                    chain.flush(self.cache.events_mut());
                    chain = StoredChain::new(w.key.group, self.cfg.block_size);
                }
                chain.push(w.key.hash, w.parent, self.cache.events_mut());
            }
        }
        chain.flush(self.cache.events_mut());
        for &b in &f.blocks[n..] {
            let _ = self.cache.abort(b);
        }
        if let Some(w) = f.wanted.get(n) {
            remote.failed.insert(w.key.remote_hash());
        }
        // The request's blocks the fetch brought, counted by position (every group's
        // blocks at one position are one block of the prompt).
        let positions = {
            let mut p: Vec<usize> = f.wanted[..n].iter().map(|w| w.pos).collect();
            p.dedup();
            p.len()
        };
        remote.stats.fetched_blocks += n as u64;
        remote.stats.failed_fetch_blocks += (f.blocks.len() - n) as u64;
        if waiting {
            remote.reqs.insert(
                f.req_id,
                Phase::Tried {
                    need: f.need,
                    pinned,
                    remote_blocks: positions,
                    counted: false,
                },
            );
        }
        Ok(true)
    }

    /// `req` was allocated: blocks held for it are released (its hit pinned them). That
    /// it had its remote attempt is kept: vLLM asks again for a request whose load failed,
    /// and the answer must then be the local hit, not another fetch of the same blocks.
    pub(super) fn remote_allocated(&mut self, req: &str) {
        let Some(remote) = self.remote.as_deref_mut() else {
            return;
        };
        remote.probes.forget(req);
        if let Some(Phase::Tried { pinned, .. }) = remote.reqs.get_mut(req) {
            for b in pinned.drain(..) {
                let _ = self.cache.unpin(b);
            }
        }
    }

    /// Forgets the remote state of `req` (finished or aborted); blocks held for it are
    /// released, a fetch in flight still completes into the CPU tier.
    pub fn forget_remote(&mut self, req: &str) {
        let Some(remote) = self.remote.as_deref_mut() else {
            return;
        };
        remote.probes.forget(req);
        if let Some(Phase::Tried { pinned, .. }) = remote.reqs.remove(req) {
            for b in pinned {
                let _ = self.cache.unpin(b);
            }
        }
    }

    /// The remote keys of CPU blocks (`None` for a block holding none), for writing
    /// stored blocks to the remote tier: a block's hash, told apart by its KV-cache group
    /// past group 0 (see [`FetchJob::hashes`]).
    pub fn block_hashes(&self, blocks: &[BlockId]) -> Vec<Option<BlockHash>> {
        let pool = self.cache.pool();
        blocks
            .iter()
            .map(|&b| pool.key(b).map(|k| k.remote_hash()))
            .collect()
    }

    /// Counters of the remote tier's scheduler side and of its probes; `None` without one.
    pub fn remote_stats(&self) -> Option<(RemoteStats, TierSnapshot)> {
        self.remote
            .as_deref()
            .map(|r| (r.stats, r.tier_stats.snapshot()))
    }
}
