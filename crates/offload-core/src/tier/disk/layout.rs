//! What the tier's files hold: the geometry, the index file's header and its entries.
//!
//! A rank's file set is `<disk_path>.rank_<N>` (the data: one slot per block) and
//! `<...>.idx` (a 4 KiB header, then 128-byte entries). A slot holds exactly the block's
//! payload, nothing else, from a 4 KiB boundary: its size is the payload rounded up to
//! 4 KiB, so a 64 KiB block takes a 64 KiB slot and `O_DIRECT` reads and writes go
//! straight between the slot and the CPU block's slices. What says which block a slot
//! holds is an entry: the block's key digest and hash, the slot, and a checksum of the
//! payload bound to the key:
//!
//! ```text
//! 0   magic "KVDE"               4
//! 4   hash length (u16)          2   at most 64
//! 6   reserved                   2
//! 8   key digest (u128)          16
//! 24  payload length (u64)       8
//! 32  write sequence (u64)       8   orders writes: a rebuilt index keeps their order,
//!                                    and of two entries naming one slot the later wins
//! 40  payload checksum (u64)     8   `value_sum` of the payload, bound to the key digest
//! 48  block hash                 64  vLLM's hash (hash length bytes, then zeros), announced
//!                                    in KV events for blocks a restart recovered
//! 112 slot (u64)                 8   where the payload is in the data file
//! 120 entry checksum (u64)       8   over bytes 0..120
//! ```
//! The index file's header carries the layout fingerprint and the geometry, so a slot's
//! bytes need no header of their own. A block is written data first, entry second; a
//! crash between the two leaves an entry that names the old block over new bytes (or a
//! torn entry), and every read checks the payload against the entry's checksum, which
//! binds it to the key digest too (bytes of another block are a miss even where an
//! entry of theirs would be valid), so such a slot is a miss, never served.
//!
//! Entries are grouped in sets of [`MAX_WAYS`]: a key's entry lives in the set its digest
//! picks, so the scheduler (another process) finds a block by reading one set's entries,
//! without an index of its own. The entry names the slot, so where the payload goes is
//! not the key's to decide: the store writes each batch's blocks into consecutive slots
//! (`index.rs`), and a prompt's blocks, stored together, are read back together in a few
//! large I/Os instead of one small one each. There are half again as many entries as
//! slots ([`ENTRIES_PER_SLOT`]), so a set is rarely full while slots are free.

use super::super::checksum::checksum;
use super::super::value_sum::ValueSum;
use crate::tier::MAX_HASH_BYTES;

/// Slots start and end on this boundary (a page: what `O_DIRECT` asks of offsets on any
/// file system this runs on; the memory side is asked of the kernel, `file.rs`).
pub(crate) const ALIGN: u64 = 4096;
/// Bytes before the first entry of the index file.
pub(crate) const IDX_HEADER: u64 = 4096;
/// Bytes of one entry of the index file.
pub const ENTRY_BYTES: usize = 128;
/// Entries per set.
pub(crate) const MAX_WAYS: u64 = 64;
/// Entries per slot, as a fraction (3/2): a set holds 64 entries, a full tier about 43
/// of them on average, so a set runs out of entries (and evicts a block before the data
/// file is full) about once in a thousand sets, while an entry costs 128 bytes of the
/// capacity and 34 of host memory (`index.rs`).
pub(crate) const ENTRIES_PER_SLOT: (u64, u64) = (3, 2);

