//! The checksum in a stored value's trailer (value format 2): 8 lanes over 64-byte
//! stripes, built so SIMD units compute it at memory speed and every implementation
//! gives the same `u64` for the same bytes.
//!
//! Values persist across restarts (the disk tier) and are shared between machines (the
//! remote tier), so the sum is defined on bytes alone, never on the instruction set: the
//! portable code below is the reference, and the SIMD kernels are checked against it on
//! random lengths, alignments and splits: SSE2 and AVX2 on x86_64 (picked once at run
//! time), NEON on little-endian aarch64 (compiled where the target has the `neon`
//! feature, as every aarch64 Linux target does, so nothing to detect at run time;
//! big-endian or NEON-less aarch64 targets and other architectures run the portable
//! kernel).
//!
//! # How the NEON kernel is tested
//! `cargo test` runs on the build machine's CPU, an x86_64 one here, where the NEON kernel
//! is not even compiled. `scripts/check_value_sum_aarch64.sh` cross-compiles a harness
//! (`scripts/value_sum_aarch64_harness.rs`) that includes this module's own files by
//! `#[path]` with Debian 12's rustc 1.63 and its arm64 standard library, and runs it
//! under `qemu-aarch64`: the known answers (`known_answers.rs`), then NEON against the
//! portable kernel on every length to ~5000 bytes and a few MiB, every alignment and
//! split points. So this module's files (not the crate) must compile on Rust 1.63: no
//! `OnceLock` outside the x86_64 code, no `let ... else`, no newer std APIs (the harness
//! build fails if they appear).
//!
//! # Definition
//! - 24 keys `k[i]` come from the seed by splitmix64; 8 accumulators start at fixed odd
//!   constants.
//! - The input is read as 64-byte stripes of 8 little-endian words. Word `j` of the
//!   stripe at position `n` in its 1 KiB block (`n` in `0..16`) does, with
//!   `x = w ^ k[n + j]`: `acc[j ^ 1] += w` and `acc[j] += lo32(x) * hi32(x)` (a 32x32 ->
//!   64 multiply, which SSE2, AVX2 and NEON all have; XXH3's accumulate step).
//! - After each 16th stripe every lane is scrambled: `acc ^= acc >> 47; acc ^= k[16 + j];
//!   acc *= 0x9E3779B1`.
//! - The last partial stripe, if any, is padded with zeros and accumulated at its
//!   position (no scramble after it).
//! - Merge: `h = R(seed ^ P, length)`, then `h = R(h, acc[j])` for `j` in `0..8`, with
//!   `R(h, v) = rotl((h ^ v) * P, 31)`, then murmur3's `fmix64` avalanche.
//!
//! All arithmetic wraps mod 2^64.
//!
//! # What it detects
//! It guards against accidents (a truncated, bit-flipped, reordered or foreign value), not
//! an adversary: whoever can write to a store can write a valid value.
//! - Length: the byte count is the merge's first input and `R` is a bijection of `h` for a
//!   fixed lane and of the lane for a fixed `h`, so two inputs of different lengths with
//!   equal lanes never collide (zero padding of the last stripe is not invisible); when
//!   the lanes differ too (a truncation usually drops words), a collision is the ~2^-64
//!   case below, not excluded by construction.
//! - One changed word: the word is added raw into the neighbour lane `j ^ 1`, and every
//!   later step on a lane (adding terms that do not depend on the lane, the scramble: an
//!   xorshift, an xor and a multiply by an odd number) is a bijection of that lane, so lane
//!   `j ^ 1` ends different, always. The multiply term is not a bijection of the word
//!   (`lo32(x) * hi32(x)` loses information: e.g. any `x` with a zero half gives 0), so
//!   lane `j` may or may not end different. When only lane `j ^ 1` differs the merge (a
//!   chain of bijections in each lane) gives a different sum: detected with certainty.
//!   When both lanes differ, detection is not proven: it fails only if the two merge
//!   rounds collide, which for a well-mixed merge has probability about 2^-64.
//!   (Format 1's sum, one bijective round per lane and word, detected every one-word
//!   change with certainty; this one trades that certainty in the two-lane case for SIMD
//!   speed.)
//! - Anything else (several words, reordered stripes: positions in a block use different
//!   keys, and blocks are separated by the scramble, so order matters): a miss is not
//!   proven impossible; its probability is about 2^-64 per corrupted value.

