//! [`DiskStore`]: one rank's blocks in local files, as a [`RemoteStore`].
//!
//! Handles are clones of one shared state (files, index, counters), so the worker's fetch
//! thread and its write-behind thread use the same files. A batch's reads or writes run
//! on up to [`DiskOptions::io_threads`] threads at once, so many I/Os are in flight (the
//! device's queue, not one block at a time, decides the speed).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::error::{DiskError, IoKind};
use super::file::{self, AlignedBuf, DataFile, DiskFaults, FileSet};
use super::index::{Index, Placement};
use super::journal::{DiskChanges, Journal};
use super::layout::{key_digest, Entry, Geometry, ENTRY_BYTES, IDX_HEADER};
use super::stats::{DiskSnapshot, DiskStats};
use crate::tier::value::{checksum_ok, stored_hash};
use crate::tier::{LayoutFingerprint, RemoteKey, RemoteStore, TierError};
use crate::transfer::FaultPlan;

/// Consecutive failed I/Os after which the tier turns itself off.
pub const DISABLE_AFTER_ERRORS: u64 = 16;
/// Threads a batch's I/O runs on when none is given.
pub const DEFAULT_IO_THREADS: usize = 8;

/// How to open a rank's files.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DiskOptions {
    /// `<disk_path>.rank_<N>`; the index is this path plus `.idx`.
    pub path: PathBuf,
    /// Bytes the two files may take together.
    pub capacity_bytes: u64,
    /// Bytes of every value (all blocks of a layout encode to one length).
    pub value_bytes: u64,
    /// The layout whose blocks the files hold; a persisted file of another is wiped.
    pub fingerprint: LayoutFingerprint,
    /// Buffered I/O instead of `O_DIRECT`.
    pub use_page_cache: bool,
    /// Keep the files at shutdown and serve them after a restart.
    pub persist: bool,
    /// Most I/Os of one batch in flight at once.
    pub io_threads: usize,
    /// Faults to inject (tests).
    pub faults: FaultPlan,
    /// Record which blocks come and go, for [`DiskStore::take_changes`] (KV events).
    pub report_changes: bool,
}

impl DiskOptions {
    /// Options with the defaults: `O_DIRECT`, not persisted, no faults.
    pub fn new(
        path: impl Into<PathBuf>,
        capacity_bytes: u64,
        value_bytes: u64,
        fingerprint: LayoutFingerprint,
    ) -> Self {
        Self {
            path: path.into(),
            capacity_bytes,
            value_bytes,
            fingerprint,
            use_page_cache: false,
            persist: false,
            io_threads: DEFAULT_IO_THREADS,
            faults: FaultPlan::default(),
            report_changes: false,
        }
    }
}

