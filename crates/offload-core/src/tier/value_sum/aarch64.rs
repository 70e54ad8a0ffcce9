//! The value checksum's stripe loop in NEON (little-endian aarch64 with NEON): the
//! portable definition, 2 lanes per 128-bit register, the 8 lanes in 4 registers kept
//! there for a whole call and stored once.
//!
//! - `acc[j] += lo32(x) * hi32(x)`: `UZP1`/`UZP2` on two registers' 32-bit halves gather
//!   the low and the high halves of their 4 words, then `UMLAL`/`UMLAL2` (32x32 -> 64
//!   multiply-accumulate) add each product into its lane: 4 instructions for 4 words.
//!   (XXH3's NEON kernel does the same.)
//! - `acc[j ^ 1] += w`: `EXT #8` swaps a register's two words, then one `ADD`.
//! - The scramble's multiply by the 32-bit prime `p`: `acc * p = lo32(acc) * p +
//!   (hi32(acc) * p << 32)` mod 2^64. A 32-bit `MUL` by the halves `[0, p]` gives the
//!   second term (its low 32 bits land in the word's high half, the rest is shifted out)
//!   and `UMLAL` by `p` adds the first.
//!
//! Words are loaded as bytes (`LD1 {.16b}`), so no alignment is assumed, and reinterpreted
//! as two little-endian words, which is what they are on a little-endian target only
//! (`mod.rs` compiles this file for no other).

use std::arch::aarch64::{
    uint64x2_t, vaddq_u64, vdup_n_u32, vdupq_n_u64, veorq_u64, vextq_u64, vget_low_u32, vld1q_u64,
    vld1q_u8, vmlal_high_u32, vmlal_u32, vmovn_u64, vmulq_u32, vreinterpretq_u32_u64,
    vreinterpretq_u64_u32, vreinterpretq_u64_u8, vshrq_n_u64, vst1q_u64, vuzp1q_u32, vuzp2q_u32,
};

use super::{Keys, Lanes, LANES, SCRAMBLE_PRIME, STRIPE, STRIPES_PER_BLOCK};

/// Words per NEON register.
const WORDS: usize = 2;

/// The NEON kernel (`mod.rs` compiles this file only where the target's baseline has
/// NEON, so there is nothing for the caller to promise).
pub(super) fn neon_stripes(state: &mut Lanes, keys: &Keys, data: &[u8]) {
    // SAFETY: the intrinsics need NEON, which the target's baseline has (this module is
    // compiled only under `cfg(target_feature = "neon")`). Every pointer read or written
    // stays in bounds: `acc` is an array of 8 words, read and written as 4 pairs; `keys`
    // holds 24 words and the loads take pairs at `stripe + 0..8` with `stripe < 16` and at
    // `16 + 0..8`; each stripe is a `chunks_exact` piece of 64 bytes, read as 4 loads of 16
    // bytes. `u64` loads and stores go through `&[u64]` pointers (aligned); the data is
    // loaded as bytes, which needs no alignment.
    unsafe {
        let acc_ptr = state.acc.as_mut_ptr();
        let mut acc: [uint64x2_t; LANES / WORDS] =
            std::array::from_fn(|i| vld1q_u64(acc_ptr.add(WORDS * i)));
        let prime = vdup_n_u32(SCRAMBLE_PRIME as u32);
        let prime_high_halves = vreinterpretq_u32_u64(vdupq_n_u64(SCRAMBLE_PRIME << 32));
        for stripe in data.chunks_exact(STRIPE) {
            let key_ptr = keys.as_ptr().add(state.stripe);
            let data_ptr = stripe.as_ptr();
            // Two registers (4 words) at a time, for `UZP1`/`UZP2`.
            for pair in 0..LANES / (2 * WORDS) {
                let first = 2 * pair;
                let second = first + 1;
                let w0 = vreinterpretq_u64_u8(vld1q_u8(data_ptr.add(16 * first)));
                let w1 = vreinterpretq_u64_u8(vld1q_u8(data_ptr.add(16 * second)));
                let x0 =
                    vreinterpretq_u32_u64(veorq_u64(w0, vld1q_u64(key_ptr.add(WORDS * first))));
                let x1 =
                    vreinterpretq_u32_u64(veorq_u64(w1, vld1q_u64(key_ptr.add(WORDS * second))));
                // The low halves of x0's and x1's words, then their high halves.
                let lo = vuzp1q_u32(x0, x1);
                let hi = vuzp2q_u32(x0, x1);
                let a0 = vmlal_u32(acc[first], vget_low_u32(lo), vget_low_u32(hi));
                let a1 = vmlal_high_u32(acc[second], lo, hi);
                acc[first] = vaddq_u64(a0, vextq_u64::<1>(w0, w0));
                acc[second] = vaddq_u64(a1, vextq_u64::<1>(w1, w1));
            }
            state.stripe += 1;
            if state.stripe == STRIPES_PER_BLOCK {
                let key_ptr = keys.as_ptr().add(STRIPES_PER_BLOCK);
                for (i, a) in acc.iter_mut().enumerate() {
                    let s = veorq_u64(*a, vshrq_n_u64::<47>(*a));
                    let s = veorq_u64(s, vld1q_u64(key_ptr.add(WORDS * i)));
                    let high_term = vreinterpretq_u64_u32(vmulq_u32(
                        vreinterpretq_u32_u64(s),
                        prime_high_halves,
                    ));
                    *a = vmlal_u32(high_term, vmovn_u64(s), prime);
                }
                state.stripe = 0;
            }
        }
        for (i, a) in acc.iter().enumerate() {
            vst1q_u64(acc_ptr.add(WORDS * i), *a);
        }
    }
}
