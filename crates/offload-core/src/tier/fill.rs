//! Fetching blocks straight into the caller's memory ([`RemoteStore::get_into`]): what a
//! fill asks for ([`BlockFill`]) and answers ([`Fill`]), the default that goes through
//! [`RemoteStore::get`], and the verified copies a store that reads into buffers of its
//! own makes into the caller's slices.
//!
//! A CPU block is one slice per layer region, so a block's destination is several slices
//! that its payload fills in order; a store that can read into them (the disk tier) saves
//! the copy out of a value of its own.

use super::value::{decode, decode_verified, ValueError, CHECKSUM_SEED, TRAILER, VERIFY_PIECE};
use super::value_sum::ValueSum;
use super::{LayoutFingerprint, RemoteKey, RemoteStore, TierError};

/// One block to fetch into the caller's memory: its hash (as the value must carry it) and
/// where its payload goes, the slices filled in order.
#[derive(Debug)]
#[non_exhaustive]
pub struct BlockFill<'h, 'd> {
    /// The block's hash, as keys take it.
    pub hash: &'h [u8],
    /// The payload's destination: its bytes, in order, over these slices.
    pub parts: Vec<&'d mut [u8]>,
}

impl<'h, 'd> BlockFill<'h, 'd> {
    /// Block `hash`, its payload to go into `parts` in order.
    pub fn new(hash: &'h [u8], parts: Vec<&'d mut [u8]>) -> Self {
        Self { hash, parts }
    }

    /// Bytes of the payload the destination takes.
    pub fn len(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }

    /// Whether the destination takes no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What one block's fill came to. Only [`Fill::Filled`] says the destination holds the
/// block: after any other answer it may hold anything.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fill {
    /// The destination holds the block's payload, every check passed.
    Filled,
    /// The store has no such block (or one that failed the store's own checks, which it
    /// counted and dropped).
    Missing,
    /// The store had a value under the key that is not the block asked for.
    Rejected(ValueError),
}

/// [`RemoteStore::get_into`] through [`RemoteStore::get`]: each value decoded (its
/// checksum computed unless the store verified it), its payload copied into the
/// destination.
pub(crate) fn through_get<S: RemoteStore + ?Sized>(
    store: &mut S,
    keys: &[RemoteKey],
    fingerprint: LayoutFingerprint,
    blocks: &mut [BlockFill<'_, '_>],
) -> Vec<Result<Fill, TierError>> {
    let answers = store.get(keys);
    let decode = if store.verifies_checksums() {
        decode_verified
    } else {
        decode
    };
    let mut out = Vec::with_capacity(answers.len());
    for (answer, block) in answers.into_iter().zip(blocks.iter_mut()) {
        out.push(answer.map(|value| {
            let Some(value) = value else {
                return Fill::Missing;
            };
            match decode(&value, fingerprint, block.hash, block.len()) {
                Ok(payload) => {
                    scatter(payload, &mut block.parts);
                    Fill::Filled
                }
                Err(e) => Fill::Rejected(e),
            }
        }));
    }
    out
}

/// Copies `payload` over `parts` in order; the caller checked that their lengths agree.
fn scatter(payload: &[u8], parts: &mut [&mut [u8]]) {
    let mut at = 0;
    for part in parts {
        let n = part.len();
        part.copy_from_slice(&payload[at..at + n]);
        at += n;
    }
}

/// Copies the payload of `value` (the bytes after its `header_len`-byte header and before
/// its trailer) over `parts` in order, summing the value as it goes, a piece at a time
/// while the piece is in cache; whether the trailer is the checksum. `false`, with
/// nothing copied, when the parts do not take exactly the payload; on `false` the parts
/// hold bytes that failed the check.
pub(crate) fn copy_verified_scatter(
    value: &[u8],
    header_len: usize,
    parts: &mut [&mut [u8]],
) -> bool {
    let payload_len: usize = parts.iter().map(|p| p.len()).sum();
    if value.len() != header_len + payload_len + TRAILER {
        return false;
    }
    let (body, trailer) = value.split_at(value.len() - TRAILER);
    let (header, mut payload) = body.split_at(header_len);
    let mut sum = ValueSum::new(CHECKSUM_SEED);
    sum.update(header);
    for part in parts.iter_mut() {
        let (from, rest) = payload.split_at(part.len());
        payload = rest;
        for (src, dst) in from.chunks(VERIFY_PIECE).zip(part.chunks_mut(VERIFY_PIECE)) {
            sum.update(src);
            dst.copy_from_slice(src);
        }
    }
    sum.finish().to_le_bytes()[..] == *trailer
}

/// The checksum of a value read in pieces (its header, the payload's slices), fed a
/// piece at a time as each arrives, so it reads bytes still in cache.
pub(crate) struct PieceSum(ValueSum);

impl PieceSum {
    pub(crate) fn new() -> Self {
        Self(ValueSum::new(CHECKSUM_SEED))
    }

    /// Adds the next piece of the value's body (everything before its trailer).
    pub(crate) fn update(&mut self, piece: &[u8]) {
        self.0.update(piece);
    }

    /// Whether `trailer` is the checksum of the pieces given.
    pub(crate) fn matches(&self, trailer: [u8; TRAILER]) -> bool {
        self.0.finish() == u64::from_le_bytes(trailer)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::tier::value::{encode, encoded_len, FIXED_HEADER};

    const FP: LayoutFingerprint = LayoutFingerprint(77);

    #[test]
    fn verified_scatter_copies_exactly_and_catches_every_piece_flipped() {
        // Longer than two copy pieces, cut into uneven parts across piece edges.
        let len = 2 * VERIFY_PIECE + 999;
        let b: Vec<u8> = (0..len as u32).map(|i| (i * 13 + 1) as u8).collect();
        let hash = [9u8; 16];
        let v = encode(FP, &hash, &[&b]);
        let header_len = FIXED_HEADER + hash.len();
        assert_eq!(v.len(), encoded_len(hash.len(), len));
        let mut out = vec![0u8; len];
        let (a, rest) = out.split_at_mut(5);
        let (c, d) = rest.split_at_mut(VERIFY_PIECE + 3);
        let mut parts: Vec<&mut [u8]> = vec![a, c, d];
        assert!(copy_verified_scatter(&v, header_len, &mut parts));
        let mut sum = PieceSum::new();
        sum.update(&v[..header_len]);
        for p in &parts {
            sum.update(p);
        }
        assert!(sum.matches(v[v.len() - 8..].try_into().unwrap()));
        assert_eq!(out, b);
        for i in [
            0,
            header_len - 1,
            header_len + 4,
            header_len + VERIFY_PIECE,
            v.len() - 1,
        ] {
            let mut c = v.clone();
            c[i] ^= 0x20;
            let mut out = vec![0u8; len];
            assert!(
                !copy_verified_scatter(&c, header_len, &mut [&mut out[..]]),
                "flip {i}"
            );
        }
        let mut short = vec![0u8; len - 1];
        assert!(!copy_verified_scatter(
            &v,
            header_len,
            &mut [&mut short[..]]
        ));
    }
}
