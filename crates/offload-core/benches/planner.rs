//! Planner benchmarks: the scheduler-side cost per engine step and per block moved.
//!
//! - `planner/decode_step/N`: one engine step of N running requests decoding one token
//!   each (16-token blocks, eager mode, requests staggered so N/16 blocks fill per step):
//!   new hashes handed over as blocks fill, `note_scheduled` for every request,
//!   `take_step`, and the completion of the previous step's store. Criterion's time is
//!   per step; its throughput is requests per second.
//! - `planner/store/128`: one request's 128 confirmed blocks selected, reserved (evicting,
//!   the pool is full), handed out, completed and published; throughput = blocks/s.
//! - `planner/store_lazy/128`: the same through `select_lazy` (lazy mode).
//! - `planner/load/128`: a 128-block prefix hit: `lookup` (pins), `on_alloc`,
//!   `take_step`, `complete` (unpins); throughput = blocks/s.
//!
//! The CPU pool has 48,505 blocks (the scheduler comparison's) and starts full, so every
//! store evicts. Run: `cargo bench -p offload-core --bench planner`.
// criterion's macros generate undocumented public items.
#![allow(missing_docs)]

mod common;

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::Rng;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use offload_core::{BlockHash, BlockKey, Planner, PlannerConfig, TransferId};

const BS: usize = 16;
const CPU_BLOCKS: u32 = 48_505;
/// Prompt tokens of each decoding request (stored before timing starts).
const PROMPT: usize = 512;
const RUNNING: [usize; 3] = [64, 256, 1024];
const BLOCKS: usize = 128;

fn planner(lazy: bool) -> Planner {
    Planner::new(PlannerConfig {
        block_size: BS as u32,
        num_cpu_blocks: CPU_BLOCKS,
        world_size: 1,
        lazy,
        events: false,
        sync_loads: false,
    })
}

/// Fills the whole CPU pool with published blocks of one finished request, so the
/// benchmarks run in the steady state where every store evicts.
fn fill(p: &mut Planner, rng: &mut Rng) {
    let n = CPU_BLOCKS as usize;
    let gpu: Vec<u32> = (0..n as u32).collect();
    p.extend_hashes("fill", rng.hashes(n));
    p.note_scheduled("fill", 0, &gpu, true).expect("schedule");
    p.note_scheduled("fill", n * BS, &[], false)
        .expect("schedule");
    let store = p.take_step().store.expect("a store");
    assert_eq!(store.gpu_blocks.len(), n);
    p.complete(store.id, true).expect("complete");
    p.request_finished("fill", n * BS).expect("finish");
    p.take_completions();
    assert_eq!(p.cache().num_evictable(), n);
}

/// Median of per-iteration samples.
fn report(name: &str, unit: &str, samples: Mutex<Vec<f64>>) {
    let mut s = samples.into_inner().expect("samples");
    s.sort_by(f64::total_cmp);
    if let Some(v) = s.get(s.len() / 2) {
        println!("{name}: {v:.3} {unit}");
    }
}

struct Running {
    id: String,
    /// Tokens computed before the step being scheduled.
    computed: usize,
    /// GPU blocks in its block table.
    blocks: usize,
}

/// N requests decoding, one token per step each.
struct Decode {
    planner: Planner,
    reqs: Vec<Running>,
    rng: Rng,
    next_gpu: u32,
    in_flight: Option<TransferId>,
    new_hashes: Vec<BlockHash>,
}

impl Decode {
    fn new(n: usize) -> Self {
        let mut rng = Rng(n as u64);
        let mut planner = planner(false);
        fill(&mut planner, &mut rng);
        let mut next_gpu = 0u32;
        let mut reqs = Vec::with_capacity(n);
        for j in 0..n {
            let id = format!("req-{j}");
            // Staggered so that N/16 requests fill a block on every step.
            let computed = PROMPT + j % BS;
            let blocks = computed / BS + 1;
            let gpu: Vec<u32> = (next_gpu..next_gpu + blocks as u32).collect();
            next_gpu += blocks as u32;
            planner.extend_hashes(&id, rng.hashes(computed / BS));
            planner
                .note_scheduled(&id, 0, &gpu, true)
                .expect("schedule");
            planner
                .note_scheduled(&id, computed, &[], false)
                .expect("schedule");
            reqs.push(Running {
                id,
                computed,
                blocks,
            });
        }
        // The prompts' stores complete before timing starts.
        let store = planner.take_step().store.expect("prompt stores");
        planner.complete(store.id, true).expect("complete");
        planner.take_completions();
        Self {
            planner,
            reqs,
            rng,
            next_gpu,
            in_flight: None,
            new_hashes: Vec::new(),
        }
    }

