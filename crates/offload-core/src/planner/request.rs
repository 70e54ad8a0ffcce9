//! Per-request state of the planner, and the check that keeps its copy of a request's
//! block hashes true to the server's list.

use crate::cache::BlockCache;
use crate::events::PlannerStats;
use crate::key::{BlockHash, BlockId};

use crate::error::HashError;

use super::types::HashSource;

/// One value per KV-cache group, the first one inline: most models have one group, and
/// a request's entry then reaches its blocks without another pointer to follow.
#[derive(Debug, Default, Clone)]
pub(super) struct PerGroup<T> {
    first: T,
    rest: Vec<T>,
}

impl<T: Default> PerGroup<T> {
    /// Number of groups (at least one).
    pub(super) fn len(&self) -> usize {
        1 + self.rest.len()
    }

    /// Makes room for `n` groups (at least one), new ones default.
    pub(super) fn resize(&mut self, n: usize) {
        self.rest.resize_with(n.saturating_sub(1), T::default);
    }

    /// Group `g`'s value.
    pub(super) fn get_mut(&mut self, g: usize) -> Option<&mut T> {
        match g.checked_sub(1) {
            None => Some(&mut self.first),
            Some(i) => self.rest.get_mut(i),
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &T> {
        std::iter::once(&self.first).chain(&self.rest)
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        std::iter::once(&mut self.first).chain(&mut self.rest)
    }
}

/// A request's blocks in one KV-cache group.
#[derive(Debug, Default, Clone)]
pub(super) struct GroupBlocks {
    /// GPU block ids from token 0 (positions the group no longer holds carry the
    /// server's null block; they are never read).
    pub(super) gpu_blocks: Vec<u32>,
    /// Blocks before this index were considered for storing already.
    pub(super) stored_upto: usize,
}

/// The pinned part of a hit in one group: CPU blocks for positions `from..`.
#[derive(Debug, Default, Clone)]
pub(super) struct GroupHit {
    pub(super) from: usize,
    pub(super) blocks: Vec<BlockId>,
}

/// A pinned lookup result: the request's blocks `start..end` in every group (each group
/// pins the part of them it needs, see [`GroupKind`](super::GroupKind)).
#[derive(Debug, Default)]
pub(super) struct Hit {
    pub(super) start: usize,
    /// The end of the hit, in blocks.
    pub(super) end: usize,
    pub(super) num_tokens: usize,
    /// The hash of the run's last block: a repeated lookup serves the pinned run only
    /// while the request's list still has it there (the run's hashes may have been read
    /// without becoming part of the known prefix).
    pub(super) last: Option<BlockHash>,
    /// The pinned blocks of each group; empty when nothing is pinned.
    pub(super) groups: Vec<GroupHit>,
}

impl Hit {
    /// Unpins every pinned block and forgets them (the hit keeps where it started).
    pub(super) fn unpin_all(&mut self, cache: &mut BlockCache) {
        for g in self.groups.drain(..) {
            for b in g.blocks {
                // Pinned by the lookup, so in range and pinned.
                let _ = cache.unpin(b);
            }
        }
        self.end = self.start;
    }
}

/// How a finished request with transfers in flight is handed back to the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Report {
    /// `request_finished` returned `true`: the server frees the blocks on
    /// `finished_sending`.
    Sending,
    /// It finished while its load ran: the server delays the free itself until
    /// `finished_recving` names it.
    Recving,
}

#[derive(Debug, Default)]
pub(super) struct Request {
    /// Tells this request apart from an earlier one with the same id whose transfers
    /// are still in flight (ids are the server's, and servers may reuse them).
    pub(super) serial: u64,
    /// A prefix of the server's hash list, as of the last check (see [`Self::sync`]).
    pub(super) hashes: Vec<BlockHash>,
    /// The request's blocks in each KV-cache group.
    pub(super) groups: PerGroup<GroupBlocks>,
    pub(super) hit: Option<Hit>,
    pub(super) stores_in_flight: u32,
    pub(super) load_in_flight: bool,
    /// Part of the store job being assembled for the next step.
    pub(super) queued: bool,
    /// Tokens computed when the server last allocated for the request, which decides
    /// what sliding-window groups still hold.
    pub(super) alloc_tokens: usize,
    /// Tokens through which the request's last computed chunk
    /// ran (before this step's forward, or after it with
    /// [`stores_after_forward`](super::PlannerConfig::stores_after_forward)): where
    /// Mamba groups last wrote a state.
    pub(super) state_tokens: usize,
}

/// A request that finished while transfers still used its GPU blocks: reported to the
/// server once the last one retires.
#[derive(Debug)]
pub(super) struct Finishing {
    pub(super) req_id: String,
    pub(super) stores_in_flight: u32,
    pub(super) load_in_flight: bool,
    pub(super) report: Report,
}

impl Request {
    pub(super) fn new(serial: u64) -> Self {
        Self {
            serial,
            ..Self::default()
        }
    }

