//! Fetching blocks straight into the caller's memory ([`RemoteStore::get_into`]): what a
//! fill asks for ([`BlockFill`]) and answers ([`Fill`]), the default that goes through
//! [`RemoteStore::get`].
//!
//! A CPU block is one slice per layer region, so a block's destination is several slices
//! that its payload fills in order; a store that can read into them (the disk tier) saves
//! the copy out of a value of its own.

use super::value::{decode, decode_verified, ValueError};
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