    /// One engine step: what `Planner.schedule` (the binding) does for a decode batch,
    /// plus the completion the workers report for the previous step's store.
    fn step(&mut self) {
        let p = &mut self.planner;
        for r in &mut self.reqs {
            let mut new_block = [0u32; 1];
            let new: &[u32] = if r.computed / BS >= r.blocks {
                new_block[0] = self.next_gpu;
                self.next_gpu = self.next_gpu.wrapping_add(1);
                r.blocks += 1;
                &new_block
            } else {
                &[]
            };
            if p.note_scheduled(&r.id, r.computed, new, false)
                .expect("schedule")
            {
                let missing = r.computed / BS - p.num_hashes(&r.id);
                self.new_hashes.clear();
                self.new_hashes
                    .extend((0..missing).map(|_| self.rng.hash()));
                p.extend_hashes(&r.id, self.new_hashes.iter().copied());
                p.store_confirmed(&r.id, r.computed);
            }
            r.computed += 1;
        }
        let plan = p.take_step();
        if let Some(id) = self.in_flight.take() {
            p.complete(id, true).expect("complete");
            black_box(p.take_completions());
        }
        self.in_flight = plan.store.map(|s| s.id);
    }
}

fn decode_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("planner/decode_step");
    for n in RUNNING {
        g.throughput(Throughput::Elements(n as u64));
        let samples = Mutex::new(Vec::new());
        let stored = Mutex::new(Vec::new());
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                // Fresh requests per sample (setup not timed), so the block tables stay
                // the size of real requests however many steps criterion asks for.
                let mut d = Decode::new(n);
                let before = d.planner.stats().store_blocks;
                let start = Instant::now();
                for _ in 0..iters {
                    d.step();
                }
                let t = start.elapsed();
                samples
                    .lock()
                    .expect("samples")
                    .push(t.as_nanos() as f64 / iters as f64 / 1e3);
                stored
                    .lock()
                    .expect("samples")
                    .push((d.planner.stats().store_blocks - before) as f64 / iters as f64);
                t
            });
        });
        report(&format!("planner/decode_step/{n}"), "us/step", samples);
        report(
            &format!("planner/decode_step/{n} stored"),
            "blocks/step",
            stored,
        );
    }
    g.finish();
}

