//! [`DiskProbe`]: the scheduler's view of a rank's disk tier.
//!
//! The scheduler runs in another process than the worker that owns the files, and must
//! never wait on the disk: its probe thread asks this view whether blocks exist, and the
//! view answers from the index file alone (one read of one set's entries per key, served
//! by the page cache). It never reads or writes blocks; a block evicted between the probe
//! and the worker's fetch is a fetch miss, which the planner already handles.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::file::FileSet;
use super::layout::{key_digest, Entry, Geometry, ENTRY_BYTES, IDX_HEADER};
use crate::tier::{LayoutFingerprint, RemoteKey, RemoteStore, TierError};

/// Existence checks on a rank's index file.
#[derive(Debug)]
pub struct DiskProbe {
    path: PathBuf,
    fingerprint: LayoutFingerprint,
    open: Option<(File, Geometry)>,
}

impl DiskProbe {
    /// A view of the files at `rank_path` holding blocks of `fingerprint`. The files may
    /// not exist yet (the worker creates them): every check before then is a miss.
    pub fn new(rank_path: impl Into<PathBuf>, fingerprint: LayoutFingerprint) -> Self {
        Self {
            path: FileSet::new(&rank_path.into()).idx,
            fingerprint,
            open: None,
        }
    }

    /// The index file and its geometry, opened if it now exists and describes this layout.
    fn opened(&mut self) -> Option<&(File, Geometry)> {
        if self.open.is_none() {
            let f = File::open(&self.path).ok()?;
            let mut h = vec![0u8; IDX_HEADER as usize];
            f.read_exact_at(&mut h, 0).ok()?;
            let geo = Geometry::decode_header(&h)?;
            if geo.fingerprint != self.fingerprint.0 {
                return None;
            }
            self.open = Some((f, geo));
        }
        self.open.as_ref()
    }
}

impl RemoteStore for DiskProbe {
    fn exists(&mut self, keys: &[RemoteKey]) -> Vec<Result<bool, TierError>> {
        let Some((f, geo)) = self.opened() else {
            return keys.iter().map(|_| Ok(false)).collect();
        };
        let mut set = vec![0u8; geo.ways as usize * ENTRY_BYTES];
        keys.iter()
            .map(|k| {
                let d = key_digest(k.as_str().as_bytes());
                let start = geo.set_start(d);
                f.read_exact_at(&mut set, geo.entry_offset(start))
                    .map_err(|e| TierError::Store {
                        op: "exists",
                        reason: format!("reading the disk index: {e}"),
                    })?;
                Ok(set
                    .chunks_exact(ENTRY_BYTES)
                    .filter_map(Entry::decode)
                    .any(|e| e.digest == d && e.payload_len == geo.block_bytes))
            })
            .collect()
    }

    fn get(&mut self, keys: &[RemoteKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        keys.iter().map(|_| Err(scheduler_only("get"))).collect()
    }

    fn put(&mut self, entries: &[(RemoteKey, Vec<u8>)]) -> Vec<Result<(), TierError>> {
        entries.iter().map(|_| Err(scheduler_only("put"))).collect()
    }

    fn describe(&self) -> String {
        format!("disk index {}", self.path.display())
    }
}

fn scheduler_only(op: &'static str) -> TierError {
    TierError::Store {
        op,
        reason: "the scheduler's view of the disk tier only checks existence".into(),
    }
}