struct Shared {
    files: FileSet,
    data: DataFile,
    idx: File,
    geo: Geometry,
    index: Mutex<Index>,
    stats: Arc<DiskStats>,
    faults: DiskFaults,
    persist: bool,
    io_threads: usize,
    consecutive_errors: AtomicU64,
    disabled: AtomicBool,
    seq: AtomicU64,
    /// Which blocks came and went, when asked for (`DiskOptions::report_changes`).
    journal: Option<Mutex<Journal>>,
    /// Slot-sized aligned buffers, reused: allocating and zeroing one per I/O costs as
    /// much as a fast device's read.
    buffers: Mutex<Vec<AlignedBuf>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if !self.persist {
            self.files.remove();
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

/// One rank's disk tier (the owner of its files; see the module docs).
#[derive(Clone)]
pub struct DiskStore {
    shared: Arc<Shared>,
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
        let geo = Geometry::fit(opts.capacity_bytes, opts.value_bytes, opts.fingerprint.0).ok_or(
            DiskError::TooSmall {
                capacity: opts.capacity_bytes,
                value_bytes: opts.value_bytes,
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
        let mut index = Index::new(geo);
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
                io_threads: opts.io_threads.max(1),
                consecutive_errors: AtomicU64::new(0),
                disabled: AtomicBool::new(false),
                seq: AtomicU64::new(seq),
                journal: opts
                    .report_changes
                    .then(|| Mutex::new(Journal::new(geo.slots))),
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
    fn journal(&self, record: impl FnOnce(&mut Journal)) {
        if let Some(j) = &self.shared.journal {
            record(&mut j.lock().unwrap_or_else(PoisonError::into_inner));
        }
    }

    /// Whether reads and writes bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.shared.data.is_direct()
    }

    /// Blocks the capacity holds.
    pub fn capacity_blocks(&self) -> u64 {
        self.shared.geo.slots
    }

    /// The data file's path.
    pub fn data_path(&self) -> &Path {
        &self.shared.files.data
    }

    /// The index file's path.
    pub fn index_path(&self) -> &Path {
        &self.shared.files.idx
    }

    /// Byte offset of `key`'s block in the data file, if it is there (for tests that
    /// damage a block on purpose).
    pub fn offset_of(&self, key: &RemoteKey) -> Option<u64> {
        let slot = self.index().find(key_digest(key.as_str().as_bytes()))?;
        Some(self.shared.geo.data_offset(slot))
    }

    fn index(&self) -> MutexGuard<'_, Index> {
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
    fn outcome(&self, result: Result<(), IoKind>) {
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

    fn is_disabled(&self) -> bool {
        self.shared.disabled.load(Ordering::Acquire)
    }

    fn update_resident(&self, index: &Index) {
        DiskStats::set(&self.shared.stats.resident_blocks, index.resident());
    }

    /// Reads one slot and checks its bytes against the entry's commitment (length and the
    /// value's trailer) and the value's checksum; the header is the caller's
    /// (`value::decode_verified`).
    fn read_slot(&self, slot: u64) -> Result<Option<Vec<u8>>, IoKind> {
        let s = &self.shared;
        let geo = &s.geo;
        let mut buf = self.buffer();
        let read = s
            .data
            .read(buf.as_mut_slice(), geo.data_offset(slot), &s.faults);
        let result = read.map(|()| self.check_slot(slot, &buf));
        self.give_back(buf);
        result
    }

    /// The value in `buf` (slot `slot`'s bytes) if its entry commits to it.
    fn check_slot(&self, slot: u64, buf: &AlignedBuf) -> Option<Vec<u8>> {
        let s = &self.shared;
        let geo = &s.geo;
        let mut raw = [0u8; ENTRY_BYTES];
        let entry = match read_entry(&s.idx, geo, slot, &mut raw) {
            Ok(()) => Entry::decode(&raw),
            Err(_) => None,
        };
        let value = &buf.as_slice()[..geo.value_len as usize];
        let trailer = value
            .get(value.len().saturating_sub(8)..)
            .and_then(|t| <[u8; 8]>::try_from(t).ok())
            .map(u64::from_le_bytes);
        let intact =
            entry.is_some_and(|e| e.value_len == geo.value_len && Some(e.value_sum) == trailer);
        // The full checksum here, on the I/O threads, so a batch's blocks are verified in
        // parallel and a bad one frees its slot (`verifies_checksums`).
        (intact && checksum_ok(value)).then(|| value.to_vec())
    }

    fn buffer(&self) -> AlignedBuf {
        let pooled = self
            .shared
            .buffers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        pooled.unwrap_or_else(|| AlignedBuf::new(self.shared.geo.slot_bytes as usize))
    }

    fn give_back(&self, buf: AlignedBuf) {
        let mut pool = self
            .shared
            .buffers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if pool.len() < 2 * self.shared.io_threads {
            pool.push(buf);
        }
    }

    fn write_slot(&self, slot: u64, digest: u128, value: &[u8]) -> Result<(), IoKind> {
        let s = &self.shared;
        let geo = &s.geo;
        let mut buf = self.buffer();
        let b = buf.as_mut_slice();
        b[..value.len()].copy_from_slice(value);
        // A reused buffer holds another block's tail: the padding is zeroed so nothing
        // of it reaches the disk.
        b[value.len()..].fill(0);
        let written = s
            .data
            .write(buf.as_slice(), geo.data_offset(slot), &s.faults);
        self.give_back(buf);
        written?;
        let trailer = value
            .get(value.len().saturating_sub(8)..)
            .and_then(|t| <[u8; 8]>::try_from(t).ok())
            .map_or(0, u64::from_le_bytes);
        let entry = Entry {
            digest,
            value_len: value.len() as u64,
            seq: s.seq.fetch_add(1, Ordering::Relaxed) + 1,
            value_sum: trailer,
        };
        use std::os::unix::fs::FileExt;
        // The entry goes after the data: it commits the slot (see `layout`).
        s.idx
            .write_all_at(&entry.encode(), geo.entry_offset(slot))
            .map_err(|e| file::classify(&e))
    }

    /// Erases `slot`'s entry on disk, so a restart does not find the bad block again.
    /// Best effort: an entry left behind fails the same check again.
    fn clear_entry(&self, slot: u64) {
        use std::os::unix::fs::FileExt;
        let s = &self.shared;
        let _ = s
            .idx
            .write_all_at(&[0u8; ENTRY_BYTES], s.geo.entry_offset(slot));
    }

    /// Runs `work` on every item, on up to `io_threads` threads.
    fn parallel<T: Sync, R: Send>(&self, items: &[T], work: impl Fn(&T) -> R + Sync) -> Vec<R> {
        let threads = self.shared.io_threads.min(items.len());
        if threads <= 1 {
            return items.iter().map(&work).collect();
        }
        let chunk = items.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let handles: Vec<_> = items
                .chunks(chunk)
                .map(|part| scope.spawn(|| part.iter().map(&work).collect::<Vec<R>>()))
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        })
    }
}

/// Reads slot `slot`'s entry into `raw`.
fn read_entry(idx: &File, geo: &Geometry, slot: u64, raw: &mut [u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    idx.read_exact_at(raw, geo.entry_offset(slot))
}

/// Whether the index file describes exactly `geo` (same capacity, block size, layout).
fn matches_header(idx: &File, geo: &Geometry) -> bool {
    use std::os::unix::fs::FileExt;
    let mut h = vec![0u8; IDX_HEADER as usize];
    idx.read_exact_at(&mut h, 0).is_ok() && Geometry::decode_header(&h) == Some(*geo)
}

/// Fills `index` from the entries a previous engine committed.
fn rebuild(idx: &File, geo: &Geometry, index: &mut Index, path: &Path) -> Result<(), DiskError> {
    use std::os::unix::fs::FileExt;
    const CHUNK: u64 = 8192;
    let mut buf = vec![0u8; (CHUNK as usize) * ENTRY_BYTES];
    let mut slot = 0;
    while slot < geo.slots {
        let n = CHUNK.min(geo.slots - slot);
        let bytes = &mut buf[..n as usize * ENTRY_BYTES];
        idx.read_exact_at(bytes, geo.entry_offset(slot))
            .map_err(|e| DiskError::Open {
                path: path.to_path_buf(),
                reason: format!("reading the index: {e}"),
            })?;
        for (i, raw) in bytes.chunks_exact(ENTRY_BYTES).enumerate() {
            let s = slot + i as u64;
            let Some(e) = Entry::decode(raw) else {
                continue;
            };
            // An entry in a set its digest does not pick was not written by this layout.
            let in_set = (geo.set_start(e.digest)..geo.set_start(e.digest) + geo.ways).contains(&s);
            if in_set && e.value_len == geo.value_len {
                index.restore(s, e.digest, e.seq);
            }
        }
        slot += n;
    }
    Ok(())
}

impl RemoteStore for DiskStore {
    fn exists(&mut self, keys: &[RemoteKey]) -> Vec<Result<bool, TierError>> {
        if self.is_disabled() {
            return keys.iter().map(|_| Ok(false)).collect();
        }
        let index = self.index();
        keys.iter()
            .map(|k| Ok(index.find(key_digest(k.as_str().as_bytes())).is_some()))
            .collect()
    }

    fn get(&mut self, keys: &[RemoteKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        if self.is_disabled() {
            return keys.iter().map(|_| Ok(None)).collect();
        }
        let started = Instant::now();
        let wanted: Vec<(u128, Option<u64>)> = {
            let mut index = self.index();
            keys.iter()
                .map(|k| {
                    let d = key_digest(k.as_str().as_bytes());
                    (d, index.begin_read(d))
                })
                .collect()
        };
        let reads = self.parallel(&wanted, |&(_, slot)| slot.map(|s| self.read_slot(s)));
        let s = &self.shared;
        let mut index = self.index();
        let mut out = Vec::with_capacity(keys.len());
        for (&(digest, slot), read) in wanted.iter().zip(reads) {
            let Some(slot) = slot else {
                out.push(Ok(None));
                continue;
            };
            index.end_read(slot);
            match read {
                Some(Ok(Some(value))) => {
                    self.outcome(Ok(()));
                    // A block a restart recovered is reported once read (or written).
                    if let Some(h) = stored_hash(&value) {
                        self.journal(|j| j.stored(slot, h));
                    }
                    DiskStats::add(&s.stats.reads, 1);
                    DiskStats::add(&s.stats.bytes_read, s.geo.slot_bytes);
                    out.push(Ok(Some(value)));
                }
                Some(Ok(None)) => {
                    DiskStats::add(&s.stats.reads, 1);
                    DiskStats::add(&s.stats.checksum_failures, 1);
                    index.drop_slot(slot, digest);
                    self.clear_entry(slot);
                    self.journal(|j| j.removed(slot));
                    out.push(Ok(None));
                }
                Some(Err(kind)) => {
                    self.outcome(Err(kind));
                    out.push(Err(TierError::Store {
                        op: "get",
                        reason: format!("disk read failed ({})", kind.name()),
                    }));
                }
                None => out.push(Ok(None)),
            }
        }
        self.update_resident(&index);
        let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        DiskStats::add(&s.stats.read_micros, micros);
        out
    }

    fn put(&mut self, entries: &[(RemoteKey, Vec<u8>)]) -> Vec<Result<(), TierError>> {
        if self.is_disabled() {
            return entries.iter().map(|_| Err(self.disabled_error())).collect();
        }
        let started = Instant::now();
        let s = &self.shared;
        let placed: Vec<Result<Option<(u64, u128)>, TierError>> = {
            let mut index = self.index();
            entries
                .iter()
                .map(|(k, v)| {
                    if v.len() as u64 != s.geo.value_len {
                        return Err(TierError::Store {
                            op: "put",
                            reason: format!(
                                "value of {} bytes, the disk tier's slots take {}",
                                v.len(),
                                s.geo.value_len
                            ),
                        });
                    }
                    let d = key_digest(k.as_str().as_bytes());
                    match index.place(d) {
                        Placement::Present => {
                            // A block a restart recovered is reported once written (or read).
                            if let (Some(slot), Some(h)) = (index.find(d), stored_hash(v)) {
                                self.journal(|j| j.stored(slot, h));
                            }
                            Ok(None)
                        }
                        Placement::Write { slot, evicted } => {
                            if evicted {
                                DiskStats::add(&s.stats.evictions, 1);
                                self.journal(|j| j.removed(slot));
                            }
                            Ok(Some((slot, d)))
                        }
                        Placement::Busy => {
                            DiskStats::add(&s.stats.writes_skipped_busy, 1);
                            Err(TierError::Store {
                                op: "put",
                                reason: "every slot of the block's set is busy".into(),
                            })
                        }
                    }
                })
                .collect()
        };
        let jobs: Vec<(usize, u64, u128)> = placed
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p {
                Ok(Some((slot, d))) => Some((i, *slot, *d)),
                _ => None,
            })
            .collect();
        let results = self.parallel(&jobs, |&(i, slot, d)| {
            self.write_slot(slot, d, &entries[i].1)
        });
        let mut out: Vec<Result<(), TierError>> =
            placed.into_iter().map(|p| p.map(|_| ())).collect();
        let mut index = self.index();
        for (&(i, slot, _), r) in jobs.iter().zip(results) {
            index.finish_write(slot, r.is_ok());
            self.outcome(r);
            match r {
                Ok(()) => {
                    DiskStats::add(&s.stats.writes, 1);
                    DiskStats::add(&s.stats.bytes_written, s.geo.slot_bytes);
                    if let Some(h) = stored_hash(&entries[i].1) {
                        self.journal(|j| j.stored(slot, h));
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

    fn discard(&mut self, keys: &[RemoteKey]) {
        let s = &self.shared;
        let mut index = self.index();
        for k in keys {
            let d = key_digest(k.as_str().as_bytes());
            if let Some(slot) = index.find(d) {
                DiskStats::add(&s.stats.checksum_failures, 1);
                index.drop_slot(slot, d);
                self.clear_entry(slot);
                self.journal(|j| j.removed(slot));
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