#[cfg(all(
    target_arch = "aarch64",
    target_endian = "little",
    target_feature = "neon"
))]
mod aarch64;
#[cfg(test)]
mod known_answers;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Lanes, each one 64-bit word of a stripe.
const LANES: usize = 8;
/// Bytes read per accumulate step.
const STRIPE: usize = LANES * 8;
/// Stripes between two scrambles (a 1 KiB block).
const STRIPES_PER_BLOCK: usize = 16;
/// Keys: one per stripe position and lane (16 + 7 overlapping windows of 8), the last 8
/// also the scramble's.
const KEYS: usize = STRIPES_PER_BLOCK + LANES;
/// XXH3's 32-bit prime, the scramble's odd multiplier (32 bits, so a 32x32 multiply
/// computes the product's halves).
const SCRAMBLE_PRIME: u64 = 0x9E37_79B1;
/// The merge's odd multiplier.
const MERGE_PRIME: u64 = 0x9E37_79B9_7F4A_7C15;
/// Odd, distinct starting values (XXH3's), so no lane starts at zero.
const INIT: [u64; LANES] = [
    0xC2B2_AE3D,
    0x9E37_79B1_85EB_CA87,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0x85EB_CA77_C2B2_AE63,
    0x85EB_CA77,
    0x27D4_EB2F_1656_67C5,
    0x9E37_79B1,
];

/// Keys of a seed, for the kernels (unaligned loads of 8 words at any position `0..=16`).
type Keys = [u64; KEYS];

/// Which implementation sums the stripes. Every one gives the same result (tested).
///
/// `pub(super)`, like [`ValueSum::with_kernel`], only for the aarch64 harness, whose crate
/// root is this module's parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    /// The reference; where a SIMD kernel always runs (x86_64, little-endian aarch64 with
    /// NEON), only tests run it.
    #[cfg_attr(
        all(
            any(
                target_arch = "x86_64",
                all(
                    target_arch = "aarch64",
                    target_endian = "little",
                    target_feature = "neon"
                )
            ),
            not(test)
        ),
        allow(dead_code)
    )]
    Portable,
    #[cfg(target_arch = "x86_64")]
    Sse2,
    /// Only made by [`Kernel::detect`] after the CPU reported AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Compiled only for targets whose baseline has NEON (every aarch64 Linux target:
    /// Advanced SIMD is part of ARMv8-A), so every CPU the build runs on has it and
    /// nothing is detected.
    #[cfg(all(
        target_arch = "aarch64",
        target_endian = "little",
        target_feature = "neon"
    ))]
    Neon,
}

impl Kernel {
    /// The fastest kernel this CPU runs, decided once per process.
    pub(super) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            static BEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
            *BEST.get_or_init(Self::detect)
        }
        // Nothing to detect: a constant, and no `OnceLock` (the aarch64 harness builds
        // this file with Rust 1.63, which has none).
        #[cfg(not(target_arch = "x86_64"))]
        Self::detect()
    }

    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                return Self::Avx2;
            }
            Self::Sse2
        }
        #[cfg(all(
            target_arch = "aarch64",
            target_endian = "little",
            target_feature = "neon"
        ))]
        {
            Self::Neon
        }
        #[cfg(not(any(
            target_arch = "x86_64",
            all(
                target_arch = "aarch64",
                target_endian = "little",
                target_feature = "neon"
            )
        )))]
        Self::Portable
    }

    /// Sums the whole stripes of `data` (a multiple of [`STRIPE`] bytes).
    #[inline]
    fn stripes(self, state: &mut Lanes, keys: &Keys, data: &[u8]) {
        match self {
            Self::Portable => portable_stripes(state, keys, data),
            #[cfg(target_arch = "x86_64")]
            Self::Sse2 => x86::sse2_stripes(state, keys, data),
            // SAFETY: `Avx2` is only made by `detect`, after `is_x86_feature_detected!`
            // said this CPU has AVX2 (and tests make it only under the same check).
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => unsafe { x86::avx2_stripes(state, keys, data) },
            #[cfg(all(
                target_arch = "aarch64",
                target_endian = "little",
                target_feature = "neon"
            ))]
            Self::Neon => aarch64::neon_stripes(state, keys, data),
        }
    }
}

/// The accumulators and where the next stripe falls in its block.
#[derive(Debug, Clone, Copy)]
struct Lanes {
    acc: [u64; LANES],
    /// Position of the next stripe in its block, `0..16`.
    stripe: usize,
}

