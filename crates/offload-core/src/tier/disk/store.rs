//! [`DiskStore`]: one rank's blocks in local files, as a [`RemoteStore`].
//!
//! Handles are clones of one shared state (files, index, counters), so the worker's fetch
//! thread and its write-behind thread use the same files. A batch's reads or writes run
//! on up to [`DiskOptions::io_threads`] threads at once, so many I/Os are in flight (the
//! device's queue, not one block at a time, decides the speed).

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::aligned::AlignedBuf;
use super::error::{DiskError, IoKind};
use super::file::{self, DataFile, DiskFaults, FileSet};
use super::index::{Placement, SlotIndex};
use super::io_pool::IoPool;
use super::journal::{DiskChanges, Journal};
use super::layout::{key_digest, Geometry};
use super::options::{DiskOptions, DISABLE_AFTER_ERRORS};
use super::recovery::{matches_header, rebuild};
use super::source::{Block, Source};
use super::stats::{DiskSnapshot, DiskStats};
use crate::tier::{
    BlockFill, Fill, LayoutFingerprint, RemoteKey, RemoteStore, TierError, ValueParts,
};

pub(super) struct Shared {
    pub(super) files: FileSet,
    pub(super) data: DataFile,
    pub(super) idx: File,
    pub(super) geo: Geometry,
    pub(super) index: Mutex<SlotIndex>,
    pub(super) stats: Arc<DiskStats>,
    pub(super) faults: DiskFaults,
    pub(super) persist: bool,
    /// Whether the data file still has its name (with `persist`, or when unlinking it
    /// failed); without it only the index file is removed at shutdown.
    pub(super) data_named: bool,
    pub(super) io_threads: usize,
    /// The threads a batch's I/Os run on, started once.
    pub(super) io: IoPool,
    pub(super) consecutive_errors: AtomicU64,
    pub(super) disabled: AtomicBool,
    pub(super) seq: AtomicU64,
    /// Which blocks came and went, when asked for (`DiskOptions::report_changes`).
    pub(super) journal: Option<Mutex<Journal>>,
    /// Slot-sized aligned buffers, reused: allocating and zeroing one per I/O costs as
    /// much as a fast device's read.
    pub(super) buffers: Mutex<Vec<AlignedBuf>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if !self.persist {
            self.files.remove(self.data_named);
        } else if let Err(e) = self.idx.sync_all().and_then(|()| fsync(&self.data)) {
            log::warn!(
                "kvoffload disk tier: cannot sync {}: {e}",
                self.files.data.display()
            );
        }
    }
}

fn fsync(data: &DataFile) -> std::io::Result<()> {
    data.sync()
}

/// Where one block of a write batch goes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Placed {
    pub(super) entry: u64,
    pub(super) slot: u64,
    pub(super) digest: u128,
}

/// One rank's disk tier (the owner of its files; see the module docs).
#[derive(Clone)]
pub struct DiskStore {
    pub(super) shared: Arc<Shared>,
}

impl std::fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStore")
            .field("path", &self.shared.files.data)
            .field("slots", &self.shared.geo.slots)
            .field("direct", &self.shared.data.is_direct())
            .finish()
    }
}