const FILE_MAGIC: &[u8; 8] = b"KVOFDISK";
/// 2: a digest's set is picked by a multiply-shift, not a remainder (a division costs as
/// much as the rest of an in-memory lookup). A version-1 file keeps its blocks in other
/// sets: its header no longer matches, so it is wiped at start, never read.
/// 3: the values in the slots are value format 2 (another checksum); a version-2 file
/// holds format-1 values this build would only fail one by one, counted as checksum
/// failures, so it is wiped at start instead. The file's own layout is unchanged.
/// 4: a slot holds only the block's payload, page-aligned (a value's header cost a whole
/// page per 64 KiB block and kept `O_DIRECT` from reading into the CPU block), and what
/// the header said moved into 128-byte entries. A version-3 file has other slot and
/// entry sizes: it is wiped at start, never read.
/// 5: entries name their slot, and there are more entries than slots (a batch's blocks
/// go to consecutive slots, wherever their keys' sets are). A version-4 file's entries
/// are their slots' by position: it is wiped at start, never read.
const FILE_VERSION: u32 = 5;
const ENTRY_MAGIC: &[u8; 4] = b"KVDE";
const ENTRY_SEED: u64 = 0x6b76_6469_736b_656e;
const DIGEST_SEEDS: [u64; 2] = [0x6469_736b_6b65_7931, 0x6469_736b_6b65_7932];
/// Seeds the payload's `value_sum`.
const PAYLOAD_SEED: u64 = 0x6b76_7061_796c_6f64;
/// Seeds the checksum that binds a payload's sum to its key digest.
const BIND_SEED: u64 = 0x6b76_6269_6e64_6b79;
/// Bytes of an entry its checksum covers.
const ENTRY_BODY: usize = ENTRY_BYTES - 8;
/// Bytes of the index header its checksum covers: magic, version, padding, five sizes,
/// the fingerprint.
const HEADER_BODY: usize = 8 + 4 + 4 + 5 * 8 + 16;

/// How a rank's capacity is cut into slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// Bytes of one block's payload (what a slot holds).
    pub block_bytes: u64,
    /// Bytes of one slot: `block_bytes` rounded up to [`ALIGN`].
    pub slot_bytes: u64,
    /// Slots in the data file (at most `u32::MAX`: the index keeps a slot in 32 bits).
    pub slots: u64,
    /// Entries in the index file: whole sets, about [`ENTRIES_PER_SLOT`] of `slots`.
    pub entries: u64,
    /// Entries per set.
    pub ways: u64,
    /// The layout fingerprint whose blocks the files hold.
    pub fingerprint: u128,
}

impl Geometry {
    /// The most slots of `block_bytes`-byte blocks that fit `capacity` with the index
    /// file (its header and entries); `None` when not one slot fits.
    pub(crate) fn fit(capacity: u64, block_bytes: u64, fingerprint: u128) -> Option<Self> {
        let slot_bytes = block_bytes.max(1).div_ceil(ALIGN).checked_mul(ALIGN)?;
        let (num, den) = ENTRIES_PER_SLOT;
        let per_slot = slot_bytes + ENTRY_BYTES as u64 * num / den;
        let mut slots = (capacity.checked_sub(IDX_HEADER)? / per_slot).min(u64::from(u32::MAX));
        // Rounding the entries up to whole sets takes up to a set's entries more than
        // `per_slot` counts: a few slots fewer make room.
        while slots > 0 {
            let wanted = (slots * num).div_ceil(den);
            let ways = wanted.min(MAX_WAYS);
            let entries = wanted.div_ceil(ways) * ways;
            let geo = Self {
                block_bytes,
                slot_bytes,
                slots,
                entries,
                ways,
                fingerprint,
            };
            if geo.data_file_bytes() + geo.idx_file_bytes() <= capacity {
                return Some(geo);
            }
            slots -= 1;
        }
        None
    }

    /// The capacity [`Self::fit`] cuts into exactly `slots` slots of `block_bytes`-byte
    /// blocks (`None` past `u32::MAX` slots or `u64` bytes).
    pub(crate) fn capacity_for(slots: u64, block_bytes: u64) -> Option<u64> {
        let slot_bytes = block_bytes.max(1).div_ceil(ALIGN).checked_mul(ALIGN)?;
        let (num, den) = ENTRIES_PER_SLOT;
        let wanted = slots.checked_mul(num)?.div_ceil(den);
        let entries = wanted.next_multiple_of(wanted.clamp(1, MAX_WAYS));
        (slots <= u64::from(u32::MAX))
            .then(|| {
                slots
                    .checked_mul(slot_bytes)?
                    .checked_add(entries.checked_mul(ENTRY_BYTES as u64)?)?
                    .checked_add(IDX_HEADER)
            })
            .flatten()
    }

    pub(crate) fn sets(&self) -> u64 {
        self.entries / self.ways
    }

    /// `digest`'s set: its high half scaled to `0..sets` (multiply, keep the high word).
    pub(crate) fn set_of(&self, digest: u128) -> u64 {
        // The high half, so set choice and the low half compared in the in-memory tags
        // are independent.
        ((u128::from((digest >> 64) as u64) * u128::from(self.sets())) >> 64) as u64
    }

