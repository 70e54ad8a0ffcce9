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
//! - `planner/lookup_fresh/128`, `planner/lookup_fresh_reversed/128`: a request's first
//!   `lookup` of a 128-block prefix (and its release) that a lazy store put on CPU in
//!   prefix order, or in the order vLLM frees blocks (last first); 300 prefixes in turn.
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
use offload_core::GroupKind;
use offload_core::{
    BlockHash, BlockKey, Planner, PlannerConfig, ScheduleKind, ScheduledRequest, StepPlan,
    TransferId,
};

const BS: usize = 16;
const CPU_BLOCKS: u32 = 48_505;
/// Prompt tokens of each decoding request (stored before timing starts).
const PROMPT: usize = 512;
const RUNNING: [usize; 3] = [64, 256, 1024];
const BLOCKS: usize = 128;

fn planner(lazy: bool) -> Planner {
    Planner::new(
        PlannerConfig::new(BS as u32, CPU_BLOCKS).with_lazy(lazy),
        &[GroupKind::FullAttention],
    )
}

fn sched<'a>(
    req_id: &'a str,
    kind: ScheduleKind,
    num_computed_tokens: usize,
    gpu_blocks: &[u32],
    hashes: &'a [BlockHash],
) -> ScheduledRequest<'a, &'a [BlockHash]> {
    ScheduledRequest {
        req_id,
        kind,
        num_computed_tokens,
        num_scheduled_tokens: 0,
        gpu_blocks: gpu_blocks.to_vec(),
        hashes,
    }
}

