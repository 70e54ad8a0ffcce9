//! [`WorkerTier`]: the remote tier in a worker process, where the CPU blocks' bytes live.
//!
//! The scheduler owns the index and decides; the worker owns the host memory and moves
//! bytes. So a remote hit is planned by the scheduler (probe, reserve CPU blocks, a fetch
//! job in the step's metadata) and carried out here: the fetch thread gets the values,
//! verifies them and writes the leading run that passed into the reserved CPU blocks, then
//! reports how many blocks it filled. Only once every rank reported does the scheduler
//! publish them, and from then on they load like any local hit.
//!
//! Stored blocks are offered to the [`WriteBehind`] queue when their store completes,
//! before the completion is reported: until then the scheduler cannot reuse the block, so
//! the bytes read are the bytes stored. The read is a host memcpy, made only when the
//! queue has room; the network write happens on the writer's thread.

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use super::blocks::RemoteTier;
use super::stats::TierStats;
use super::writer::WriteBehind;
use super::TierSnapshot;
use crate::transfer::HostBlocks;

/// Most blocks one fetch asks for in one round trip: a long prefix is fetched in several,
/// each well within the deadline.
pub const FETCH_BATCH: usize = 32;

/// One fetch the scheduler planned: blocks `hashes` (a chain, in order) into `cpu_blocks`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchRequest {
    /// The scheduler's transfer id, echoed in the report.
    pub id: u64,
    /// Block hashes as keys take them.
    pub hashes: Vec<Vec<u8>>,
    /// The CPU blocks reserved for them, one per hash.
    pub cpu_blocks: Vec<u32>,
}

type Reports = Arc<Mutex<Vec<(u64, usize)>>>;

/// The remote tier of one worker rank: fetches into CPU blocks and writes behind.
pub struct WorkerTier {
    blocks: HostBlocks,
    fetch_tx: Option<Sender<FetchRequest>>,
    reports: Reports,
    fetch_thread: Option<JoinHandle<()>>,
    writer: Option<WriteBehind>,
    stats: Arc<TierStats>,
}

impl std::fmt::Debug for WorkerTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerTier")
            .field("block_bytes", &self.blocks.block_bytes())
            .field("writer", &self.writer)
            .finish()
    }
}

impl WorkerTier {
    /// Starts the fetch thread on `fetch` and, with `write`, a write-behind queue of at
    /// most `max_inflight_bytes` on it. Both tiers should share one [`TierStats`] (the
    /// snapshot reads `fetch`'s).
    pub fn spawn(
        blocks: HostBlocks,
        fetch: RemoteTier,
        write: Option<RemoteTier>,
        max_inflight_bytes: u64,
    ) -> std::io::Result<Self> {
        let stats = Arc::clone(fetch.stats());
        let writer = write
            .map(|t| WriteBehind::spawn(t, max_inflight_bytes))
            .transpose()?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let reports = Reports::default();
        let fetch_thread = std::thread::Builder::new()
            .name("kvoffload-remote-fetch".into())
            .spawn({
                let reports = Arc::clone(&reports);
                let blocks = blocks.clone();
                move || fetch_loop(fetch, &blocks, &rx, &reports)
            })?;
        Ok(Self {
            blocks,
            fetch_tx: Some(tx),
            reports,
            fetch_thread: Some(fetch_thread),
            writer,
            stats,
        })
    }

    /// Whether stored blocks are written to the store.
    pub fn writes(&self) -> bool {
        self.writer.is_some()
    }

    /// Queues a fetch; its report comes through [`Self::take_reports`]. A fetch that
    /// cannot be queued (the tier is shut down) is reported with no block filled.
    ///
    /// # Safety
    /// Until its report is taken, nothing else may read or write `req.cpu_blocks` (the
    /// scheduler reserved them for this fetch).
    pub unsafe fn fetch(&self, req: FetchRequest) {
        let id = req.id;
        let sent = self
            .fetch_tx
            .as_ref()
            .is_some_and(|tx| tx.send(req).is_ok());
        if !sent {
            push_report(&self.reports, id, 0);
        }
    }