    /// The first entry of `digest`'s set.
    pub(crate) fn set_start(&self, digest: u128) -> u64 {
        self.set_of(digest) * self.ways
    }

    pub(crate) fn data_offset(&self, slot: u64) -> u64 {
        slot * self.slot_bytes
    }

    pub(crate) fn entry_offset(&self, entry: u64) -> u64 {
        IDX_HEADER + entry * ENTRY_BYTES as u64
    }

    pub(crate) fn data_file_bytes(&self) -> u64 {
        self.slots * self.slot_bytes
    }

    pub(crate) fn idx_file_bytes(&self) -> u64 {
        IDX_HEADER + self.entries * ENTRY_BYTES as u64
    }

    /// The index file's header: geometry and fingerprint, so a restart (or the
    /// scheduler's reader) knows what the entries describe.
    pub(crate) fn encode_header(&self) -> Vec<u8> {
        let mut h = Vec::with_capacity(IDX_HEADER as usize);
        h.extend_from_slice(FILE_MAGIC);
        h.extend_from_slice(&FILE_VERSION.to_le_bytes());
        h.extend_from_slice(&[0; 4]);
        for n in [
            self.block_bytes,
            self.slot_bytes,
            self.slots,
            self.ways,
            self.entries,
        ] {
            h.extend_from_slice(&n.to_le_bytes());
        }
        h.extend_from_slice(&self.fingerprint.to_le_bytes());
        let sum = checksum(ENTRY_SEED, &[&h]);
        h.extend_from_slice(&sum.to_le_bytes());
        h.resize(IDX_HEADER as usize, 0);
        h
    }

    /// The geometry an index header describes, `None` unless it is intact.
    pub(crate) fn decode_header(h: &[u8]) -> Option<Self> {
        if h.len() < HEADER_BODY + 8 || &h[..8] != FILE_MAGIC {
            return None;
        }
        if u32::from_le_bytes(h[8..12].try_into().ok()?) != FILE_VERSION {
            return None;
        }
        if u64::from_le_bytes(h[HEADER_BODY..HEADER_BODY + 8].try_into().ok()?)
            != checksum(ENTRY_SEED, &[&h[..HEADER_BODY]])
        {
            return None;
        }
        let n =
            |i: usize| u64::from_le_bytes(h[16 + 8 * i..24 + 8 * i].try_into().unwrap_or([0; 8]));
        let geo = Self {
            block_bytes: n(0),
            slot_bytes: n(1),
            slots: n(2),
            ways: n(3),
            entries: n(4),
            fingerprint: u128::from_le_bytes(h[56..72].try_into().ok()?),
        };
        (geo.ways > 0
            && geo.entries % geo.ways == 0
            && geo.slots <= u64::from(u32::MAX)
            && geo.slot_bytes >= geo.block_bytes
            && geo.slot_bytes % ALIGN == 0)
            .then_some(geo)
    }
}

/// A 128-bit digest of a key: what entries and the in-memory index store.
pub(crate) fn key_digest(key: &[u8]) -> u128 {
    let lo = checksum(DIGEST_SEEDS[0], &[key]);
    let hi = checksum(DIGEST_SEEDS[1], &[key]);
    // Zero marks an empty slot in memory; no key may digest to it.
    (u128::from(hi) << 64 | u128::from(lo)).max(1)
}

/// The checksum an entry keeps of its slot's payload, summed a piece at a time as the
/// pieces are written or arrive: the payload's `value_sum`, then bound to the key digest,
/// so the bytes of one block under another block's entry never match.
pub(crate) struct PayloadSum {
    sum: ValueSum,
    digest: u128,
}

impl PayloadSum {
    /// The sum of the payload of the block whose key digests to `digest`.
    pub(crate) fn new(digest: u128) -> Self {
        Self {
            sum: ValueSum::new(PAYLOAD_SEED),
            digest,
        }
    }

    /// Adds the payload's next bytes.
    pub(crate) fn update(&mut self, piece: &[u8]) {
        self.sum.update(piece);
    }

    /// Adds `parts` in order: a block's slices after an `O_DIRECT` transfer, which leaves
    /// nothing in cache to sum on the way.
    pub(crate) fn update_all<P: AsRef<[u8]>>(&mut self, parts: &[P]) {
        for p in parts {
            self.sum.update(p.as_ref());
        }
    }

