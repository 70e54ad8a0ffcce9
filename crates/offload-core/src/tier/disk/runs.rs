//! Runs: blocks in consecutive slots moved with one I/O.
//!
//! A batch's blocks go to consecutive slots (`index.rs`), so a prompt's blocks read back
//! in order sit next to each other on disk. With `O_DIRECT` such a run is one `preadv`
//! (or `pwritev`) of every block's memory in turn: a block's own slices where a direct
//! transfer takes them whole and the block fills its slot, else a reused slot-sized
//! aligned buffer (copied and summed after a read, before a write). Each block is still
//! checked on its own, so a bad block costs itself, not its run; a failed I/O fails
//! every block of its run and counts once.
//!
//! A run is at most [`RUN_BYTES`] long and short enough that a batch still keeps every
//! I/O thread busy: larger I/Os cost the device less per byte, but on a virtio disk
//! (this project's CI) a batch of 32 64 KiB blocks read as two 1 MiB runs ran at 0.56x
//! of a raw sequential read against 0.72x as 32 single reads 8 in flight, and at 0.87x
//! as eight runs of four: runs never trade queue depth for size. With the page cache the kernel's
//! copies, not the device, bound a read: blocks move one by one.

use std::ops::Range;

use super::aligned::AlignedBuf;
use super::error::IoKind;
use super::index::Location;
use super::layout::{Entry, PayloadSum};
use super::slot_io::{copy_summed, fill_summed, shape, whole_direct};
use super::source::Block;
use super::stats::DiskStats;
use super::store::{DiskStore, Placed};
use crate::tier::TierError;

/// Most bytes one I/O of a run moves: the request size of the raw sequential read the
/// tier is measured against (`dd iflag=direct bs=4M`).
const RUN_BYTES: u64 = 4 << 20;

/// A result per block of a run, and whether the run moved with one I/O (whose error,
/// then, every block of it shares).
pub(super) type RunResults<T> = (Vec<Result<T, IoKind>>, bool);

/// `items` (in order) cut into runs of at most `max` whose slots (`slot_of`) follow each
/// other, as index ranges.
pub(super) fn consecutive_runs<T>(
    items: &[T],
    max: usize,
    slot_of: impl Fn(&T) -> u64,
) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match runs.last_mut() {
            Some(r)
                if r.len() < max.max(1)
                    && slot_of(&items[r.end - 1]).checked_add(1) == Some(slot_of(item)) =>
            {
                r.end = i + 1;
            }
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

/// The runs' results block by block, each with whether its error (if any) is to be
/// counted: the blocks of a run moved with one I/O share its error, counted once (on the
/// run's last block).
pub(super) fn per_block<T>(
    per_run: Vec<RunResults<T>>,
) -> impl Iterator<Item = (Result<T, IoKind>, bool)> {
    per_run.into_iter().flat_map(|(results, one_io)| {
        let n = results.len();
        results
            .into_iter()
            .enumerate()
            .map(move |(k, r)| (r, !one_io || k + 1 == n))
    })
}

/// A block a batch reads: its position among the batch's keys, its key digest, where
/// it is.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wanted {
    pub(super) i: usize,
    pub(super) digest: u128,
    pub(super) at: Location,
}

/// Where one block of a run goes in the I/O: its own slices, or a bounce buffer.
enum Side {
    Slices,
    Buffer(AlignedBuf),
}

impl DiskStore {
    /// Blocks one I/O moves of a batch of `blocks` blocks in consecutive slots (a batch
    /// stored together, read back in order): 1 with the page cache; else at most 4 MiB
    /// of them, and no more than spreads the batch over every I/O thread.
    pub fn run_blocks(&self, blocks: usize) -> usize {
        let s = &self.shared;
        if !s.data.is_direct() {
            return 1;
        }
        let by_bytes = (RUN_BYTES / s.geo.slot_bytes).max(1) as usize;
        by_bytes.min(blocks.div_ceil(s.io_threads.max(1))).max(1)
    }

    /// How block `parts` take part in a run's I/O: straight when a direct transfer takes
    /// every slice whole and the block fills its slot (no padding to skip), else
    /// through a buffer.
    fn side<P: AsRef<[u8]>>(&self, parts: &[P]) -> Side {
        let s = &self.shared;
        if s.geo.slot_bytes == s.geo.block_bytes && whole_direct(&shape(parts), s.data.align()) {
            Side::Slices
        } else {
            Side::Buffer(self.buffer())
        }
    }

