//! Transfer engine benchmarks: end-to-end job cost per block with the host backend, the
//! engine's own overhead (a backend that copies nothing), and the coalescer alone.
//!
//! Each engine bench submits one job and waits for its completion, so the figure includes
//! the channel hop to the copy thread, validation, coalescing, the copies and the
//! completion hop back. Besides criterion's report, a `ns/block` line is printed per case.
// criterion's macros generate undocumented public items.
#![allow(missing_docs)]

use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use offload_core::transfer::{
    coalesce, BackendError, CopyBackend, CopyRun, Direction, RegionSpec, Ticket, TransferConfig,
    TransferEngine, TransferJob,
};

/// Two regions (a K and a V tensor) of 4 KiB blocks: 64 MiB of "device" buffers and 64 MiB
/// of host memory, comfortably under CI memory limits.
const BLOCK_BYTES: usize = 4096;
const NUM_REGIONS: usize = 2;
const NUM_BLOCKS: u32 = 8192;
const SIZES: [usize; 4] = [1, 16, 256, 4096];

/// A backend that copies nothing, to isolate the engine's own cost.
#[derive(Debug, Default)]
struct NullBackend(u64);

impl CopyBackend for NullBackend {
    fn name(&self) -> &'static str {
        "null"
    }

    unsafe fn submit(&mut self, _: Direction, runs: &[CopyRun]) -> Result<Ticket, BackendError> {
        self.0 += runs.len() as u64;
        Ok(Ticket(self.0))
    }

    fn query(&mut self, _: Ticket) -> Result<bool, BackendError> {
        Ok(true)
    }
}

/// Device stand-ins, kept alive (and never otherwise touched) while the engines exist.
struct Buffers(Vec<Box<[u8]>>);

impl Buffers {
    fn new() -> Self {
        Self(
            (0..NUM_REGIONS)
                .map(|r| vec![r as u8 + 1; NUM_BLOCKS as usize * BLOCK_BYTES].into_boxed_slice())
                .collect(),
        )
    }

    fn regions(&mut self) -> Vec<RegionSpec> {
        self.0
            .iter_mut()
            .map(|buf| {
                // SAFETY: each buffer holds NUM_BLOCKS blocks of BLOCK_BYTES, outlives every
                // engine (dropped last in `main`'s benches) and is not accessed by the bench
                // while jobs run.
                unsafe {
                    RegionSpec::new(
                        buf.as_mut_ptr() as u64,
                        NUM_BLOCKS,
                        BLOCK_BYTES,
                        BLOCK_BYTES,
                    )
                }
                .expect("valid region")
            })
            .collect()
    }
}

/// `n` pairs with no two consecutive on either side, so nothing coalesces.
fn scattered(n: usize) -> Vec<(u32, u32)> {
    (0..n as u32)
        .map(|i| (2 * i, 2 * ((i * 1031) % n as u32)))
        .collect()
}

/// `n` pairs forming one run: one copy per region.
fn consecutive(n: usize) -> Vec<(u32, u32)> {
    (0..n as u32).map(|i| (i, i + 7)).collect()
}

/// Median of per-iteration samples, or NaN when criterion took none.
fn median(samples: Mutex<Vec<f64>>) -> f64 {
    let mut samples = samples.into_inner().expect("samples");
    samples.sort_by(f64::total_cmp);
    samples.get(samples.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Runs one job per iteration; criterion measures the round trip (submit to completion).
/// The caller-side cost of `submit` alone (what the Python step pays) is sampled too, and
/// both are printed as ns per block.
fn bench_jobs(
    c: &mut Criterion,
    group_name: &str,
    engine: &TransferEngine,
    cases: &[(&str, Vec<(u32, u32)>)],
) {
    let mut group = c.benchmark_group(group_name);
    let mut next_id = 0u64;
    for (label, pairs) in cases {
        let blocks = pairs.len();
        group.throughput(Throughput::Elements(blocks as u64));
        let round_trips = Mutex::new(Vec::new());
        let submits = Mutex::new(Vec::new());
        group.bench_with_input(BenchmarkId::new(*label, blocks), pairs, |b, pairs| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut submit_total = Duration::ZERO;
                for _ in 0..iters {
                    next_id += 1;
                    let job = TransferJob::new(next_id, Direction::Store, pairs.clone());
                    let start = Instant::now();
                    engine.submit(job).expect("submit");
                    submit_total += start.elapsed();
                    let done = engine
                        .wait_for(&[next_id], Duration::from_secs(60))
                        .expect("completion");
                    total += start.elapsed();
                    assert!(done[0].result.is_ok());
                }
                let per_block = |d: Duration| d.as_nanos() as f64 / iters as f64 / blocks as f64;
                round_trips.lock().expect("samples").push(per_block(total));
                submits
                    .lock()
                    .expect("samples")
                    .push(per_block(submit_total));
                total
            });
        });
        println!(
            "{group_name}/{label}/{blocks}: round trip {:.1} ns/block, submit {:.1} ns/block",
            median(round_trips),
            median(submits)
        );
    }
    group.finish();
}

fn cases() -> Vec<(&'static str, Vec<(u32, u32)>)> {
    let mut cases: Vec<_> = SIZES.iter().map(|&n| ("scattered", scattered(n))).collect();
    cases.extend(SIZES[1..].iter().map(|&n| ("consecutive", consecutive(n))));
    cases
}

fn config() -> TransferConfig {
    TransferConfig::default()
}

fn engine_benches(c: &mut Criterion) {
    let mut buffers = Buffers::new();
    let cases = cases();
    {
        let engine = TransferEngine::new(buffers.regions(), NUM_BLOCKS, config()).expect("engine");
        bench_jobs(c, "transfer_host", &engine, &cases);
    }
    {
        let engine = TransferEngine::with_backend(
            buffers.regions(),
            NUM_BLOCKS,
            config(),
            NullBackend::default(),
        )
        .expect("engine");
        bench_jobs(c, "transfer_overhead", &engine, &cases);
    }
    drop(buffers);
}

fn coalesce_bench(c: &mut Criterion) {
    let mut buffers = Buffers::new();
    let regions = buffers.regions();
    let mut group = c.benchmark_group("coalesce");
    for (label, pairs) in [
        ("scattered", scattered(4096)),
        ("consecutive", consecutive(4096)),
    ] {
        group.throughput(Throughput::Elements(pairs.len() as u64));
        let mut runs = Vec::with_capacity(pairs.len());
        let samples = Mutex::new(Vec::new());
        group.bench_function(BenchmarkId::new(label, pairs.len()), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    runs.clear();
                    coalesce(
                        &regions[0],
                        0x1000,
                        Direction::Store,
                        std::hint::black_box(&pairs),
                        &mut runs,
                    );
                    std::hint::black_box(&runs);
                }
                let total = start.elapsed();
                let per_pair = total.as_nanos() as f64 / iters as f64 / pairs.len() as f64;
                samples.lock().expect("samples").push(per_pair);
                total
            });
        });
        println!(
            "coalesce/{label}/{}: {:.2} ns/pair",
            pairs.len(),
            median(samples)
        );
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = engine_benches, coalesce_bench
}
criterion_main!(benches);
