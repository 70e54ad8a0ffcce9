//! What a restart finds: whether the index file describes this geometry, and the index
//! rebuilt from the entries a previous engine committed.

use std::fs::File;
use std::path::Path;

use super::error::DiskError;
use super::index::SlotIndex;
use super::layout::{Entry, Geometry, ENTRY_BYTES, IDX_HEADER};

/// Reads entry `entry` into `raw`.
pub(super) fn read_entry(
    idx: &File,
    geo: &Geometry,
    entry: u64,
    raw: &mut [u8],
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    idx.read_exact_at(raw, geo.entry_offset(entry))
}

/// Whether the index file describes exactly `geo` (same capacity, block size, layout).
pub(super) fn matches_header(idx: &File, geo: &Geometry) -> bool {
    use std::os::unix::fs::FileExt;
    let mut h = vec![0u8; IDX_HEADER as usize];
    idx.read_exact_at(&mut h, 0).is_ok() && Geometry::decode_header(&h) == Some(*geo)
}

/// Fills `index` from the entries a previous engine committed. Of two entries naming
/// one slot the later write's is kept and the other cleared on disk too, so the
/// scheduler's probe no longer finds it.
pub(super) fn rebuild(
    idx: &File,
    geo: &Geometry,
    index: &mut SlotIndex,
    path: &Path,
) -> Result<(), DiskError> {
    use std::os::unix::fs::FileExt;
    const CHUNK: u64 = 8192;
    let mut buf = vec![0u8; (CHUNK as usize) * ENTRY_BYTES];
    let mut lost = Vec::new();
    let mut first = 0;
    while first < geo.entries {
        let n = CHUNK.min(geo.entries - first);
        let bytes = &mut buf[..n as usize * ENTRY_BYTES];
        idx.read_exact_at(bytes, geo.entry_offset(first))
            .map_err(|e| DiskError::Open {
                path: path.to_path_buf(),
                reason: format!("reading the index: {e}"),
            })?;
        for (i, raw) in bytes.chunks_exact(ENTRY_BYTES).enumerate() {
            let at = first + i as u64;
            let Some(e) = Entry::decode(raw) else {
                continue;
            };
            // An entry in a set its digest does not pick, or naming a slot past the data
            // file, was not written by this layout.
            let set = geo.set_start(e.digest);
            if (set..set + geo.ways).contains(&at)
                && e.payload_len == geo.block_bytes
                && e.slot < geo.slots
            {
                lost.extend(index.restore(at, e.digest, e.seq, e.slot));
            }
        }
        first += n;
    }
    for entry in lost {
        // Best effort: an entry left behind loses to the same one again next time.
        let _ = idx.write_all_at(&[0u8; ENTRY_BYTES], geo.entry_offset(entry));
    }
    Ok(())
}
