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
//! The checksum is the crate's `tier::value_sum` (its module doc defines it and says what
//! it detects), seeded with a constant of this module.
//! All integers little-endian. The value repeats its block hash, so a value stored under
//! the wrong key (a bug, a desynchronized connection) is caught like a corrupted one.

use thiserror::Error;

use super::key::{LayoutFingerprint, MAX_HASH_BYTES};
use super::value_sum::ValueSum;

const MAGIC: &[u8; 4] = b"KVOF";
/// The value format this build writes and reads. 2: the trailer is the SIMD-friendly
/// 8-lane `value_sum` (format 1 used the 4-lane sum the crate still uses for keys and
/// disk index entries); a format-1 value is [`ValueError::Version`], a miss, never summed.
pub const FORMAT_VERSION: u16 = 2;
pub(crate) const FIXED_HEADER: usize = 32;
pub(crate) const TRAILER: usize = 8;
pub(crate) const CHECKSUM_SEED: u64 = 0x4b56_4f46_5641_4c55;

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
    ValueParts::new(fingerprint, hash, payload.to_vec()).encode()
}

/// A value to store, held as its parts (header fields and the block's slices) until it is
/// written where it goes: a store with its own I/O buffers encodes it there with
/// [`Self::encode_into`], one pass that copies and sums, instead of into a `Vec` of its
/// own that is then copied again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueParts<'a> {
    fingerprint: LayoutFingerprint,
    hash: &'a [u8],
    payload: Vec<&'a [u8]>,
}

impl<'a> ValueParts<'a> {
    /// Block `hash`'s `payload` (its parts, concatenated) for a layout with `fingerprint`;
    /// the hash is cut as [`encode`] cuts it.
    pub fn new(fingerprint: LayoutFingerprint, hash: &'a [u8], payload: Vec<&'a [u8]>) -> Self {
        Self {
            fingerprint,
            hash: &hash[..hash.len().min(MAX_HASH_BYTES)],
            payload,
        }
    }

