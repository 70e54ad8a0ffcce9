//! The sums that pin the definition, shared by the unit tests and the aarch64 harness
//! (`scripts/value_sum_aarch64_harness.rs` includes this file by `#[path]`), so every
//! kernel on every architecture is held to the same figures.

/// `(seed, length, sum)` of `bytes(length, KNOWN_ANSWER_FILL)`: the same figures as
/// `scripts/value_sum_reference.py`, an independent transcription of the module doc's
/// definition (`tests/test_value_sum.py` reads them here); a change here is a new value
/// format.
pub(super) const KNOWN_ANSWERS: [(u64, usize, u64); 6] = [
    (0, 0, 0x329f_2a2c_aabd_df51),
    (0, 1, 0x53d2_20dc_f764_ac03),
    (7, 63, 0x1bd3_a323_ad69_3fc9),
    (7, 64, 0x6b97_2b81_eed9_05ab),
    (0x4b56_4f46_5641_4c55, 1024, 0x5b95_d8b1_1d78_fa7b),
    (0x4b56_4f46_5641_4c55, 5000, 0x64bc_fb34_3372_290c),
];

/// The fill multiplier of the known answers' bytes (Knuth's, so every byte value shows up).
pub(super) const KNOWN_ANSWER_FILL: u32 = 2_654_435_761;

/// `n` test bytes, `(i * mul) >> 3` truncated to a byte for `i` in `0..n`.
pub(super) fn bytes(n: usize, mul: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(mul) >> 3) as u8)
        .collect()
}
