//! Stored values: a header that says what the bytes are, the block's bytes, a checksum.
//!
//! ```text
//! 0   magic "KVOF"            4 bytes
//! 4   format version (u16)    2
//! 6   hash length (u16)       2
//! 8   layout fingerprint      16  (u128)
//! 24  payload length (u64)    8
//! 32  block hash              hash length
//! ..  payload                 payload length
//! ..  checksum (u64)          8   over every byte before it
//! ```
//! All integers little-endian. The value repeats its block hash, so a value stored under
//! the wrong key (a bug, a desynchronized connection) is caught like a corrupted one.

use thiserror::Error;

use super::checksum::{checksum, Checksum};
use super::key::{LayoutFingerprint, MAX_HASH_BYTES};

const MAGIC: &[u8; 4] = b"KVOF";
/// The value format this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;
const FIXED_HEADER: usize = 32;
const TRAILER: usize = 8;
const CHECKSUM_SEED: u64 = 0x4b56_4f46_5641_4c55;

/// Why a stored value is not the block that was asked for. Any of these is a miss.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ValueError {
    /// Shorter than a header and trailer.
    #[error("value of {len} bytes is shorter than its header")]
    TooShort {
        /// Bytes received.
        len: usize,
    },
    /// Not written by kvoffload.
    #[error("value does not start with the kvoffload magic")]
    BadMagic,
    /// Written by a build with another value format.
    #[error("value format version {found}, this build reads {FORMAT_VERSION}")]
    Version {
        /// The version in the header.
        found: u16,
    },
    /// Written by an engine with another model or KV layout.
    #[error("value from layout {found}, expected {expected}")]
    Fingerprint {
        /// The fingerprint in the header.
        found: LayoutFingerprint,
        /// This engine's fingerprint.
        expected: LayoutFingerprint,
    },
    /// The value belongs to another block.
    #[error("value holds another block's hash")]
    Hash,
    /// The header's lengths disagree with the bytes received (a truncated value).
    #[error("value of {len} bytes, its header describes {described}")]
    Length {
        /// Bytes received.
        len: usize,
        /// Bytes the header accounts for.
        described: u64,
    },
    /// The block has another size than this engine's blocks.
    #[error("block of {found} bytes, expected {expected}")]
    BlockSize {
        /// Payload bytes in the value.
        found: u64,
        /// This engine's block size in bytes.
        expected: usize,
    },
    /// The bytes changed after they were written.
    #[error("checksum mismatch")]
    Checksum,
}

/// Bytes of the stored form of a `payload_len`-byte block under a `hash_len`-byte hash
/// (hashes longer than [`MAX_HASH_BYTES`] are cut to it, as [`encode`] does).
pub fn encoded_len(hash_len: usize, payload_len: usize) -> usize {
    FIXED_HEADER + hash_len.min(MAX_HASH_BYTES) + payload_len + TRAILER
}

/// The stored form of block `hash`'s `payload` for a layout with `fingerprint`.
///
/// `payload` is given in parts (a block's slice of each layer region) and concatenated.
/// A hash longer than a [`KeySpace`](super::KeySpace) accepts is cut to 64 bytes, so
/// [`decode`] never matches it.
pub fn encode(fingerprint: LayoutFingerprint, hash: &[u8], payload: &[&[u8]]) -> Vec<u8> {
    let hash = &hash[..hash.len().min(MAX_HASH_BYTES)];
    let payload_len: usize = payload.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(FIXED_HEADER + hash.len() + payload_len + TRAILER);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    // At most MAX_HASH_BYTES, so it fits.
    out.extend_from_slice(&(hash.len() as u16).to_le_bytes());
    out.extend_from_slice(&fingerprint.0.to_le_bytes());
    out.extend_from_slice(&(payload_len as u64).to_le_bytes());
    out.extend_from_slice(hash);
    for p in payload {
        out.extend_from_slice(p);
    }
    let sum = checksum(CHECKSUM_SEED, &[&out]);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// The payload of `value` if it is block `hash` of a layout with `fingerprint` and holds
/// exactly `block_bytes` bytes, intact.
pub fn decode<'a>(
    value: &'a [u8],
    fingerprint: LayoutFingerprint,
    hash: &[u8],
    block_bytes: usize,
) -> Result<&'a [u8], ValueError> {
    decode_checked(value, fingerprint, hash, block_bytes, true)
}

