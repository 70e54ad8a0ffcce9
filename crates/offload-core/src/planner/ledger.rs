//! The job ledger: transfers issued to workers, their per-rank acknowledgements, and
//! what retiring one means for CPU blocks, requests and the server.

use std::collections::HashMap;

use crate::error::PlanError;
use crate::events::StoredChain;
use crate::key::{BlockId, BuildKeyHasher};
use crate::pool::BlockState;

use super::request::{Report, Request};
use super::select::{group_of, StoreEntry};
use super::types::{StepPlan, StoreJob, TransferId};
use super::Planner;

#[derive(Debug)]
pub(super) enum JobKind {
    Load {
        req_id: String,
        serial: u64,
        blocks: Vec<BlockId>,
        gpu_blocks: Vec<u32>,
        sync: bool,
    },
    Store {
        entries: Vec<StoreEntry>,
        /// The entries' groups (see `select::group_of`).
        groups: Vec<u32>,
        req_ids: Vec<(String, u64)>,
        /// GPU blocks the caller holds for this store (lazy candidates, or blocks a
        /// multi-group store reads that the server frees from running requests).
        held_gpu_blocks: Vec<u32>,
    },
}

#[derive(Debug)]
pub(super) struct Job {
    kind: JobKind,
    acks: u32,
    failed: bool,
}

impl Job {
    pub(super) fn new(kind: JobKind, failed: bool) -> Self {
        Self {
            kind,
            acks: 0,
            failed,
        }
    }
}

/// Transfers issued and not yet retired, by id.
#[derive(Debug)]
pub(super) struct Ledger {
    // Transfer ids are generated here, never by clients: the cheap hasher is safe.
    jobs: HashMap<TransferId, Job, BuildKeyHasher>,
    next_id: TransferId,
}

impl Ledger {
    pub(super) fn new() -> Self {
        Self {
            jobs: HashMap::with_hasher(BuildKeyHasher),
            next_id: 1,
        }
    }

    pub(super) fn next_id(&mut self) -> TransferId {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    pub(super) fn insert(&mut self, id: TransferId, job: Job) {
        self.jobs.insert(id, job);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }
}

impl Planner {
    /// Turns the transfers chosen since the previous step into the step's plan.
    pub(super) fn issue(&mut self, mut held_gpu_blocks: Vec<u32>) -> StepPlan {
        let loads = std::mem::take(&mut self.pending_loads);
        let pending = std::mem::take(&mut self.pending_store);
        if pending.is_empty() {
            return StepPlan {
                loads,
                store: None,
                held_gpu_blocks,
            };
        }
        let id = self.ledger.next_id();
        self.stats.store_blocks += pending.entries.len() as u64;
        for (req, serial) in &pending.req_ids {
            if let Some(r) = self.requests.get_mut(req.as_str()) {
                if r.serial == *serial {
                    r.queued = false;
                }
            }
        }
        let store = StoreJob {
            id,
            gpu_blocks: pending.gpu_blocks.clone(),
            cpu_blocks: pending.entries.iter().map(|e| e.block).collect(),
            req_ids: pending.req_ids.iter().map(|(r, _)| r.clone()).collect(),
            flush_req_ids: pending.flush_req_ids,
            sources: if self.cfg.events {
                pending.entries.iter().map(|e| e.source).collect()
            } else {
                Vec::new()
            },
            hashes: if self.cfg.events {
                pending.entries.iter().map(|e| e.hash).collect()
            } else {
                Vec::new()
            },
            groups: if self.kinds.len() > 1 {
                (0..pending.entries.len())
                    .map(|i| group_of(&pending.groups, i))
                    .collect()
            } else {
                Vec::new()
            },
        };
        held_gpu_blocks.extend_from_slice(&pending.held);
        let mut job_held = pending.offered;
        job_held.extend_from_slice(&held_gpu_blocks);
        self.ledger.insert(
            id,
            Job::new(
                JobKind::Store {
                    entries: pending.entries,
                    groups: pending.groups,
                    req_ids: pending.req_ids,
                    held_gpu_blocks: job_held,
                },
                false,
            ),
        );
        StepPlan {
            loads,
            store: Some(store),
            held_gpu_blocks,
        }
    }

