//! The value checksum's NEON kernel checked on aarch64: against the known answers and
//! against the portable kernel on every length to 5000 bytes, every alignment, split
//! points and a few MiB. `scripts/check_value_sum_aarch64.sh` builds it for aarch64 and
//! runs it (under `qemu-aarch64` on an x86_64 machine).
//!
//! It includes the crate's own files by `#[path]` (no copy of the kernel), so it checks
//! what the crate compiles. Exits 1 after the first few mismatches are printed.

#[path = "../crates/offload-core/src/tier/value_sum/known_answers.rs"]
mod known_answers;
#[path = "../crates/offload-core/src/tier/value_sum/mod.rs"]
mod value_sum;

use std::process::ExitCode;
use std::time::Instant;

use known_answers::{bytes, KNOWN_ANSWERS, KNOWN_ANSWER_FILL};
use value_sum::{Kernel, ValueSum};

/// Mismatches printed before the rest are only counted.
const SHOWN: usize = 10;

/// A deterministic source of seeds, fills and cut points (xorshift64*), so a failure
/// repeats run after run.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn fill(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Counts and reports mismatches.
#[derive(Debug, Default)]
struct Checks {
    run: usize,
    failed: usize,
}

impl Checks {
    fn expect(&mut self, got: u64, want: u64, what: impl FnOnce() -> String) {
        self.run += 1;
        if got != want {
            self.failed += 1;
            if self.failed <= SHOWN {
                eprintln!("MISMATCH {}: got {got:#018x}, want {want:#018x}", what());
            }
        }
    }
}

fn sum_with(kernel: Kernel, seed: u64, parts: &[&[u8]]) -> u64 {
    let mut sum = ValueSum::with_kernel(seed, kernel);
    for part in parts {
        sum.update(part);
    }
    sum.finish()
}

/// `data` cut at `cuts` (any order, clamped to its length).
fn pieces<'a>(data: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(data.len())).collect();
    cuts.sort_unstable();
    let mut out = Vec::with_capacity(cuts.len() + 1);
    let mut at = 0;
    for c in cuts.into_iter().chain([data.len()]) {
        out.push(&data[at..c]);
        at = c;
    }
    out
}

fn known_answers(checks: &mut Checks) {
    for (seed, len, want) in KNOWN_ANSWERS {
        let data = bytes(len, KNOWN_ANSWER_FILL);
        for kernel in [Kernel::Portable, Kernel::Neon] {
            checks.expect(sum_with(kernel, seed, &[&data]), want, || {
                format!("known answer, {kernel:?}, seed {seed:#x}, {len} bytes")
            });
        }
        let mut sum = ValueSum::new(seed);
        sum.update(&data);
        checks.expect(sum.finish(), want, || {
            format!("known answer, ValueSum::new, seed {seed:#x}, {len} bytes")
        });
    }
}

/// Every length to 5000 (4 blocks and a tail), each at its own alignment and seed, whole
/// and in random pieces.
fn every_length(checks: &mut Checks, rng: &mut Rng) {
    let backing = rng.fill(5000 + 64);
    for len in 0..=5000 {
        let offset = rng.below(64);
        let data = &backing[offset..offset + len];
        let seed = rng.next();
        let want = sum_with(Kernel::Portable, seed, &[data]);
        checks.expect(sum_with(Kernel::Neon, seed, &[data]), want, || {
            format!("{len} bytes at offset {offset}, whole")
        });
        let cuts: Vec<usize> = (0..rng.below(6)).map(|_| rng.below(len + 1)).collect();
        checks.expect(
            sum_with(Kernel::Neon, seed, &pieces(data, &cuts)),
            want,
            || format!("{len} bytes at offset {offset}, cut at {cuts:?}"),
        );
    }
}

/// Every alignment of the loads, on lengths around stripe and block ends.
fn every_alignment(checks: &mut Checks, rng: &mut Rng) {
    let backing = rng.fill(4200 + 64);
    for len in [1, 63, 64, 65, 1023, 1024, 1025, 2048, 4099, 4200] {
        for offset in 0..64 {
            let data = &backing[offset..offset + len];
            let want = sum_with(Kernel::Portable, 3, &[data]);
            checks.expect(sum_with(Kernel::Neon, 3, &[data]), want, || {
                format!("{len} bytes at offset {offset}")
            });
        }
    }
}

/// Every split point of 2100 bytes into two pieces, and pieces of every size to 70.
fn every_split(checks: &mut Checks, rng: &mut Rng) {
    let data = rng.fill(2100);
    let want = sum_with(Kernel::Portable, 1, &[&data]);
    for cut in 0..=data.len() {
        let (a, b) = data.split_at(cut);
        checks.expect(sum_with(Kernel::Neon, 1, &[a, b]), want, || {
            format!("2100 bytes cut at {cut}")
        });
    }
    for size in 1..=70 {
        let parts: Vec<&[u8]> = data.chunks(size).collect();
        checks.expect(sum_with(Kernel::Neon, 1, &parts), want, || {
            format!("2100 bytes in pieces of {size}")
        });
    }
}

/// A few MiB (thousands of scrambles), whole and in random pieces.
fn large(checks: &mut Checks, rng: &mut Rng) {
    for len in [1 << 20, (3 << 20) + 13, (4 << 20) - 1] {
        let data = rng.fill(len);
        let seed = rng.next();
        let want = sum_with(Kernel::Portable, seed, &[&data]);
        checks.expect(sum_with(Kernel::Neon, seed, &[&data]), want, || {
            format!("{len} bytes, whole")
        });
        let cuts: Vec<usize> = (0..16).map(|_| rng.below(len + 1)).collect();
        checks.expect(
            sum_with(Kernel::Neon, seed, &pieces(&data, &cuts)),
            want,
            || format!("{len} bytes, cut at {cuts:?}"),
        );
    }
}

/// Throughput of both kernels over 4 MiB. Under qemu this is the emulator's speed, which
/// says nothing about a real CPU's; printed so a run on real aarch64 hardware shows it.
fn timing(rng: &mut Rng) {
    let data = rng.fill(4 << 20);
    let figures: Vec<String> = [Kernel::Portable, Kernel::Neon]
        .into_iter()
        .map(|kernel| {
            let rounds = 8u64;
            let start = Instant::now();
            let mut fold = 0u64;
            for round in 0..rounds {
                fold ^= sum_with(kernel, round, &[&data]);
            }
            let gbps = (rounds as f64 * data.len() as f64) / start.elapsed().as_secs_f64() / 1e9;
            format!("{kernel:?} {gbps:.2} GB/s (fold {fold:#x})")
        })
        .collect();
    println!(
        "timing, 4 MiB x 8 (meaningless under qemu: the emulator's speed, not a CPU's): {}",
        figures.join("; ")
    );
}

fn main() -> ExitCode {
    let mut checks = Checks::default();
    let best = Kernel::best();
    println!("dispatch picks {best:?}");
    if best != Kernel::Neon {
        eprintln!("MISMATCH dispatch: Kernel::best() is {best:?}, not Neon");
        checks.failed += 1;
    }
    let mut rng = Rng(0x5EED_0F_AA_2C_4E_0DA5);
    known_answers(&mut checks);
    every_length(&mut checks, &mut rng);
    every_alignment(&mut checks, &mut rng);
    every_split(&mut checks, &mut rng);
    large(&mut checks, &mut rng);
    timing(&mut rng);
    println!("{} checks, {} mismatches", checks.run, checks.failed);
    if checks.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