    /// Reads a run of blocks in consecutive slots (`run`, their destinations `parts`)
    /// with one `preadv`, then checks each as [`Self::read_slot_into`] does; a result per
    /// block. A run of one block takes `read_slot_into`'s path.
    pub(super) fn read_run_into(
        &self,
        run: &[Wanted],
        parts: &mut [&mut [&mut [u8]]],
    ) -> RunResults<Option<Entry>> {
        if run.len() < 2 {
            let results = run
                .iter()
                .zip(parts.iter_mut())
                .map(|(w, p)| self.read_slot_into(w.at, w.digest, p))
                .collect();
            return (results, false);
        }
        let s = &self.shared;
        let slot_bytes = s.geo.slot_bytes as usize;
        let entries: Vec<Option<Entry>> =
            run.iter().map(|w| self.entry_for(w.at, w.digest)).collect();
        let mut sides: Vec<Side> = parts.iter().map(|p| self.side(p)).collect();
        let read = {
            let mut pieces: Vec<&mut [u8]> = Vec::new();
            for (p, side) in parts.iter_mut().zip(sides.iter_mut()) {
                match side {
                    Side::Slices => pieces.extend(p.iter_mut().map(|x| &mut **x)),
                    Side::Buffer(b) => pieces.push(&mut b.as_mut_slice()[..slot_bytes]),
                }
            }
            let offset = s.geo.data_offset(run[0].at.slot);
            s.data
                .read_parts(&mut pieces, offset, &s.faults, usize::MAX, |_| {})
        };
        let block_bytes = s.geo.block_bytes as usize;
        let mut results = Vec::with_capacity(run.len());
        for (((entry, w), p), side) in entries
            .into_iter()
            .zip(run)
            .zip(parts.iter_mut())
            .zip(sides)
        {
            let mut sum = PayloadSum::new(w.digest);
            let result = match (read, side) {
                (Err(kind), side) => {
                    if let Side::Buffer(b) = side {
                        self.give_back(b);
                    }
                    Err(kind)
                }
                (Ok(()), Side::Slices) => {
                    DiskStats::add(&s.stats.direct_reads, 1);
                    sum.update_all(p);
                    Ok(())
                }
                (Ok(()), Side::Buffer(b)) => {
                    DiskStats::add(&s.stats.bounced_reads, 1);
                    copy_summed(&b.as_slice()[..block_bytes], p, &mut sum);
                    self.give_back(b);
                    Ok(())
                }
            };
            results.push(result.map(|()| entry.filter(|e| sum.finish() == e.payload_sum)));
        }
        (results, true)
    }

    /// Writes a run of blocks placed in consecutive slots with one `pwritev`, then their
    /// entries; a result per block. A run of one block (or with a block that did not
    /// resolve) goes block by block, as [`Self::write_slot`] does.
    pub(super) fn write_run(
        &self,
        run: &[(usize, Placed)],
        blocks: &[Result<Block<'_>, TierError>],
    ) -> RunResults<()> {
        let resolved: Option<Vec<&Block<'_>>> = run
            .iter()
            .map(|(i, _)| blocks[*i].as_ref().ok())
            .collect::<Option<Vec<_>>>()
            .filter(|bs| bs.len() > 1);
        let Some(resolved) = resolved else {
            let results = run
                .iter()
                .map(|(i, at)| match &blocks[*i] {
                    Ok(b) => self.write_slot(at, b),
                    // Placed only when the block resolved.
                    Err(_) => Err(IoKind::Other),
                })
                .collect();
            return (results, false);
        };
        let s = &self.shared;
        let slot_bytes = s.geo.slot_bytes as usize;
        let mut sums = Vec::with_capacity(run.len());
        let mut sides: Vec<Side> = Vec::with_capacity(run.len());
        for (b, (_, at)) in resolved.iter().zip(run) {
            let mut sum = PayloadSum::new(at.digest);
            let mut side = self.side(&b.payload);
            match &mut side {
                Side::Slices => sum.update_all(&b.payload),
                Side::Buffer(buf) => fill_summed(buf.as_mut_slice(), &b.payload, &mut sum),
            }
            sums.push(sum.finish());
            sides.push(side);
        }
        let written = {
            let mut pieces: Vec<&[u8]> = Vec::new();
            for (b, side) in resolved.iter().zip(&sides) {
                match side {
                    Side::Slices => pieces.extend(b.payload.iter().copied()),
                    Side::Buffer(buf) => pieces.push(&buf.as_slice()[..slot_bytes]),
                }
            }
            let offset = s.geo.data_offset(run[0].1.slot);
            s.data
                .write_parts(&pieces, offset, &s.faults, usize::MAX, |_| {})
        };
        for side in sides {
            let counter = match side {
                Side::Slices => &s.stats.direct_writes,
                Side::Buffer(buf) => {
                    self.give_back(buf);
                    &s.stats.bounced_writes
                }
            };
            if written.is_ok() {
                DiskStats::add(counter, 1);
            }
        }
        if let Err(kind) = written {
            return (run.iter().map(|_| Err(kind)).collect(), true);
        }
        let results = run
            .iter()
            .zip(resolved)
            .zip(sums)
            .map(|(((_, at), b), sum)| self.write_entry(at, sum, b.hash))
            .collect();
        (results, true)
    }

    /// Writes each placed block (`jobs`: its position in `blocks` and where it goes) on
    /// the I/O threads, a run of blocks in consecutive slots with one I/O; a result per
    /// job, in order, and whether its error (if any) is to be counted: the blocks of a
    /// run written with one I/O share its error, counted once.
    pub(super) fn write_placed(
        &self,
        jobs: &[(usize, Placed)],
        blocks: &[Result<Block<'_>, TierError>],
    ) -> Vec<(Result<(), IoKind>, bool)> {
        let runs = consecutive_runs(jobs, self.run_blocks(jobs.len()), |(_, at)| at.slot);
        per_block(self.parallel(&runs, |r| self.write_run(&jobs[r.clone()], blocks))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::consecutive_runs;

    #[test]
    fn runs_follow_consecutive_slots_up_to_their_longest() {
        let slots = [4u64, 5, 6, 9, 10, 3, 4, 5, 6, 7, u64::MAX, 0];
        assert_eq!(
            consecutive_runs(&slots, 3, |&s| s),
            [0..3, 3..5, 5..8, 8..10, 10..11, 11..12]
        );
        assert_eq!(consecutive_runs(&slots, 1, |&s| s).len(), slots.len());
        assert!(consecutive_runs(&[] as &[u64], 4, |&s| s).is_empty());
    }
}