    /// Blocks before this index were considered for storing in every group.
    pub(super) fn stored_upto(&self) -> usize {
        self.groups.iter().map(|g| g.stored_upto).min().unwrap_or(0)
    }

    /// Makes the first `min(need, src.num_hashes())` known hashes equal to the source's,
    /// reading only what is new or needed to prove the rest unchanged; returns how many
    /// are usable (`min(need, src.num_hashes())`).
    pub(super) fn sync<H: HashSource + ?Sized>(
        &mut self,
        src: &H,
        need: usize,
        cache: &mut BlockCache,
        stats: &mut PlannerStats,
    ) -> Result<usize, HashError> {
        let want = self.verify(src, need, cache, stats)?;
        for i in self.hashes.len()..want {
            self.hashes.push(src.hash(i)?);
        }
        Ok(want)
    }

    /// Checks that what the planner knows of the first `need` hashes still matches the
    /// source, forgetting what does not; reads nothing new. Returns
    /// `min(need, src.num_hashes())`.
    ///
    /// The server may have truncated and regrown its list since the planner last read it
    /// (vLLM streaming sessions do, under one request id). The length alone cannot tell:
    /// the entry at the last position about to be used is compared, and because hashes
    /// are chained one equal entry vouches for all before it. On a difference, everything
    /// past the common prefix is forgotten: what was considered for storing, and the
    /// pinned hit, so nothing is stored or served under a key whose content changed.
    pub(super) fn verify<H: HashSource + ?Sized>(
        &mut self,
        src: &H,
        need: usize,
        cache: &mut BlockCache,
        stats: &mut PlannerStats,
    ) -> Result<usize, HashError> {
        let len = src.num_hashes()?;
        let want = need.min(len);
        let check = want.min(self.hashes.len());
        if check > 0 && src.hash(check - 1)? != self.hashes[check - 1] {
            let mut common = check - 1;
            while common > 0 && src.hash(common - 1)? != self.hashes[common - 1] {
                common -= 1;
            }
            self.forget_from(common, cache);
            stats.rewritten_hash_lists += 1;
        } else if self.hashes.len() > len {
            // Shortened without a visible change to what is left: the dropped entries
            // may come back with other content.
            self.forget_from(len, cache);
        }
        Ok(want)
    }

    /// The hash of block `i`: known, or read from `src` (and kept when it extends the
    /// known prefix). The caller verified the known prefix against `src` in this call.
    pub(super) fn hash_at<H: HashSource + ?Sized>(
        &mut self,
        src: &H,
        i: usize,
    ) -> Result<BlockHash, HashError> {
        if let Some(h) = self.hashes.get(i) {
            return Ok(*h);
        }
        let h = src.hash(i)?;
        if i == self.hashes.len() {
            self.hashes.push(h);
        }
        Ok(h)
    }

    /// The hashes of blocks `start..start + out.len()` into `out`: known ones copied,
    /// the rest read from `src` in one run (and kept when they extend the known prefix).
    /// The caller verified the known prefix against `src` in this call.
    pub(super) fn hashes_into<H: HashSource + ?Sized>(
        &mut self,
        src: &H,
        start: usize,
        out: &mut [BlockHash],
    ) -> Result<(), HashError> {
        let known = self.hashes.get(start..).unwrap_or_default();
        let k = known.len().min(out.len());
        out[..k].copy_from_slice(&known[..k]);
        if k < out.len() {
            src.hashes_into(start + k, &mut out[k..])?;
            if start + k == self.hashes.len() {
                self.hashes.extend_from_slice(&out[k..]);
            }
        }
        Ok(())
    }

    /// Drops what the planner knew about blocks `from..`.
    fn forget_from(&mut self, from: usize, cache: &mut BlockCache) {
        log::debug!(
            "kvoffload: request's block hashes changed from block {from} on; forgetting {} \
             known hashes",
            self.hashes.len() - from
        );
        self.hashes.truncate(from);
        for g in self.groups.iter_mut() {
            g.stored_upto = g.stored_upto.min(from);
        }
        if self.hit.as_ref().is_some_and(|h| h.end > from) {
            self.release_hit(cache);
        }
    }

    /// Unpins the pinned lookup result, if any.
    pub(super) fn release_hit(&mut self, cache: &mut BlockCache) {
        if let Some(mut hit) = self.hit.take() {
            hit.unpin_all(cache);
        }
    }
}
