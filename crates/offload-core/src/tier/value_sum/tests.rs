use proptest::prelude::*;

use super::*;

/// Every kernel this CPU runs; the portable one first (the reference).
fn kernels() -> Vec<Kernel> {
    #[allow(unused_mut)] // Only x86_64 has more than one.
    let mut all = vec![Kernel::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        all.push(Kernel::Sse2);
        if std::arch::is_x86_feature_detected!("avx2") {
            all.push(Kernel::Avx2);
        }
    }
    all
}

fn sum_with(kernel: Kernel, seed: u64, parts: &[&[u8]]) -> u64 {
    let mut sum = ValueSum::with_kernel(seed, kernel);
    for part in parts {
        sum.update(part);
    }
    sum.finish()
}

fn bytes(n: usize, mul: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(mul) >> 3) as u8)
        .collect()
}

#[test]
fn known_answers_pin_the_definition() {
    // The same figures as `scripts/value_sum_reference.py`, an independent transcription
    // of the module doc's definition; a change here is a new value format.
    let cases: [(u64, usize, u64); 6] = [
        (0, 0, 0x329f_2a2c_aabd_df51),
        (0, 1, 0x53d2_20dc_f764_ac03),
        (7, 63, 0x1bd3_a323_ad69_3fc9),
        (7, 64, 0x6b97_2b81_eed9_05ab),
        (0x4b56_4f46_5641_4c55, 1024, 0x5b95_d8b1_1d78_fa7b),
        (0x4b56_4f46_5641_4c55, 5000, 0x64bc_fb34_3372_290c),
    ];
    for (seed, len, expected) in cases {
        let data = bytes(len, 2_654_435_761);
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
