use proptest::prelude::*;

use super::known_answers::{bytes, KNOWN_ANSWERS, KNOWN_ANSWER_FILL};
use super::*;

/// Every kernel this CPU runs; the portable one first (the reference).
fn kernels() -> Vec<Kernel> {
    #[allow(unused_mut)] // Only x86_64 and aarch64 have more than one.
    let mut all = vec![Kernel::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        all.push(Kernel::Sse2);
        if std::arch::is_x86_feature_detected!("avx2") {
            all.push(Kernel::Avx2);
        }
    }
    #[cfg(all(
        target_arch = "aarch64",
        target_endian = "little",
        target_feature = "neon"
    ))]
    all.push(Kernel::Neon);
    all
}

fn sum_with(kernel: Kernel, seed: u64, parts: &[&[u8]]) -> u64 {
    let mut sum = ValueSum::with_kernel(seed, kernel);
    for part in parts {
        sum.update(part);
    }
    sum.finish()
}

#[test]
fn known_answers_pin_the_definition() {
    for (seed, len, expected) in KNOWN_ANSWERS {
        let data = bytes(len, KNOWN_ANSWER_FILL);
        for kernel in kernels() {
            assert_eq!(
                sum_with(kernel, seed, &[&data]),
                expected,
                "{kernel:?}, seed {seed:#x}, {len} bytes: {:#018x}",
                sum_with(kernel, seed, &[&data])
            );
        }
    }
}

#[test]
fn split_points_do_not_change_the_sum() {
    let data = bytes(2100, 7);
    let whole = value_sum(1, &[&data]);
    for kernel in kernels() {
        for cut in [0, 1, 7, 8, 63, 64, 65, 1023, 1024, 1025, 2099, 2100] {
            let (a, b) = data.split_at(cut);
            assert_eq!(
                sum_with(kernel, 1, &[a, b]),
                whole,
                "{kernel:?} cut at {cut}"
            );
        }
        let pieces: Vec<&[u8]> = data.chunks(37).collect();
        assert_eq!(sum_with(kernel, 1, &pieces), whole, "{kernel:?} in 37s");
    }
}

#[test]
fn every_single_byte_flip_and_truncation_changes_the_sum() {
    // Past two blocks, so flips land before and after a scramble and in the tail.
    let data = bytes(2 * 1024 + 97, 13);
    let base = value_sum(0, &[&data]);
    for i in 0..data.len() {
        for bit in [0x01, 0x80] {
            let mut d = data.clone();
            d[i] ^= bit;
            assert_ne!(value_sum(0, &[&d]), base, "flip {bit:#x} at {i}");
        }
    }
    for n in 0..data.len() {
        assert_ne!(value_sum(0, &[&data[..n]]), base, "truncated to {n}");
    }
    // Trailing zeros are not invisible: the length is part of the sum.
    let mut padded = data.clone();
    padded.push(0);
    assert_ne!(value_sum(0, &[&padded]), base);
    assert_ne!(value_sum(1, &[&data]), base, "the seed matters");
}

#[test]
fn swapped_stripes_change_the_sum() {
    let data = bytes(4096, 101);
    let base = value_sum(0, &[&data]);
    // Within a block (other keys) and across blocks (a scramble between).
    for (a, b) in [(0, 1), (0, 15), (3, 16), (16, 32), (0, 63)] {
        let mut d = data.clone();
        let (lo, hi) = d.split_at_mut(b * STRIPE);
        lo[a * STRIPE..(a + 1) * STRIPE].swap_with_slice(&mut hi[..STRIPE]);
        assert_ne!(value_sum(0, &[&d]), base, "stripes {a} and {b} swapped");
    }
}

proptest! {
    #[test]
    fn every_kernel_matches_the_portable_one(
        len in 0usize..5000,
        offset in 0usize..64,
        cuts in proptest::collection::vec(0usize..5000, 0..6),
        seed in any::<u64>(),
        fill in any::<u32>(),
    ) {
        // A buffer `offset` bytes into a larger one: every alignment of the loads.
        let backing = bytes(len + offset, fill | 1);
        let data = &backing[offset..];
        let whole = sum_with(Kernel::Portable, seed, &[data]);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(len)).collect();
        cuts.sort_unstable();
        let mut pieces = Vec::new();
        let mut at = 0;
        for c in cuts.into_iter().chain([len]) {
            pieces.push(&data[at..c]);
            at = c;
        }
        for kernel in kernels() {
            prop_assert_eq!(sum_with(kernel, seed, &[data]), whole, "{:?} whole", kernel);
            prop_assert_eq!(sum_with(kernel, seed, &pieces), whole, "{:?} in pieces", kernel);
        }
    }
}
