//! [`DiskChanges`]: which blocks came onto a rank's disk and which left it, for the KV
//! events a router reads (medium `"STORAGE"`).
//!
//! Only the store knows both: a write-behind batch may be dropped, skipped (no slot or
//! entry free) or fail, and a write evicts the block under the clock hand (or its set's
//! least recently used one). So the store records, per index entry, the hash of the
//! block it describes (the hash the write was asked for, or the entry's), and hands out
//! what changed since the last call. It is kept only when asked for
//! ([`DiskOptions::report_changes`](super::DiskOptions)): 17 bytes per entry, 1.5
//! entries a slot.
//!
//! Blocks a restart recovered are reported once a read or a write finds them (the
//! rebuild fills the index, not the journal).

/// Bytes of the hashes the journal keeps: the tier's keys (`HASH_BYTES` of the binding).
pub const JOURNAL_HASH_BYTES: usize = 16;

type Hash = [u8; JOURNAL_HASH_BYTES];

/// Blocks whose residence on one rank's disk changed since the last report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DiskChanges {
    /// Hashes of blocks now on disk (written, or found by a read or a write after a
    /// restart).
    pub stored: Vec<Hash>,
    /// Hashes of blocks an earlier report named that left the disk since (evicted,
    /// failed a check, or the tier turned itself off). Apply them before `stored`: a
    /// block that came and went between two reports is in neither.
    pub removed: Vec<Hash>,
}

impl DiskChanges {
    /// `h` left: unsaid if it came since the last report, else a removal.
    fn gone(&mut self, h: Hash) {
        match self.stored.iter().rposition(|s| *s == h) {
            Some(i) => {
                self.stored.remove(i);
            }
            None => self.removed.push(h),
        }
    }
}

/// The per-entry record and the changes not taken yet.
#[derive(Debug)]
pub(crate) struct Journal {
    entries: Vec<Option<Hash>>,
    changes: DiskChanges,
}

impl Journal {
    pub(crate) fn new(entries: u64) -> Self {
        Self {
            entries: vec![None; entries as usize],
            changes: DiskChanges::default(),
        }
    }

    /// Entry `entry` now describes the block `hash` (a hash of another length is not
    /// reported).
    pub(crate) fn stored(&mut self, entry: u64, hash: &[u8]) {
        let (Some(s), Ok(h)) = (self.entries.get_mut(entry as usize), Hash::try_from(hash)) else {
            return;
        };
        if *s == Some(h) {
            return;
        }
        if let Some(old) = s.replace(h) {
            self.changes.gone(old);
        }
        self.changes.stored.push(h);
    }

    /// The block of entry `entry` left the disk.
    pub(crate) fn removed(&mut self, entry: u64) {
        if let Some(h) = self.entries.get_mut(entry as usize).and_then(Option::take) {
            self.changes.gone(h);
        }
    }

    /// Every block left (the tier turned itself off).
    pub(crate) fn all_removed(&mut self) {
        for h in self.entries.iter_mut().filter_map(Option::take) {
            self.changes.gone(h);
        }
    }

    pub(crate) fn take(&mut self) -> DiskChanges {
        std::mem::take(&mut self.changes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reports_its_block_once_and_its_removal_after_it() {
        let mut j = Journal::new(2);
        j.stored(0, &[1; 16]);
        j.stored(0, &[1; 16]);
        j.stored(1, &[2; 8]);
        j.removed(1);
        assert_eq!(j.take().stored, vec![[1; 16]]);
        // Block 3 came and went between two reports: neither says it.
        j.stored(0, &[3; 16]);
        j.stored(1, &[4; 16]);
        j.all_removed();
        let c = j.take();
        assert_eq!((c.stored, c.removed), (vec![], vec![[1; 16]]));
        // A block removed and stored again between two reports: both, removal first.
        j.stored(0, &[5; 16]);
        let _ = j.take();
        j.removed(0);
        j.stored(1, &[5; 16]);
        let c = j.take();
        assert_eq!((c.stored, c.removed), (vec![[5; 16]], vec![[5; 16]]));
        assert_eq!(j.take(), DiskChanges::default());
    }
}