    /// One rank reports transfer `id` done (`ok`) or failed. Once every rank reported,
    /// the transfer retires: stored blocks are published (or dropped if any rank
    /// failed), loaded blocks unpinned, and [`Self::take_completions`] says what the
    /// server must learn.
    pub fn complete(&mut self, id: TransferId, ok: bool) -> Result<(), PlanError> {
        let job = self
            .ledger
            .jobs
            .get_mut(&id)
            .ok_or(PlanError::UnknownTransfer(id))?;
        job.acks += 1;
        job.failed |= !ok;
        if job.acks < self.cfg.world_size {
            return Ok(());
        }
        let Some(job) = self.ledger.jobs.remove(&id) else {
            return Ok(());
        };
        match job.kind {
            JobKind::Load {
                req_id,
                serial,
                blocks,
                gpu_blocks,
                sync,
            } => {
                for b in blocks {
                    // A failed load's blocks leave the index: vLLM asks again for a request
                    // whose first loaded block failed, and the same hit would fail again.
                    if job.failed {
                        let _ = self.cache.invalidate(b);
                    }
                    let _ = self.cache.unpin(b);
                }
                if job.failed {
                    self.stats.failed_loads += 1;
                    self.completions.load_error_blocks.extend(gpu_blocks);
                }
                if sync {
                    return Ok(());
                }
                if let Some(f) = self.finishing.get_mut(&serial) {
                    f.load_in_flight = false;
                    self.retire_if_done(serial);
                } else {
                    if let Some(r) = self.live_mut(&req_id, serial) {
                        r.load_in_flight = false;
                    }
                    self.completions.finished_recving.push(req_id);
                }
            }
            JobKind::Store {
                entries,
                groups,
                req_ids,
                held_gpu_blocks,
            } => {
                if job.failed {
                    self.stats.failed_stores += 1;
                    for e in &entries {
                        let _ = self.cache.abort(e.block);
                    }
                } else {
                    self.publish(&entries, &groups);
                }
                self.completions.released_gpu_blocks.extend(held_gpu_blocks);
                if self.cfg.events {
                    self.completions.retired_stores.push(id);
                }
                for (req, serial) in &req_ids {
                    if let Some(f) = self.finishing.get_mut(serial) {
                        f.stores_in_flight = f.stores_in_flight.saturating_sub(1);
                        self.retire_if_done(*serial);
                    } else if let Some(r) = self.live_mut(req, *serial) {
                        r.stores_in_flight = r.stores_in_flight.saturating_sub(1);
                    }
                }
            }
        }
        Ok(())
    }

    fn publish(&mut self, entries: &[StoreEntry], groups: &[u32]) {
        if !self.cfg.events {
            // No chains to build (a lazy store would start one per block).
            for e in entries {
                if self.cache.pool().state(e.block) == Some(BlockState::Pending) {
                    self.stats.stored_blocks += 1;
                }
                let _ = self.cache.publish(e.block);
            }
            return;
        }
        let mut chain = StoredChain::new(0, self.cfg.block_size);
        for (i, e) in entries.iter().enumerate() {
            let group = group_of(groups, i);
            if group != chain.group() {
                chain.flush(self.cache.events_mut());
                chain = StoredChain::new(group, self.cfg.block_size);
            }
            // A block detached by a reset while in flight is released, not published.
            let published = self.cache.pool().state(e.block) == Some(BlockState::Pending);
            let _ = self.cache.publish(e.block);
            if !published {
                continue;
            }
            self.stats.stored_blocks += 1;
            chain.push(e.hash, e.parent, self.cache.events_mut());
        }
        chain.flush(self.cache.events_mut());
    }

    /// The live request `req` if it is the one with `serial` (not a newer request that
    /// reuses the id).
    fn live_mut(&mut self, req: &str, serial: u64) -> Option<&mut Request> {
        self.requests.get_mut(req).filter(|r| r.serial == serial)
    }

    /// Reports a finished request to the server once nothing uses its blocks.
    fn retire_if_done(&mut self, serial: u64) {
        let done = self
            .finishing
            .get(&serial)
            .is_some_and(|f| f.stores_in_flight == 0 && !f.load_in_flight);
        if !done {
            return;
        }
        let Some(f) = self.finishing.remove(&serial) else {
            return;
        };
        match f.report {
            Report::Sending => self.completions.finished_sending.push(f.req_id),
            Report::Recving => self.completions.finished_recving.push(f.req_id),
        }
    }
}