/// Whether `value`'s trailer is the checksum of the bytes before it (a store that verifies
/// values itself, on its own threads, calls this or [`copy_verified`]; see
/// [`decode_verified`]).
pub fn checksum_ok(value: &[u8]) -> bool {
    let Some(body_end) = value.len().checked_sub(TRAILER) else {
        return false;
    };
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&value[body_end..]);
    checksum(CHECKSUM_SEED, &[&value[..body_end]]) == u64::from_le_bytes(sum)
}

/// Bytes summed before they are copied, in [`copy_verified`]: small enough that the
/// piece is still in the core's cache when the copy reads it.
const VERIFY_PIECE: usize = 16 << 10;

/// A copy of `value` if its trailer is the checksum of the bytes before it.
///
/// One pass: each piece is summed, then copied while it is still in cache, so verifying
/// costs little more than the copy out of an I/O buffer a store makes anyway (a separate
/// checksum pass reads the whole value from memory once more).
pub fn copy_verified(value: &[u8]) -> Option<Vec<u8>> {
    let body_end = value.len().checked_sub(TRAILER)?;
    let (body, trailer) = value.split_at(body_end);
    let mut sum = Checksum::new(CHECKSUM_SEED);
    let mut out = Vec::with_capacity(value.len());
    for piece in body.chunks(VERIFY_PIECE) {
        sum.update(piece);
        out.extend_from_slice(piece);
    }
    let expected = u64::from_le_bytes(trailer.try_into().ok()?);
    out.extend_from_slice(trailer);
    (sum.finish() == expected).then_some(out)
}

/// [`decode`] of a value whose checksum the store already verified with [`checksum_ok`]:
/// every other check is made, the checksum is not computed again.
pub fn decode_verified<'a>(
    value: &'a [u8],
    fingerprint: LayoutFingerprint,
    hash: &[u8],
    block_bytes: usize,
) -> Result<&'a [u8], ValueError> {
    decode_checked(value, fingerprint, hash, block_bytes, false)
}

/// The block hash a value's header names (unchecked: for the disk tier's journal, which
/// records what a write was asked to store).
pub(crate) fn stored_hash(value: &[u8]) -> Option<&[u8]> {
    let hash_len = usize::from(u16::from_le_bytes([*value.get(6)?, *value.get(7)?]));
    value.get(FIXED_HEADER..FIXED_HEADER + hash_len)
}

