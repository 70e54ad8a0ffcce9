//! [`Source`]: a block to write as the caller gave it (an encoded value or a value's
//! parts), and [`Block`], what a slot and its entry take of it: the payload's slices and
//! the block hash.

use crate::tier::value::{decode, stored_hash, ValueParts};
use crate::tier::{LayoutFingerprint, TierError};

/// A value to write, as `put` or `put_parts` gave it.
pub(super) enum Source<'a> {
    /// Encoded by the caller: its header is checked and its payload written.
    Encoded(&'a [u8]),
    /// Parts: the payload's slices are written as they are (no encoding at all).
    Parts(&'a ValueParts<'a>),
}

/// What a slot takes of a value: the payload (in the caller's slices, in order) and the
/// block's hash (for its entry).
pub(super) struct Block<'a> {
    pub(super) hash: &'a [u8],
    pub(super) payload: Vec<&'a [u8]>,
}

impl<'a> Source<'a> {
    /// The block to write, if the value is one of `fingerprint`'s blocks of `block_bytes`
    /// bytes (an encoded value intact, too: a slot keeps no checksum of its own
    /// header, so a corrupt value would otherwise be stored as good); an error that names
    /// the mismatch when not.
    pub(super) fn block(
        &self,
        fingerprint: LayoutFingerprint,
        block_bytes: usize,
    ) -> Result<Block<'a>, TierError> {
        let rejected = |reason: String| TierError::Store { op: "put", reason };
        match *self {
            Self::Encoded(v) => {
                let hash = stored_hash(v)
                    .ok_or_else(|| rejected(format!("value of {} bytes has no header", v.len())))?;
                let payload = decode(v, fingerprint, hash, block_bytes)
                    .map_err(|e| rejected(format!("value not stored: {e}")))?;
                Ok(Block {
                    hash,
                    payload: vec![payload],
                })
            }
            Self::Parts(p) => {
                if p.fingerprint() != fingerprint {
                    return Err(rejected(format!(
                        "block of layout {}, the disk tier holds layout {fingerprint}",
                        p.fingerprint()
                    )));
                }
                if p.payload_len() != block_bytes {
                    return Err(rejected(format!(
                        "block of {} bytes, the disk tier's slots take {block_bytes}",
                        p.payload_len()
                    )));
                }
                Ok(Block {
                    hash: p.hash(),
                    payload: p.payload().to_vec(),
                })
            }
        }
    }
}
