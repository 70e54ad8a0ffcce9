//! A 64-bit checksum for layout fingerprints, key digests and the disk index's entries
//! and header; stored values (format 2 on) use `value_sum`, which SIMD units run faster.
//!
//! This one stays as it is: it names remote keys (through the layout fingerprint) and
//! disk slots (through key digests), so a change would orphan every stored block, and it
//! only ever sums a few hundred bytes, where speed does not matter.
//!
//! It guards against accidents (a truncated or bit-flipped value, a value written by other
//! code under the same key), not against an adversary: who can write to the store can
//! write a valid value, so access control belongs to the store (ACL users, TLS).
//!
//! Four lanes take one 64-bit word each per round, so the loop runs at memory speed. Every
//! step `acc -> rotl((acc ^ word) * ODD, 31)` is a bijection of `acc` for a fixed word, and
//! so is the final fold of each lane, so two inputs of the same length that differ in one
//! word always get different sums; the length is mixed in, so truncation changes it too.

const PRIME: u64 = 0x9E37_79B9_7F4A_7C15;
const LANE_SEEDS: [u64; 4] = [
    0x243F_6A88_85A3_08D3,
    0x1319_8A2E_0370_7344,
    0xA409_3822_299F_31D0,
    0x082E_FA98_EC4E_6C89,
];

#[inline(always)]
fn round(acc: u64, word: u64) -> u64 {
    (acc ^ word).wrapping_mul(PRIME).rotate_left(31)
}

#[inline(always)]
fn word(bytes: &[u8]) -> u64 {
    let mut buf = [0u8; 8];
    buf[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(buf)
}

/// The checksum of `parts` read as one byte string, started from `seed`.
///
/// Parts are concatenated logically (no copy), so a header and a payload held in
/// different buffers are summed as the bytes they become on the wire.
pub(crate) fn checksum(seed: u64, parts: &[&[u8]]) -> u64 {
    let mut sum = Checksum::new(seed);
    for part in parts {
        sum.update(part);
    }
    sum.finish()
}

/// [`checksum`] fed a piece at a time, so a caller can sum bytes while they are in cache
/// for another reason (a copy) instead of in a pass of their own.
pub(crate) struct Checksum {
    seed: u64,
    lanes: [u64; 4],
    total: u64,
    carry: [u8; 32],
    carried: usize,
}

impl Checksum {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            seed,
            lanes: LANE_SEEDS.map(|s| s ^ seed),
            total: 0,
            carry: [0; 32],
            carried: 0,
        }
    }

    /// Adds the bytes of `part` after those given before.
    pub(crate) fn update(&mut self, part: &[u8]) {
        self.total = self.total.wrapping_add(part.len() as u64);
        let mut rest = part;
        if self.carried > 0 {
            let take = (32 - self.carried).min(rest.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&rest[..take]);
            self.carried += take;
            rest = &rest[take..];
            if self.carried < 32 {
                return;
            }
            block(&mut self.lanes, &self.carry);
        }
        let mut chunks = rest.chunks_exact(32);
        for c in &mut chunks {
            block(&mut self.lanes, c);
        }
        let tail = chunks.remainder();
        self.carry[..tail.len()].copy_from_slice(tail);
        self.carried = tail.len();
    }

    /// The checksum of every byte given.
    pub(crate) fn finish(&self) -> u64 {
        let mut lanes = self.lanes;
        for (i, w) in self.carry[..self.carried].chunks(8).enumerate() {
            lanes[i] = round(lanes[i], word(w));
        }
        let mut h = round(self.seed ^ PRIME, self.total);
        for lane in lanes {
            h = round(h, lane);
        }
        h ^ (h >> 29)
    }
}

// Inlined into the loops that call it: a call per 32 bytes would cost as much as the
// arithmetic.
#[inline(always)]
fn block(lanes: &mut [u64; 4], chunk: &[u8]) {
    for (lane, w) in lanes.iter_mut().zip(chunk.chunks_exact(8)) {
        *lane = round(*lane, word(w));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_points_do_not_change_the_sum() {
        let data: Vec<u8> = (0..200u32).map(|i| (i * 7 + 3) as u8).collect();
        let whole = checksum(1, &[&data]);
        for cut in [0, 1, 7, 8, 31, 32, 33, 100, 199, 200] {
            let (a, b) = data.split_at(cut);
            assert_eq!(checksum(1, &[a, b]), whole, "cut at {cut}");
        }
        assert_eq!(checksum(1, &[&data[..5], &data[5..9], &data[9..]]), whole);
    }

    #[test]
    fn every_single_byte_flip_and_truncation_changes_the_sum() {
        let data: Vec<u8> = (0..97u32).map(|i| (i * 13) as u8).collect();
        let base = checksum(0, &[&data]);
        for i in 0..data.len() {
            let mut d = data.clone();
            d[i] ^= 0x01;
            assert_ne!(checksum(0, &[&d]), base, "flip at {i}");
        }
        for n in 0..data.len() {
            assert_ne!(checksum(0, &[&data[..n]]), base, "truncated to {n}");
        }
        // Trailing zeros are not invisible: the length is part of the sum.
        let mut padded = data.clone();
        padded.push(0);
        assert_ne!(checksum(0, &[&padded]), base);
        assert_ne!(checksum(1, &[&data]), base, "the seed matters");
    }
}