/// The value checksum of bytes given a piece at a time (pieces of any lengths, split
/// anywhere: the sum is that of their concatenation).
#[derive(Debug, Clone)]
pub(crate) struct ValueSum {
    seed: u64,
    keys: Keys,
    lanes: Lanes,
    total: u64,
    carry: [u8; STRIPE],
    carried: usize,
    kernel: Kernel,
}

impl ValueSum {
    pub(crate) fn new(seed: u64) -> Self {
        Self::with_kernel(seed, Kernel::best())
    }

    pub(super) fn with_kernel(seed: u64, kernel: Kernel) -> Self {
        let mut state = seed;
        Self {
            seed,
            keys: std::array::from_fn(|_| splitmix64(&mut state)),
            lanes: Lanes {
                acc: INIT,
                stripe: 0,
            },
            total: 0,
            carry: [0; STRIPE],
            carried: 0,
            kernel,
        }
    }

    /// Adds the bytes of `part` after those given before.
    pub(crate) fn update(&mut self, part: &[u8]) {
        self.total = self.total.wrapping_add(part.len() as u64);
        let mut rest = part;
        if self.carried > 0 {
            let take = (STRIPE - self.carried).min(rest.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&rest[..take]);
            self.carried += take;
            rest = &rest[take..];
            if self.carried < STRIPE {
                return;
            }
            self.kernel
                .stripes(&mut self.lanes, &self.keys, &self.carry);
            self.carried = 0;
        }
        let whole = rest.len() - rest.len() % STRIPE;
        let (stripes, tail) = rest.split_at(whole);
        self.kernel.stripes(&mut self.lanes, &self.keys, stripes);
        self.carry[..tail.len()].copy_from_slice(tail);
        self.carried = tail.len();
    }

    /// The checksum of every byte given.
    pub(crate) fn finish(&self) -> u64 {
        let mut lanes = self.lanes;
        if self.carried > 0 {
            let mut last = [0u8; STRIPE];
            last[..self.carried].copy_from_slice(&self.carry[..self.carried]);
            // One stripe: the portable kernel, so the tail never pays a dispatch.
            accumulate(&mut lanes.acc, &last, &self.keys[lanes.stripe..]);
        }
        let mut h = merge_round(self.seed ^ MERGE_PRIME, self.total);
        for lane in lanes.acc {
            h = merge_round(h, lane);
        }
        fmix64(h)
    }
}

/// The value checksum of `parts` read as one byte string, from `seed`.
#[cfg(test)]
pub(crate) fn value_sum(seed: u64, parts: &[&[u8]]) -> u64 {
    let mut sum = ValueSum::new(seed);
    for part in parts {
        sum.update(part);
    }
    sum.finish()
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A bijection of `h` for a fixed `v` and of `v` for a fixed `h`.
fn merge_round(h: u64, v: u64) -> u64 {
    (h ^ v).wrapping_mul(MERGE_PRIME).rotate_left(31)
}

/// murmur3's finalizer: a bijection that spreads every input bit over the output.
fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h ^= h >> 33;
    h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^ (h >> 33)
}

fn word(bytes: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(w)
}

/// One stripe (`stripe` holds at least 64 bytes, `keys` at least 8) into `acc`: the
/// definition's accumulate step.
#[inline(always)]
fn accumulate(acc: &mut [u64; LANES], stripe: &[u8], keys: &[u64]) {
    for j in 0..LANES {
        let w = word(stripe, 8 * j);
        let x = w ^ keys[j];
        acc[j ^ 1] = acc[j ^ 1].wrapping_add(w);
        acc[j] = acc[j].wrapping_add((x & 0xFFFF_FFFF).wrapping_mul(x >> 32));
    }
}

/// The definition's scramble, after every 16th stripe.
#[inline(always)]
fn scramble(acc: &mut [u64; LANES], keys: &Keys) {
    for (j, lane) in acc.iter_mut().enumerate() {
        let a = (*lane ^ (*lane >> 47)) ^ keys[STRIPES_PER_BLOCK + j];
        *lane = a.wrapping_mul(SCRAMBLE_PRIME);
    }
}

/// The reference kernel: whole stripes of `data`, scrambling at block ends.
fn portable_stripes(state: &mut Lanes, keys: &Keys, data: &[u8]) {
    for stripe in data.chunks_exact(STRIPE) {
        accumulate(&mut state.acc, stripe, &keys[state.stripe..]);
        state.stripe += 1;
        if state.stripe == STRIPES_PER_BLOCK {
            scramble(&mut state.acc, keys);
            state.stripe = 0;
        }
    }
}

#[cfg(test)]
mod tests;
