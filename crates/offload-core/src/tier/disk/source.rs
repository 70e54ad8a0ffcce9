//! [`Source`]: a value to write as the caller gave it, encoded already or as parts,
//! so a write encodes straight into its I/O buffer.

use crate::tier::value::{stored_hash, ValueParts};

/// A value to write, as `put` or `put_parts` gave it.
pub(super) enum Source<'a> {
    /// Encoded by the caller: copied into the I/O buffer.
    Encoded(&'a [u8]),
    /// Encoded into the I/O buffer, summed in the same pass.
    Parts(&'a ValueParts<'a>),
}

impl Source<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Self::Encoded(v) => v.len(),
            Self::Parts(p) => p.len(),
        }
    }

    /// The block hash the value carries (what the KV events announce).
    pub(super) fn hash(&self) -> Option<&[u8]> {
        match self {
            Self::Encoded(v) => stored_hash(v),
            Self::Parts(p) => Some(p.hash()),
        }
    }

    /// Writes the value into the front of `out`; its trailer (the checksum its entry
    /// commits to), `None` when `out` is too short.
    pub(super) fn fill(&self, out: &mut [u8]) -> Option<u64> {
        match self {
            Self::Encoded(v) => {
                out.get_mut(..v.len())?.copy_from_slice(v);
                let trailer = v.get(v.len().checked_sub(8)?..)?;
                Some(u64::from_le_bytes(trailer.try_into().ok()?))
            }
            Self::Parts(p) => p.encode_into(out),
        }
    }
}