    /// Fetches finished since the last call: `(id, blocks filled)`, where the filled
    /// blocks are the leading ones of the request.
    pub fn take_reports(&self) -> Vec<(u64, usize)> {
        std::mem::take(&mut *self.reports.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Offers stored blocks (`hashes[i]` is in `cpu_blocks[i]`) to the write-behind
    /// queue; returns how many it took (none without writes). Never waits for the store.
    ///
    /// # Safety
    /// No thread may write `cpu_blocks` during the call: their stores completed and the
    /// completions are not reported to the scheduler yet.
    pub unsafe fn write_stored<H: AsRef<[u8]>>(&self, hashes: &[H], cpu_blocks: &[u32]) -> usize {
        let Some(writer) = &self.writer else {
            return 0;
        };
        let len = self.blocks.block_bytes();
        let mut taken = 0;
        for (hash, &cpu) in hashes.iter().zip(cpu_blocks) {
            let mut ok = true;
            let accepted = writer.offer_with(hash.as_ref(), len, |out| {
                // SAFETY: the caller guarantees no writer of `cpu`.
                ok = unsafe { self.blocks.read_block(cpu, out) }.is_ok();
            });
            if accepted && ok {
                taken += 1;
            }
        }
        taken
    }

    /// Counters of this rank's remote tier.
    pub fn stats(&self) -> TierSnapshot {
        self.stats.snapshot()
    }

    /// Stops both threads: queued writes get at most `drain` to go out; a fetch in flight
    /// ends at its store's deadline.
    pub fn shutdown(&mut self, drain: Duration) {
        if let Some(w) = &mut self.writer {
            w.shutdown(drain);
        }
        self.fetch_tx = None;
        if let Some(t) = self.fetch_thread.take() {
            if t.join().is_err() {
                log::error!("kvoffload: the remote fetch thread panicked");
            }
        }
    }
}

impl Drop for WorkerTier {
    fn drop(&mut self) {
        self.shutdown(Duration::ZERO);
    }
}

fn push_report(reports: &Reports, id: u64, filled: usize) {
    reports
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((id, filled));
}

fn fetch_loop(
    mut tier: RemoteTier,
    blocks: &HostBlocks,
    rx: &Receiver<FetchRequest>,
    reports: &Reports,
) {
    while let Ok(req) = rx.recv() {
        let filled = fetch_one(&mut tier, blocks, &req);
        push_report(reports, req.id, filled);
    }
}

/// Fills the leading run of `req`'s blocks that the store has and that pass every check,
/// each read (or copied out of the store's own buffer) straight into its reserved CPU
/// block.
fn fetch_one(tier: &mut RemoteTier, blocks: &HostBlocks, req: &FetchRequest) -> usize {
    let n = req.hashes.len().min(req.cpu_blocks.len());
    let mut filled = 0;
    while filled < n {
        let end = (filled + FETCH_BATCH).min(n);
        let cpu = &req.cpu_blocks[filled..end];
        if has_repeats(cpu) {
            log::warn!(
                "kvoffload: remote fetch {} names a CPU block twice; recomputing",
                req.id
            );
            return filled;
        }
        // SAFETY: the scheduler reserved every block of `cpu` for this fetch
        // (`WorkerTier::fetch`'s contract): nothing else reads or writes them until this
        // fetch is reported, and they are distinct (checked above), so no two
        // destinations alias. The slices end with this batch, before the report.
        let dests = cpu
            .iter()
            .map(|&id| unsafe { blocks.block_parts_mut(id) })
            .collect::<Result<Vec<_>, _>>();
        let got = dests.map_err(|e| e.to_string()).and_then(|dests| {
            tier.fetch_into(&req.hashes[filled..end], dests)
                .map_err(|e| e.to_string())
        });
        let got = match got {
            Ok(got) => got,
            Err(e) => {
                log::warn!("kvoffload: remote fetch {}: {e}; recomputing", req.id);
                return filled;
            }
        };
        // A block not filled may hold anything: the run ends there, and the scheduler
        // drops the reserved blocks from it on (they were never published).
        let run = got.iter().take_while(|&&ok| ok).count();
        filled += run;
        if run < got.len() {
            return filled;
        }
    }
    filled
}

/// Whether a block id appears twice (two destinations over one block would alias).
fn has_repeats(ids: &[u32]) -> bool {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.windows(2).any(|w| w[0] == w[1])
}
