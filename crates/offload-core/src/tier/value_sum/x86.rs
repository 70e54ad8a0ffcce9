//! The value checksum's stripe loop in SSE2 (every x86_64 CPU) and AVX2 (picked at run
//! time): the portable definition, 2 or 4 lanes per instruction.
//!
//! `_mm*_mul_epu32` multiplies the low 32 bits of each 64-bit lane into a 64-bit product,
//! which is the definition's `lo32(x) * hi32(x)` once `hi32(x)` is shifted down; the
//! `0x4E` shuffle swaps the two 64-bit words of each 128-bit half, which is the
//! definition's `acc[j ^ 1] += w`. Both kernels keep the accumulators in registers for a
//! whole call and store them once.

use std::arch::x86_64::{
    __m128i, __m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32, _mm256_set1_epi64x,
    _mm256_shuffle_epi32, _mm256_slli_epi64, _mm256_srli_epi64, _mm256_storeu_si256,
    _mm256_xor_si256, _mm_add_epi64, _mm_loadu_si128, _mm_mul_epu32, _mm_set1_epi64x,
    _mm_shuffle_epi32, _mm_slli_epi64, _mm_srli_epi64, _mm_storeu_si128, _mm_xor_si128,
};

use super::{Keys, Lanes, LANES, SCRAMBLE_PRIME, STRIPE, STRIPES_PER_BLOCK};

/// The SSE2 kernel (SSE2 is part of every x86_64 CPU).
pub(super) fn sse2_stripes(state: &mut Lanes, keys: &Keys, data: &[u8]) {
    // SAFETY: every pointer read or written below stays in bounds: `acc` and `keys` are
    // arrays of 8 and 24 words and the loads take 8 words from `keys` at `stripe + 0..8`
    // with `stripe < 16`; each stripe is a `chunks_exact` piece of 64 bytes. Unaligned
    // loads and stores (`loadu`, `storeu`) need no alignment.
    unsafe {
        let acc_ptr = state.acc.as_mut_ptr().cast::<__m128i>();
        let mut acc: [__m128i; LANES / 2] =
            std::array::from_fn(|i| _mm_loadu_si128(acc_ptr.add(i)));
        let prime = _mm_set1_epi64x(SCRAMBLE_PRIME as i64);
        for stripe in data.chunks_exact(STRIPE) {
            let key_ptr = keys.as_ptr().add(state.stripe).cast::<__m128i>();
            let data_ptr = stripe.as_ptr().cast::<__m128i>();
            for (i, a) in acc.iter_mut().enumerate() {
                let w = _mm_loadu_si128(data_ptr.add(i));
                let x = _mm_xor_si128(w, _mm_loadu_si128(key_ptr.add(i)));
                let product = _mm_mul_epu32(x, _mm_srli_epi64::<32>(x));
                let swapped = _mm_shuffle_epi32::<0x4E>(w);
                *a = _mm_add_epi64(*a, _mm_add_epi64(product, swapped));
            }
            state.stripe += 1;
            if state.stripe == STRIPES_PER_BLOCK {
                let key_ptr = keys.as_ptr().add(STRIPES_PER_BLOCK).cast::<__m128i>();
                for (i, a) in acc.iter_mut().enumerate() {
                    let s = _mm_xor_si128(*a, _mm_srli_epi64::<47>(*a));
                    let s = _mm_xor_si128(s, _mm_loadu_si128(key_ptr.add(i)));
                    let lo = _mm_mul_epu32(s, prime);
                    let hi = _mm_mul_epu32(_mm_srli_epi64::<32>(s), prime);
                    *a = _mm_add_epi64(lo, _mm_slli_epi64::<32>(hi));
                }
                state.stripe = 0;
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm_storeu_si128(acc_ptr.add(i), *a);
        }
    }
}

/// The AVX2 kernel.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn avx2_stripes(state: &mut Lanes, keys: &Keys, data: &[u8]) {
    // SAFETY: in bounds as in `sse2_stripes` (two 4-word loads per stripe and key window
    // instead of four 2-word ones); AVX2 is the caller's promise.
    unsafe {
        let acc_ptr = state.acc.as_mut_ptr().cast::<__m256i>();
        let mut acc: [__m256i; LANES / 4] = [
            _mm256_loadu_si256(acc_ptr),
            _mm256_loadu_si256(acc_ptr.add(1)),
        ];
        let prime = _mm256_set1_epi64x(SCRAMBLE_PRIME as i64);
        for stripe in data.chunks_exact(STRIPE) {
            let key_ptr = keys.as_ptr().add(state.stripe).cast::<__m256i>();
            let data_ptr = stripe.as_ptr().cast::<__m256i>();
            for (i, a) in acc.iter_mut().enumerate() {
                let w = _mm256_loadu_si256(data_ptr.add(i));
                let x = _mm256_xor_si256(w, _mm256_loadu_si256(key_ptr.add(i)));
                let product = _mm256_mul_epu32(x, _mm256_srli_epi64::<32>(x));
                let swapped = _mm256_shuffle_epi32::<0x4E>(w);
                *a = _mm256_add_epi64(*a, _mm256_add_epi64(product, swapped));
            }
            state.stripe += 1;
            if state.stripe == STRIPES_PER_BLOCK {
                let key_ptr = keys.as_ptr().add(STRIPES_PER_BLOCK).cast::<__m256i>();
                for (i, a) in acc.iter_mut().enumerate() {
                    let s = _mm256_xor_si256(*a, _mm256_srli_epi64::<47>(*a));
                    let s = _mm256_xor_si256(s, _mm256_loadu_si256(key_ptr.add(i)));
                    let lo = _mm256_mul_epu32(s, prime);
                    let hi = _mm256_mul_epu32(_mm256_srli_epi64::<32>(s), prime);
                    *a = _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi));
                }
                state.stripe = 0;
            }
        }
        _mm256_storeu_si256(acc_ptr, acc[0]);
        _mm256_storeu_si256(acc_ptr.add(1), acc[1]);
    }
}