    /// The sum of the pieces given, bound to the key digest.
    pub(crate) fn finish(&self) -> u64 {
        let payload = self.sum.finish().to_le_bytes();
        checksum(BIND_SEED, &[&payload, &self.digest.to_le_bytes()])
    }
}

/// One entry as stored: which block a slot holds and what its payload sums to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub digest: u128,
    pub slot: u64,
    pub payload_len: u64,
    pub seq: u64,
    pub payload_sum: u64,
    hash: [u8; MAX_HASH_BYTES],
    hash_len: u8,
}

impl Entry {
    /// The entry of block `hash` (cut to [`MAX_HASH_BYTES`]) under key digest `digest`,
    /// its payload in slot `slot`.
    pub(crate) fn new(
        digest: u128,
        slot: u64,
        payload_len: u64,
        seq: u64,
        payload_sum: u64,
        hash: &[u8],
    ) -> Self {
        let hash = &hash[..hash.len().min(MAX_HASH_BYTES)];
        let mut h = [0u8; MAX_HASH_BYTES];
        h[..hash.len()].copy_from_slice(hash);
        Self {
            digest,
            slot,
            payload_len,
            seq,
            payload_sum,
            hash: h,
            // At most MAX_HASH_BYTES (64), so it fits.
            hash_len: hash.len() as u8,
        }
    }

    /// The block's hash, as vLLM gave it.
    pub(crate) fn hash(&self) -> &[u8] {
        &self.hash[..usize::from(self.hash_len)]
    }