/// A step with no scheduled request: hands out what was chosen outside a step.
fn idle_step(p: &mut Planner) -> StepPlan {
    p.schedule(Vec::<ScheduledRequest<'_, &[BlockHash]>>::new(), [])
        .expect("schedule")
}

/// Runs `req` with `hashes` through its first step and the step that confirms
/// `computed` tokens; returns the second step's plan.
fn run(p: &mut Planner, req: &str, hashes: &[BlockHash], gpu: &[u32], computed: usize) -> StepPlan {
    p.schedule([sched(req, ScheduleKind::New, 0, gpu, hashes)], [])
        .expect("schedule");
    p.schedule(
        [sched(req, ScheduleKind::Running, computed, &[], hashes)],
        [],
    )
    .expect("schedule")
}

/// Fills the whole CPU pool with published blocks of one finished request, so the
/// benchmarks run in the steady state where every store evicts.
fn fill(p: &mut Planner, rng: &mut Rng) {
    let n = CPU_BLOCKS as usize;
    let gpu: Vec<u32> = (0..n as u32).collect();
    let hashes = rng.hashes(n);
    let store = run(p, "fill", &hashes, &gpu, n * BS)
        .store
        .expect("a store");
    assert_eq!(store.gpu_blocks.len(), n);
    p.complete(store.id, true).expect("complete");
    p.request_finished("fill", &hashes, n * BS).expect("finish");
    p.take_completions();
    assert_eq!(p.cache().num_evictable(), n);
}

/// Records one criterion sample of `iters` iterations that took `t`, as nanoseconds per
/// iteration divided by `per`, and hands `t` back to criterion.
fn sample(samples: &Mutex<Vec<f64>>, t: Duration, iters: u64, per: f64) -> Duration {
    samples
        .lock()
        .expect("samples")
        .push(t.as_nanos() as f64 / iters as f64 / per);
    t
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
    hashes: Vec<BlockHash>,
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
            let hashes = rng.hashes(computed / BS);
            let plan = run(&mut planner, &id, &hashes, &gpu, computed);
            // The prompts' stores complete before timing starts.
            if let Some(store) = plan.store {
                planner.complete(store.id, true).expect("complete");
            }
            reqs.push(Running {
                id,
                hashes,
                computed,
                blocks,
            });
        }
        planner.take_completions();
        Self {
            planner,
            reqs,
            rng,
            next_gpu,
            in_flight: None,
        }
    }

    /// One engine step: what `Planner.schedule` (the binding) does for a decode batch,
    /// plus the completion the workers report for the previous step's store.
    fn step(&mut self) {
        for r in &mut self.reqs {
            // The server hashes a block once it is full.
            while r.hashes.len() < r.computed / BS {
                r.hashes.push(self.rng.hash());
            }
        }
        let mut scheduled = Vec::with_capacity(self.reqs.len());
        for r in &mut self.reqs {
            let mut gpu_blocks = Vec::new();
            if r.computed / BS >= r.blocks {
                gpu_blocks.push(self.next_gpu);
                self.next_gpu = self.next_gpu.wrapping_add(1);
                r.blocks += 1;
            }
            scheduled.push(ScheduledRequest {
                req_id: r.id.as_str(),
                kind: ScheduleKind::Running,
                num_computed_tokens: r.computed,
                num_scheduled_tokens: 0,
                gpu_blocks,
                hashes: r.hashes.as_slice(),
            });
            r.computed += 1;
        }
        let p = &mut self.planner;
        let plan = p.schedule(scheduled, []).expect("schedule");
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
                let t = sample(&samples, start.elapsed(), iters, 1e3);
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
                    let store = run(&mut p, "r", h, &gpu, BLOCKS * BS)
                        .store
                        .expect("a store");
                    p.complete(store.id, true).expect("complete");
                    black_box(p.take_completions());
                    p.request_finished("r", h, BLOCKS * BS).expect("finish");
                }
                sample(&samples, start.elapsed(), iters, BLOCKS as f64)
            });
        });
        report(&format!("planner/store/{BLOCKS}"), "ns/block", samples);
    }

    // Lazy: 128 candidates from the GPU free queue, selected, stored and published.
    {
        let mut rng = Rng(2);
        let mut p = planner(true);
        // Lazy planners take stores only from lazy candidates: fill the pool that way.
        let keys: Vec<(u32, BlockKey)> = (0..CPU_BLOCKS)
            .map(|i| (i, BlockKey::new(0, rng.hash())))
            .collect();
        let plan = p
            .schedule(Vec::<ScheduledRequest<'_, &[BlockHash]>>::new(), keys)
            .expect("schedule");
        assert_eq!(plan.held_gpu_blocks.len(), CPU_BLOCKS as usize);
        let store = plan.store.expect("a store");
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
                    let plan = p
                        .schedule(Vec::<ScheduledRequest<'_, &[BlockHash]>>::new(), c)
                        .expect("schedule");
                    assert_eq!(plan.held_gpu_blocks.len(), BLOCKS);
                    let store = plan.store.expect("a store");
                    p.complete(store.id, true).expect("complete");
                    black_box(p.take_completions());
                }
                sample(&samples, start.elapsed(), iters, BLOCKS as f64)
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
        p.schedule([sched("src", ScheduleKind::New, 0, &gpu, &prefix)], [])
            .expect("schedule");
        p.request_finished("src", &prefix, BLOCKS * BS)
            .expect("finish");
        let store = idle_step(&mut p).store.expect("a store");
        p.complete(store.id, true).expect("complete");
        p.take_completions();
        let num_tokens = BLOCKS * BS + 1;
        let samples = Mutex::new(Vec::new());
        g.bench_function(BenchmarkId::new("load", BLOCKS), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let hit = p.lookup("r", &prefix, num_tokens, 0).expect("lookup");
                    assert_eq!(hit, BLOCKS * BS);
                    p.on_alloc("r", &[&gpu], 0, hit).expect("alloc");
                    let load = p
                        .schedule([sched("r", ScheduleKind::New, 0, &gpu, &prefix)], [])
                        .expect("schedule")
                        .loads
                        .pop()
                        .expect("a load");
                    p.complete(load.id, true).expect("complete");
                    black_box(p.take_completions());
                    // Dropped before its blocks are confirmed: no eager store check.
                    p.request_finished("r", &prefix, 0).expect("finish");
                }
                sample(&samples, start.elapsed(), iters, BLOCKS as f64)
            });
        });
        report(&format!("planner/load/{BLOCKS}"), "ns/block", samples);

        // The same lookup asked again (vLLM re-asks for a request stuck at the head of
        // the waiting queue): answered from the pinned result.
        let samples = Mutex::new(Vec::new());
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("lookup_repeat", BLOCKS), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    black_box(p.lookup("stuck", &prefix, num_tokens, 0).expect("lookup"));
                }
                sample(&samples, start.elapsed(), iters, 1.0)
            });
        });
        report(
            &format!("planner/lookup_repeat/{BLOCKS}"),
            "ns/call",
            samples,
        );
    }

    // A first lookup (and its release) of a 128-block prefix that a lazy store put on CPU
    // in prefix order, or reversed: the order vLLM frees a request's blocks in, last first.
    // Prefixes are taken in turn from 300 stored ones, so the index is cold as in a server.
    for (label, reversed) in [("lookup_fresh", false), ("lookup_fresh_reversed", true)] {
        let mut rng = Rng(4);
        let mut p = planner(true);
        let prefixes: Vec<Vec<BlockHash>> = (0..300).map(|_| rng.hashes(BLOCKS + 1)).collect();
        for prefix in &prefixes {
            let mut freed: Vec<(u32, BlockKey)> = (0..BLOCKS as u32)
                .zip(prefix)
                .map(|(i, h)| (i, BlockKey::new(0, *h)))
                .collect();
            if reversed {
                freed.reverse();
            }
            let store = p
                .schedule(Vec::<ScheduledRequest<'_, &[BlockHash]>>::new(), freed)
                .expect("schedule")
                .store
                .expect("a store");
            p.complete(store.id, true).expect("complete");
            p.take_completions();
        }
        let num_tokens = BLOCKS * BS + 1;
        let mut next = prefixes.iter().cycle();
        let samples = Mutex::new(Vec::new());
        g.bench_function(BenchmarkId::new(label, BLOCKS), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let prefix = next.next().expect("cycled");
                    let hit = p.lookup("r", prefix, num_tokens, 0).expect("lookup");
                    assert_eq!(hit, BLOCKS * BS);
                    p.request_finished("r", prefix, 0).expect("finish");
                }
                sample(&samples, start.elapsed(), iters, BLOCKS as f64)
            });
        });
        report(&format!("planner/{label}/{BLOCKS}"), "ns/block", samples);
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
