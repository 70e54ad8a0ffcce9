//! What a restart finds: whether the index file describes this geometry, and the index
//! rebuilt from the entries a previous engine committed.

use std::fs::File;
use std::path::Path;

use super::error::DiskError;
use super::index::SlotIndex;
use super::layout::{Entry, Geometry, ENTRY_BYTES, IDX_HEADER};

/// Reads slot `slot`'s entry into `raw`.
pub(super) fn read_entry(
    idx: &File,
    geo: &Geometry,
    slot: u64,
    raw: &mut [u8],
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    idx.read_exact_at(raw, geo.entry_offset(slot))
}

/// Whether the index file describes exactly `geo` (same capacity, block size, layout).
pub(super) fn matches_header(idx: &File, geo: &Geometry) -> bool {
    use std::os::unix::fs::FileExt;
    let mut h = vec![0u8; IDX_HEADER as usize];
    idx.read_exact_at(&mut h, 0).is_ok() && Geometry::decode_header(&h) == Some(*geo)
}

/// Fills `index` from the entries a previous engine committed.
pub(super) fn rebuild(
    idx: &File,
    geo: &Geometry,
    index: &mut SlotIndex,
    path: &Path,
) -> Result<(), DiskError> {
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
            if in_set && e.payload_len == geo.block_bytes {
                index.restore(s, e.digest, e.seq);
            }
        }
        slot += n;
    }
    Ok(())
}