impl DiskStore {
    /// Opens (or creates) the files of `opts.path`, locks them, reserves the capacity and,
    /// with `persist`, rebuilds the index from what a previous engine left; without it the
    /// old contents are dropped.
    pub fn open(opts: &DiskOptions) -> Result<Self, DiskError> {
        let geo = Geometry::fit(opts.capacity_bytes, opts.block_bytes, opts.fingerprint.0).ok_or(
            DiskError::TooSmall {
                capacity: opts.capacity_bytes,
                block_bytes: opts.block_bytes,
            },
        )?;
        let files = FileSet::new(&opts.path);
        if let Some(dir) = opts.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| DiskError::Open {
                path: dir.to_path_buf(),
                reason: e.to_string(),
            })?;
        }
        let idx = file::open_idx(&files.idx)?;
        // The index file's lock is the rank's: taken before anything is read or changed.
        file::lock_exclusive(&idx, &files.idx)?;
        let data = file::open_data(&files.data, opts.use_page_cache)?;
        let stats = Arc::new(DiskStats::default());
        let mut index = SlotIndex::new(geo);
        let started = Instant::now();
        let kept = opts.persist && matches_header(&idx, &geo);
        if kept {
            rebuild(&idx, &geo, &mut index, &files.idx)?;
            let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            DiskStats::set(&stats.recovered_blocks, index.resident());
            DiskStats::set(&stats.rebuild_micros, micros);
            log::info!(
                "kvoffload disk tier: {} blocks recovered from {} in {:.3} s",
                index.resident(),
                files.data.display(),
                micros as f64 / 1e6
            );
        } else {
            for (f, p) in [(&idx, &files.idx), (data.file(), &files.data)] {
                f.set_len(0).map_err(|e| DiskError::Open {
                    path: p.clone(),
                    reason: e.to_string(),
                })?;
            }
        }
        file::reserve(&idx, &files.idx, geo.idx_file_bytes())?;
        file::reserve(data.file(), &files.data, geo.data_file_bytes())?;
        let data = data.checked(&files.data)?;
        // Without persist nothing is ever read back from another process, so the data file
        // needs no name once open and checked: unlinked, its reserved space goes back to
        // the file system when the worker dies, even by SIGKILL. The index keeps its
        // name: it holds the lock and the scheduler's probe opens it by path.
        let data_named = opts.persist || !files.unlink_data();
        DiskStats::set(&stats.buffered_io, u64::from(!data.is_direct()));
        if !kept {
            use std::os::unix::fs::FileExt;
            idx.write_all_at(&geo.encode_header(), 0)
                .map_err(|e| DiskError::Open {
                    path: files.idx.clone(),
                    reason: e.to_string(),
                })?;
        }
        DiskStats::set(&stats.capacity_blocks, geo.slots);
        DiskStats::set(
            &stats.capacity_bytes,
            geo.data_file_bytes() + geo.idx_file_bytes(),
        );
        DiskStats::set(&stats.resident_blocks, index.resident());
        let seq = index.clock();
        let io_threads = opts.io_width(data.is_direct());
        Ok(Self {
            shared: Arc::new(Shared {
                files,
                data,
                idx,
                geo,
                index: Mutex::new(index),
                stats,
                faults: DiskFaults::new(opts.faults),
                persist: opts.persist,
                data_named,
                io_threads,
                io: IoPool::new(io_threads),
                consecutive_errors: AtomicU64::new(0),
                disabled: AtomicBool::new(false),
                seq: AtomicU64::new(seq),
                journal: opts
                    .report_changes
                    .then(|| Mutex::new(Journal::new(geo.entries))),
                buffers: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The counters of this rank's files.
    pub fn stats(&self) -> Arc<DiskStats> {
        Arc::clone(&self.shared.stats)
    }

    /// The counters now.
    pub fn snapshot(&self) -> DiskSnapshot {
        self.shared.stats.snapshot()
    }

    /// Blocks that came onto the disk and left it since the last call (nothing unless
    /// opened with `report_changes`).
    pub fn take_changes(&self) -> DiskChanges {
        self.shared
            .journal
            .as_ref()
            .map(|j| j.lock().unwrap_or_else(PoisonError::into_inner).take())
            .unwrap_or_default()
    }

    /// Records a change in the journal, if there is one.
    pub(super) fn journal(&self, record: impl FnOnce(&mut Journal)) {
        if let Some(j) = &self.shared.journal {
            record(&mut j.lock().unwrap_or_else(PoisonError::into_inner));
        }
    }

    /// I/Os one batch has in flight at most: [`DiskOptions::io_threads`] with `O_DIRECT`,
    /// no more than the machine's cores through the page cache.
    pub fn io_threads(&self) -> usize {
        self.shared.io_threads
    }

    /// Whether reads and writes bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.shared.data.is_direct()
    }

    /// What `O_DIRECT` asks of a block's memory to move it without a copy: the address
    /// alignment and the length unit of each slice (`statx` `STATX_DIOALIGN`, a page where
    /// the kernel does not say); `None` with buffered I/O.
    pub fn direct_io_alignment(&self) -> Option<(usize, usize)> {
        let data = &self.shared.data;
        data.is_direct()
            .then(|| (data.align().mem, data.align().offset))
    }

    /// Blocks the capacity holds.
    pub fn capacity_blocks(&self) -> u64 {
        self.shared.geo.slots
    }

    /// The path the data file was created at (`<disk_path>.rank_<N>`), as errors and
    /// logs name it. Without `persist` the name is removed as soon as the file is open
    /// (the space is freed when the process ends, however it ends), so nothing may be
    /// there: use [`Self::open_data_file`] to reach the live file.
    pub fn data_path(&self) -> &Path {
        &self.shared.files.data
    }

    /// The live data file opened again for buffered reads and writes, named or not (for
    /// tests and tools that inspect or damage blocks on purpose, at
    /// [`Self::offset_of`]).
    pub fn open_data_file(&self) -> std::io::Result<File> {
        self.shared.data.reopen()
    }

    /// The index file's path.
    pub fn index_path(&self) -> &Path {
        &self.shared.files.idx
    }

    /// Byte offset of `key`'s block in the data file, if it is there (for tests that
    /// damage a block on purpose).
    pub fn offset_of(&self, key: &RemoteKey) -> Option<u64> {
        let index = self.index();
        let entry = index.find(key_digest(key.as_str().as_bytes()))?;
        Some(self.shared.geo.data_offset(index.slot_of(entry)))
    }

    /// Byte offset of `key`'s entry in the index file, if the block is there (for tests
    /// that damage an entry on purpose).
    pub fn entry_offset_of(&self, key: &RemoteKey) -> Option<u64> {
        let entry = self.index().find(key_digest(key.as_str().as_bytes()))?;
        Some(self.shared.geo.entry_offset(entry))
    }

    /// Bytes of one slot in the data file (the block rounded up to 4 KiB).
    pub fn slot_bytes(&self) -> u64 {
        self.shared.geo.slot_bytes
    }

    pub(super) fn index(&self) -> MutexGuard<'_, SlotIndex> {
        self.shared
            .index
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn disabled_error(&self) -> TierError {
        TierError::Disabled {
            store: format!("disk tier {}", self.shared.files.data.display()),
        }
    }

    /// Counts one I/O's outcome; the error that reaches [`DISABLE_AFTER_ERRORS`] in a row
    /// disables the tier, logged once.
    pub(super) fn outcome(&self, result: Result<(), IoKind>) {
        let s = &self.shared;
        match result {
            Ok(()) => s.consecutive_errors.store(0, Ordering::Relaxed),
            Err(kind) => {
                s.stats.error(kind);
                let n = s.consecutive_errors.fetch_add(1, Ordering::Relaxed) + 1;
                if n >= DISABLE_AFTER_ERRORS && !s.disabled.swap(true, Ordering::AcqRel) {
                    DiskStats::set(&s.stats.disabled, 1);
                    self.journal(Journal::all_removed);
                    log::error!(
                        "kvoffload disk tier: {} failed {n} I/Os in a row (last: {}); the disk \
                         tier is off until restart, requests recompute instead",
                        s.files.data.display(),
                        kind.name()
                    );
                }
            }
        }
    }

    pub(super) fn is_disabled(&self) -> bool {
        self.shared.disabled.load(Ordering::Acquire)
    }

    pub(super) fn update_resident(&self, index: &SlotIndex) {
        DiskStats::set(&self.shared.stats.resident_blocks, index.resident());
    }

    /// Writes each value's payload under its key: straight from the block's slices when
    /// given as parts (`put_parts`), from the value's payload when encoded (`put`).
    fn write_batch(&self, entries: &[(&RemoteKey, Source<'_>)]) -> Vec<Result<(), TierError>> {
        if self.is_disabled() {
            return entries.iter().map(|_| Err(self.disabled_error())).collect();
        }
        let started = Instant::now();
        let s = &self.shared;
        let fingerprint = LayoutFingerprint(s.geo.fingerprint);
        let blocks: Vec<Result<Block<'_>, TierError>> = entries
            .iter()
            .map(|(_, v)| v.block(fingerprint, s.geo.block_bytes as usize))
            .collect();
        let (placed, jobs) = {
            let mut index = self.index();
            let mut evicted = Vec::new();
            let placed: Vec<Result<Option<Placed>, TierError>> = entries
                .iter()
                .zip(&blocks)
                .map(|((k, _), b)| {
                    let b = b.as_ref().map_err(Clone::clone)?;
                    let digest = key_digest(k.as_str().as_bytes());
                    match index.place(digest, &mut evicted) {
                        Placement::Present => {
                            // A block a restart recovered is reported once written (or read).
                            if let Some(entry) = index.find(digest) {
                                self.journal(|j| j.stored(entry, b.hash));
                            }
                            Ok(None)
                        }
                        Placement::Write { entry, slot } => Ok(Some(Placed {
                            entry,
                            slot,
                            digest,
                        })),
                        Placement::Busy => {
                            DiskStats::add(&s.stats.writes_skipped_busy, 1);
                            Err(TierError::Store {
                                op: "put",
                                reason: "every slot, or every entry of the block's set, is busy"
                                    .into(),
                            })
                        }
                    }
                })
                .collect();
            let jobs: Vec<(usize, Placed)> = placed
                .iter()
                .enumerate()
                .filter_map(|(i, p)| match p {
                    Ok(Some(p)) => Some((i, *p)),
                    _ => None,
                })
                .collect();
            DiskStats::add(&s.stats.evictions, evicted.len() as u64);
            for &entry in &evicted {
                self.journal(|j| j.removed(entry));
                // The scheduler's probe reads the entries: an evicted block's is erased,
                // unless this batch writes another block's there, under the index's lock
                // (so before any later batch may place a block in it and write its entry).
                if !jobs.iter().any(|(_, p)| p.entry == entry) {
                    self.clear_entry(entry);
                }
            }
            (placed, jobs)
        };
        let results = self.write_placed(&jobs, &blocks);
        let mut out: Vec<Result<(), TierError>> =
            placed.into_iter().map(|p| p.map(|_| ())).collect();
        let mut index = self.index();
        for (&(i, p), (r, counts)) in jobs.iter().zip(results) {
            index.finish_write(p.entry, r.is_ok());
            if counts || r.is_ok() {
                self.outcome(r);
            }
            match r {
                Ok(()) => {
                    DiskStats::add(&s.stats.writes, 1);
                    DiskStats::add(&s.stats.bytes_written, s.geo.slot_bytes);
                    if let Ok(b) = &blocks[i] {
                        self.journal(|j| j.stored(p.entry, b.hash));
                    }
                }
                Err(kind) => {
                    out[i] = Err(TierError::Store {
                        op: "put",
                        reason: format!("disk write failed ({})", kind.name()),
                    });
                }
            }
        }
        self.update_resident(&index);
        let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        DiskStats::add(&s.stats.write_micros, micros);
        out
    }
}

impl RemoteStore for DiskStore {
    fn exists(&mut self, keys: &[RemoteKey]) -> Vec<Result<bool, TierError>> {
        if self.is_disabled() {
            return keys.iter().map(|_| Ok(false)).collect();
        }
        let digests: Vec<u128> = keys
            .iter()
            .map(|k| key_digest(k.as_str().as_bytes()))
            .collect();
        let mut found = Vec::new();
        self.index().find_many(&digests, &mut found);
        found.into_iter().map(|slot| Ok(slot.is_some())).collect()
    }

    fn get(&mut self, keys: &[RemoteKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        self.get_batch(keys)
    }

    /// Straight into the destinations: one copy a block fewer than `get` and a copy.
    fn get_into(
        &mut self,
        keys: &[RemoteKey],
        fingerprint: LayoutFingerprint,
        blocks: &mut [BlockFill<'_, '_>],
    ) -> Vec<Result<Fill, TierError>> {
        self.fill_batch(keys, fingerprint, blocks)
    }

    fn put(&mut self, entries: &[(RemoteKey, Vec<u8>)]) -> Vec<Result<(), TierError>> {
        let sources: Vec<(&RemoteKey, Source<'_>)> = entries
            .iter()
            .map(|(k, v)| (k, Source::Encoded(v)))
            .collect();
        self.write_batch(&sources)
    }

    fn put_parts(&mut self, entries: &[(RemoteKey, ValueParts<'_>)]) -> Vec<Result<(), TierError>> {
        let sources: Vec<(&RemoteKey, Source<'_>)> =
            entries.iter().map(|(k, v)| (k, Source::Parts(v))).collect();
        self.write_batch(&sources)
    }

    fn discard(&mut self, keys: &[RemoteKey]) {
        let s = &self.shared;
        let mut index = self.index();
        for k in keys {
            let d = key_digest(k.as_str().as_bytes());
            if let Some(entry) = index.find(d) {
                DiskStats::add(&s.stats.checksum_failures, 1);
                index.drop_entry(entry, d);
                self.clear_entry(entry);
                self.journal(|j| j.removed(entry));
            }
        }
        self.update_resident(&index);
    }

    fn verifies_checksums(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("disk {}", self.shared.files.data.display())
    }
}