    pub(crate) fn encode(&self) -> [u8; ENTRY_BYTES] {
        let mut e = [0u8; ENTRY_BYTES];
        e[..4].copy_from_slice(ENTRY_MAGIC);
        e[4..6].copy_from_slice(&u16::from(self.hash_len).to_le_bytes());
        e[8..24].copy_from_slice(&self.digest.to_le_bytes());
        e[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        e[32..40].copy_from_slice(&self.seq.to_le_bytes());
        e[40..48].copy_from_slice(&self.payload_sum.to_le_bytes());
        e[48..48 + MAX_HASH_BYTES].copy_from_slice(&self.hash);
        e[112..120].copy_from_slice(&self.slot.to_le_bytes());
        let sum = checksum(ENTRY_SEED, &[&e[..ENTRY_BODY]]);
        e[ENTRY_BODY..].copy_from_slice(&sum.to_le_bytes());
        e
    }

    /// The entry in `e`, `None` for an empty, torn or foreign one.
    pub(crate) fn decode(e: &[u8]) -> Option<Self> {
        if e.len() < ENTRY_BYTES || &e[..4] != ENTRY_MAGIC {
            return None;
        }
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(e[r].try_into().unwrap_or([0; 8]));
        if u(ENTRY_BODY..ENTRY_BYTES) != checksum(ENTRY_SEED, &[&e[..ENTRY_BODY]]) {
            return None;
        }
        let hash_len = u16::from_le_bytes([e[4], e[5]]);
        let hash_len = u8::try_from(hash_len)
            .ok()
            .filter(|&n| usize::from(n) <= MAX_HASH_BYTES)?;
        let mut hash = [0u8; MAX_HASH_BYTES];
        hash.copy_from_slice(&e[48..48 + MAX_HASH_BYTES]);
        Some(Self {
            digest: u128::from_le_bytes(e[8..24].try_into().ok()?),
            slot: u(112..120),
            payload_len: u(24..32),
            seq: u(32..40),
            payload_sum: u(40..48),
            hash,
            hash_len,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn geometry_never_exceeds_capacity() {
        for (cap, len) in [
            (1 << 20, 5000u64),
            (10 << 20, 4096),
            (300_000, 1000),
            (64 << 20, 70_000),
        ] {
            let g = Geometry::fit(cap, len, 9).unwrap();
            assert!(
                g.data_file_bytes() + g.idx_file_bytes() <= cap,
                "{cap} {len}"
            );
            assert_eq!(g.entries % g.ways, 0);
            assert!(g.entries * 2 >= g.slots * 3, "{g:?}");
            assert_eq!(g.slot_bytes % ALIGN, 0);
            assert_eq!(Geometry::decode_header(&g.encode_header()), Some(g));
        }
        assert!(Geometry::fit(4096, 100, 0).is_none());
    }

    #[test]
    fn capacity_for_gives_exactly_the_slots_asked_for() {
        for slots in [1u64, 2, 4, 7, 42, 43, 64, 100, 1000, 12_345] {
            for block in [1u64, 4000, 4096, 5003, 64 << 10, 2 << 20] {
                let cap = Geometry::capacity_for(slots, block).unwrap();
                assert_eq!(Geometry::fit(cap, block, 0).map(|g| g.slots), Some(slots));
                assert_ne!(
                    Geometry::fit(cap - 1, block, 0).map(|g| g.slots),
                    Some(slots),
                    "{slots} {block}: the least capacity"
                );
            }
        }
        assert_eq!(Geometry::capacity_for(u64::from(u32::MAX) + 1, 4096), None);
    }

    #[test]
    fn a_header_of_another_file_version_is_not_this_geometry() {
        let g = Geometry::fit(10 << 20, 4096, 9).unwrap();
        assert_eq!(Geometry::decode_header(&g.encode_header()), Some(g));
        // Every older version (3: whole values in the slots, 64-byte entries) is wiped.
        for version in 1..FILE_VERSION {
            let mut h = g.encode_header();
            h[8..12].copy_from_slice(&version.to_le_bytes());
            // Re-summed, so only the version differs from a valid header.
            let sum = checksum(ENTRY_SEED, &[&h[..HEADER_BODY]]);
            h[HEADER_BODY..HEADER_BODY + 8].copy_from_slice(&sum.to_le_bytes());
            assert_eq!(Geometry::decode_header(&h), None, "version {version}");
        }
    }

    #[test]
    fn a_slot_is_the_block_rounded_up_to_a_page() {
        for (block, slot) in [
            (64 << 10, 64 << 10),
            (2 << 20, 2 << 20),
            (5003, 8192),
            (1, 4096),
        ] {
            let g = Geometry::fit(1 << 30, block, 0).unwrap();
            assert_eq!(g.slot_bytes, slot, "{block}");
        }
        // A 64 KiB block costs its slot and one and a half entries, nothing more.
        let g = Geometry::fit(
            IDX_HEADER + 128 * ((64 << 10) + ENTRY_BYTES as u64 * 3 / 2),
            64 << 10,
            0,
        );
        assert_eq!(
            g.map(|g| (g.slots, g.entries, g.ways)),
            Some((128, 192, 64))
        );
    }

    #[test]
    fn a_payload_sum_is_bound_to_its_key_and_not_to_how_it_is_cut() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let sum = |digest: u128, cuts: &[usize]| {
            let mut s = PayloadSum::new(digest);
            let mut at = 0;
            for &c in cuts.iter().chain([&bytes.len()]) {
                s.update(&bytes[at..c]);
                at = c;
            }
            s.finish()
        };
        assert_eq!(sum(5, &[]), sum(5, &[1, 4096, 4097]));
        assert_ne!(sum(5, &[]), sum(6, &[]));
        assert_ne!(sum(5, &[]), sum(5 | 1 << 64, &[]));
    }

    #[test]
    fn sets_spread_over_the_whole_range() {
        let g = Geometry::fit(4096 + 426 * (4096 + ENTRY_BYTES as u64 * 3 / 2), 4096, 0).unwrap();
        assert_eq!(g.sets(), 10);
        let mut seen = [false; 10];
        for i in 0..1000u64 {
            let d = u128::from(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) << 64;
            seen[g.set_of(d) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(g.set_of(u128::MAX), 9);
    }

    #[test]
    fn entries_round_trip_and_any_flip_is_rejected() {
        let e = Entry::new(77, 41, 5000, 3, 0xdead, &[0xa5; 32]);
        let b = e.encode();
        assert_eq!(Entry::decode(&b), Some(e));
        assert_eq!(Entry::decode(&b).unwrap().hash(), &[0xa5; 32]);
        for i in 0..ENTRY_BYTES {
            let mut c = b;
            c[i] ^= 1;
            assert_eq!(Entry::decode(&c), None, "flip at {i}");
        }
        assert_eq!(Entry::decode(&[0; ENTRY_BYTES]), None);
    }
}