    /// The block hash the value will carry (cut as [`encode`] cuts it).
    pub(crate) fn hash(&self) -> &'a [u8] {
        self.hash
    }

    /// The layout the value is for.
    pub(crate) fn fingerprint(&self) -> LayoutFingerprint {
        self.fingerprint
    }

    /// The block's bytes, in parts, concatenated in order.
    pub(crate) fn payload(&self) -> &[&'a [u8]] {
        &self.payload
    }

    pub(crate) fn payload_len(&self) -> usize {
        self.payload.iter().map(|p| p.len()).sum()
    }

    /// Bytes of the stored form.
    pub fn len(&self) -> usize {
        encoded_len(self.hash.len(), self.payload_len())
    }

    /// Never: a value has at least its header and trailer.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The stored form, in a `Vec` of its own.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        self.emit(|piece| out.extend_from_slice(piece));
        out
    }

    /// Writes the stored form into the first [`Self::len`] bytes of `out` and returns its
    /// checksum (the trailer); `None`, writing nothing, when `out` is shorter.
    pub fn encode_into(&self, out: &mut [u8]) -> Option<u64> {
        let out = out.get_mut(..self.len())?;
        let mut at = 0;
        Some(self.emit(|piece| {
            out[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }))
    }

    /// Hands the stored form to `put` in order, a piece at a time, each piece summed right
    /// after it is copied (while it is in cache); returns the checksum.
    fn emit(&self, mut put: impl FnMut(&[u8])) -> u64 {
        let mut header = [0u8; FIXED_HEADER + MAX_HASH_BYTES];
        header[..4].copy_from_slice(MAGIC);
        header[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        // At most MAX_HASH_BYTES, so it fits.
        header[6..8].copy_from_slice(&(self.hash.len() as u16).to_le_bytes());
        header[8..24].copy_from_slice(&self.fingerprint.0.to_le_bytes());
        header[24..32].copy_from_slice(&(self.payload_len() as u64).to_le_bytes());
        let header_len = FIXED_HEADER + self.hash.len();
        header[FIXED_HEADER..header_len].copy_from_slice(self.hash);
        let mut sum = ValueSum::new(CHECKSUM_SEED);
        for piece in std::iter::once(&header[..header_len])
            .chain(self.payload.iter().flat_map(|p| p.chunks(VERIFY_PIECE)))
        {
            put(piece);
            sum.update(piece);
        }
        let sum = sum.finish();
        put(&sum.to_le_bytes());
        sum
    }
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
    let mut computed = ValueSum::new(CHECKSUM_SEED);
    computed.update(&value[..body_end]);
    computed.finish() == u64::from_le_bytes(sum)
}

/// Bytes summed and copied at a time, in [`copy_verified`] and [`ValueParts`]' encoding:
/// small enough that the piece is still in the core's cache when the second pass reads it.
pub(crate) const VERIFY_PIECE: usize = 16 << 10;

/// A copy of `value` if its trailer is the checksum of the bytes before it.
///
/// One pass: each piece is summed, then copied while it is still in cache, so verifying
/// costs little more than the copy out of an I/O buffer a store makes anyway (a separate
/// checksum pass reads the whole value from memory once more).
pub fn copy_verified(value: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    copy_verified_into(value, &mut out).then_some(out)
}

/// [`copy_verified`] into `out` (its old contents replaced, its allocation reused, so a
/// store that keeps buffers takes no fresh pages per value); whether the checksum held.
/// On `false` `out` holds bytes that failed it: the caller must not hand them out.
pub fn copy_verified_into(value: &[u8], out: &mut Vec<u8>) -> bool {
    out.clear();
    let Some(body_end) = value.len().checked_sub(TRAILER) else {
        return false;
    };
    let (body, trailer) = value.split_at(body_end);
    out.reserve(value.len());
    let mut sum = ValueSum::new(CHECKSUM_SEED);
    for piece in body.chunks(VERIFY_PIECE) {
        sum.update(piece);
        out.extend_from_slice(piece);
    }
    out.extend_from_slice(trailer);
    let mut expected = [0u8; TRAILER];
    expected.copy_from_slice(trailer);
    sum.finish() == u64::from_le_bytes(expected)
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
    let hash_len = check_fields(value, len, fingerprint, block_bytes)?;
    if sum_it && !checksum_ok(value) {
        return Err(ValueError::Checksum);
    }
    // Checked after the checksum: a flipped hash byte is corruption, not another block.
    if &value[FIXED_HEADER..FIXED_HEADER + hash_len] != hash {
        return Err(ValueError::Hash);
    }
    Ok(&value[FIXED_HEADER + hash_len..len - TRAILER])
}

/// Checks the fixed header at the start of `header` (at least [`FIXED_HEADER`] bytes) of
/// a `len`-byte value: magic, format, fingerprint, lengths; returns the hash length.
fn check_fields(
    header: &[u8],
    len: usize,
    fingerprint: LayoutFingerprint,
    block_bytes: usize,
) -> Result<usize, ValueError> {
    if &header[..4] != MAGIC {
        return Err(ValueError::BadMagic);
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != FORMAT_VERSION {
        return Err(ValueError::Version { found: version });
    }
    let hash_len = usize::from(u16::from_le_bytes([header[6], header[7]]));
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&header[8..24]);
    let found = LayoutFingerprint(u128::from_le_bytes(fp));
    if found != fingerprint {
        return Err(ValueError::Fingerprint {
            found,
            expected: fingerprint,
        });
    }
    let mut pl = [0u8; 8];
    pl.copy_from_slice(&header[24..32]);
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
    Ok(hash_len)
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
    fn encode_into_is_encode_and_returns_the_trailer() {
        let b: Vec<u8> = (0..VERIFY_PIECE as u32 + 333)
            .map(|i| (i * 3) as u8)
            .collect();
        let parts = ValueParts::new(
            FP,
            HASH,
            vec![&b[..5], &b[5..VERIFY_PIECE + 7], &b[VERIFY_PIECE + 7..]],
        );
        let v = encode(FP, HASH, &[&b]);
        assert_eq!(parts.encode(), v);
        assert_eq!(parts.len(), v.len());
        // A reused buffer: longer than the value and dirty; its tail is left alone.
        let mut buf = vec![0xee; v.len() + 100];
        let sum = parts.encode_into(&mut buf).unwrap();
        assert_eq!(&buf[..v.len()], &v[..]);
        assert!(buf[v.len()..].iter().all(|&x| x == 0xee));
        assert_eq!(sum.to_le_bytes(), v[v.len() - 8..]);
        assert!(parts.encode_into(&mut buf[..v.len() - 1]).is_none());
    }

    #[test]
    fn copy_verified_into_replaces_a_dirty_buffer() {
        let b = block();
        let v = encode(FP, HASH, &[&b]);
        let mut out = vec![0xaa; 3 * v.len()];
        assert!(copy_verified_into(&v, &mut out));
        assert_eq!(out, v);
        let mut c = v.clone();
        c[40] ^= 1;
        assert!(!copy_verified_into(&c, &mut out));
        assert!(!copy_verified_into(&v[..7], &mut out));
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

    #[test]
    fn a_format_1_value_is_another_version_and_fails_the_new_checksum() {
        // What the format-1 build wrote: version 1, trailer summed by the old 4-lane sum.
        let b = block();
        let mut v = encode(FP, HASH, &[&b]);
        v[4..6].copy_from_slice(&1u16.to_le_bytes());
        let body_end = v.len() - TRAILER;
        let old = crate::tier::checksum::checksum(CHECKSUM_SEED, &[&v[..body_end]]);
        v[body_end..].copy_from_slice(&old.to_le_bytes());
        assert_eq!(
            decode(&v, FP, HASH, b.len()),
            Err(ValueError::Version { found: 1 })
        );
        // A store that verifies before decoding (the disk tier) rejects it as well.
        assert!(!checksum_ok(&v));
        assert_eq!(copy_verified(&v), None);
    }
}