fn decode_checked<'a>(
    value: &'a [u8],
    fingerprint: LayoutFingerprint,
    hash: &[u8],
    block_bytes: usize,
    sum_it: bool,
) -> Result<&'a [u8], ValueError> {
    let len = value.len();
    if len < FIXED_HEADER + TRAILER {
        return Err(ValueError::TooShort { len });
    }
    if &value[..4] != MAGIC {
        return Err(ValueError::BadMagic);
    }
    let version = u16::from_le_bytes([value[4], value[5]]);
    if version != FORMAT_VERSION {
        return Err(ValueError::Version { found: version });
    }
    let hash_len = usize::from(u16::from_le_bytes([value[6], value[7]]));
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&value[8..24]);
    let found = LayoutFingerprint(u128::from_le_bytes(fp));
    if found != fingerprint {
        return Err(ValueError::Fingerprint {
            found,
            expected: fingerprint,
        });
    }
    let mut pl = [0u8; 8];
    pl.copy_from_slice(&value[24..32]);
    let payload_len = u64::from_le_bytes(pl);
    let described = (FIXED_HEADER + TRAILER + hash_len) as u64 + payload_len;
    if described != len as u64 {
        return Err(ValueError::Length { len, described });
    }
    if payload_len != block_bytes as u64 {
        return Err(ValueError::BlockSize {
            found: payload_len,
            expected: block_bytes,
        });
    }
    let body_end = len - TRAILER;
    if sum_it && !checksum_ok(value) {
        return Err(ValueError::Checksum);
    }
    // Checked after the checksum: a flipped hash byte is corruption, not another block.
    if &value[FIXED_HEADER..FIXED_HEADER + hash_len] != hash {
        return Err(ValueError::Hash);
    }
    Ok(&value[FIXED_HEADER + hash_len..body_end])
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const FP: LayoutFingerprint = LayoutFingerprint(0x1234_5678_9abc_def0_0fed_cba9_8765_4321);
    const HASH: &[u8] = &[7; 32];

    fn block() -> Vec<u8> {
        (0..300u32).map(|i| (i * 31 + 5) as u8).collect()
    }

    #[test]
    fn round_trip_is_byte_exact_across_parts() {
        let b = block();
        let v = encode(FP, HASH, &[&b[..100], &b[100..]]);
        assert_eq!(decode(&v, FP, HASH, b.len()).unwrap(), &b[..]);
        assert_eq!(v, encode(FP, HASH, &[&b]));
        assert_eq!(v.len(), encoded_len(HASH.len(), b.len()));
    }

    #[test]
    fn every_truncation_is_a_miss() {
        let b = block();
        let v = encode(FP, HASH, &[&b]);
        for n in 0..v.len() {
            assert!(decode(&v[..n], FP, HASH, b.len()).is_err(), "cut to {n}");
        }
    }

    #[test]
    fn every_flipped_byte_is_a_miss() {
        let b = block();
        let v = encode(FP, HASH, &[&b]);
        for i in 0..v.len() {
            let mut c = v.clone();
            c[i] ^= 0x40;
            assert!(decode(&c, FP, HASH, b.len()).is_err(), "flip at {i}");
        }
    }

    #[test]
    fn copy_verified_is_checksum_ok_across_pieces() {
        // Longer than two pieces and not a multiple of one, so piece edges fall inside
        // the payload and the trailer follows a short last piece.
        let b: Vec<u8> = (0..2 * VERIFY_PIECE as u32 + 999)
            .map(|i| (i * 7 + 1) as u8)
            .collect();
        let v = encode(FP, HASH, &[&b]);
        assert_eq!(copy_verified(&v).as_deref(), Some(&v[..]));
        for i in (0..v.len())
            .step_by(997)
            .chain([VERIFY_PIECE, v.len() - 9, v.len() - 1])
        {
            let mut c = v.clone();
            c[i] ^= 0x10;
            assert_eq!(copy_verified(&c), None, "flip at {i}");
            assert!(!checksum_ok(&c), "flip at {i}");
        }
        assert_eq!(copy_verified(&v[..v.len() - 1]), None);
        assert_eq!(copy_verified(&v[..7]), None);
    }

    #[test]
    fn other_layout_block_or_size_is_named() {
        let b = block();
        let v = encode(FP, HASH, &[&b]);
        let other = LayoutFingerprint(1);
        assert_eq!(
            decode(&v, other, HASH, b.len()),
            Err(ValueError::Fingerprint {
                found: FP,
                expected: other
            })
        );
        assert_eq!(decode(&v, FP, &[8; 32], b.len()), Err(ValueError::Hash));
        assert_eq!(
            decode(&v, FP, HASH, 64),
            Err(ValueError::BlockSize {
                found: 300,
                expected: 64
            })
        );
        let mut old = v.clone();
        old[4] = 9;
        assert_eq!(
            decode(&old, FP, HASH, b.len()),
            Err(ValueError::Version { found: 9 })
        );
        assert_eq!(decode(&[b'x'; 64], FP, HASH, 1), Err(ValueError::BadMagic));
    }
}