fn per_block(c: &mut Criterion) {
    let mut g = c.benchmark_group("planner");
    g.throughput(Throughput::Elements(BLOCKS as u64));
    let gpu: Vec<u32> = (0..=BLOCKS as u32).collect();

    // Eager: a request's 128 confirmed blocks, from hand-over to published.
    {
        let mut rng = Rng(1);
        let mut p = planner(false);
        fill(&mut p, &mut rng);
        let samples = Mutex::new(Vec::new());
        g.bench_function(BenchmarkId::new("store", BLOCKS), |b| {
            b.iter_custom(|iters| {
                let hashes: Vec<Vec<BlockHash>> = (0..iters).map(|_| rng.hashes(BLOCKS)).collect();
                let start = Instant::now();
                for h in &hashes {
                    p.extend_hashes("r", h.iter().copied());
                    p.note_scheduled("r", 0, &gpu, true).expect("schedule");
                    p.note_scheduled("r", BLOCKS * BS, &[], false)
                        .expect("schedule");
                    let store = p.take_step().store.expect("a store");
                    p.complete(store.id, true).expect("complete");
                    black_box(p.take_completions());
                    p.request_finished("r", BLOCKS * BS).expect("finish");
                }
                let t = start.elapsed();
                samples
                    .lock()
                    .expect("samples")
                    .push(t.as_nanos() as f64 / iters as f64 / BLOCKS as f64);
                t
            });
        });
        report(&format!("planner/store/{BLOCKS}"), "ns/block", samples);
    }

    // Lazy: 128 candidates from the GPU free queue, selected, stored and published.
    {
        let mut rng = Rng(2);
        let mut p = planner(true);
        // Lazy planners take stores only from `select_lazy`: fill the pool that way.
        let keys: Vec<(u32, BlockKey)> = (0..CPU_BLOCKS)
            .map(|i| (i, BlockKey::new(0, rng.hash())))
            .collect();
        assert_eq!(p.select_lazy(keys).len(), CPU_BLOCKS as usize);
        let store = p.take_step().store.expect("a store");
        p.complete(store.id, true).expect("complete");
        p.take_completions();
        let samples = Mutex::new(Vec::new());
        g.bench_function(BenchmarkId::new("store_lazy", BLOCKS), |b| {
            b.iter_custom(|iters| {
                let cands: Vec<Vec<(u32, BlockKey)>> = (0..iters)
                    .map(|_| {
                        (0..BLOCKS as u32)
                            .map(|i| (i, BlockKey::new(0, rng.hash())))
                            .collect()
                    })
                    .collect();
                let start = Instant::now();
                for c in cands {
                    assert_eq!(p.select_lazy(c).len(), BLOCKS);
                    let store = p.take_step().store.expect("a store");
                    p.complete(store.id, true).expect("complete");
                    black_box(p.take_completions());
                }
                let t = start.elapsed();
                samples
                    .lock()
                    .expect("samples")
                    .push(t.as_nanos() as f64 / iters as f64 / BLOCKS as f64);
                t
            });
        });
        report(&format!("planner/store_lazy/{BLOCKS}"), "ns/block", samples);
    }

    // A 128-block prefix on CPU, loaded by a new request each iteration.
    {
        let mut rng = Rng(3);
        let mut p = planner(false);
        fill(&mut p, &mut rng);
        let prefix = rng.hashes(BLOCKS + 1);
        p.extend_hashes("src", prefix.iter().copied());
        p.note_scheduled("src", 0, &gpu, true).expect("schedule");
        p.request_finished("src", BLOCKS * BS).expect("finish");
        let store = p.take_step().store.expect("a store");
        p.complete(store.id, true).expect("complete");
        p.take_completions();
        let num_tokens = BLOCKS * BS + 1;
        let samples = Mutex::new(Vec::new());
        g.bench_function(BenchmarkId::new("load", BLOCKS), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    p.extend_hashes("r", prefix.iter().copied());
                    let hit = p.lookup("r", num_tokens, 0).expect("lookup");
                    assert_eq!(hit, BLOCKS * BS);
                    p.on_alloc("r", &gpu, 0, hit).expect("alloc");
                    let load = p.take_step().loads.pop().expect("a load");
                    p.complete(load.id, true).expect("complete");
                    black_box(p.take_completions());
                    // Dropped before its blocks are confirmed: no eager store check.
                    p.request_finished("r", 0).expect("finish");
                }
                let t = start.elapsed();
                samples
                    .lock()
                    .expect("samples")
                    .push(t.as_nanos() as f64 / iters as f64 / BLOCKS as f64);
                t
            });
        });
        report(&format!("planner/load/{BLOCKS}"), "ns/block", samples);

        // The same lookup asked again (vLLM re-asks for a request stuck at the head of
        // the waiting queue): answered from the pinned result.
        p.extend_hashes("stuck", prefix.iter().copied());
        let samples = Mutex::new(Vec::new());
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("lookup_repeat", BLOCKS), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    black_box(p.lookup("stuck", num_tokens, 0).expect("lookup"));
                }
                let t = start.elapsed();
                samples
                    .lock()
                    .expect("samples")
                    .push(t.as_nanos() as f64 / iters as f64);
                t
            });
        });
        report(
            &format!("planner/lookup_repeat/{BLOCKS}"),
            "ns/call",
            samples,
        );
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = decode_step, per_block
}
criterion_main!(benches);
