//! Long randomized stress test of the planner driving the real transfer engine (host
//! backend with injected failures, behind a device whose copies take a number of harness
//! steps), playing vLLM's part: request
//! arrivals, partial hit acceptance, computation, preemption, finishes with delayed frees,
//! resets. After every step it checks that no GPU or CPU block is double-owned, that pins
//! balance and the pool stays within budget, and that every load wrote exactly the bytes
//! that were stored for its hashes.
//!
//! Copies complete on the harness's own clock, one tick per step, never on wall time, and
//! the harness collects exactly the jobs due at each tick: the same seed exercises the same
//! paths in debug and release builds, on fast and slow machines.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use offload_core::transfer::{
    Completion, Direction, FaultInjector, FaultPlan, HostCopyBackend, RegionSpec, TransferEngine,
    TransferJob,
};
use offload_core::GroupKind;
use offload_core::{BlockHash, Planner, PlannerConfig, ScheduleKind, ScheduledRequest, StepPlan};

use common::rng::Rng;
use common::transfer::{config, Clock, FakeGpu, SlowDevice, WAIT};

const BS: usize = 16;
const GPU_BLOCKS: u32 = 96;
const CPU_BLOCKS: u32 = 40;
const BLOCK_BYTES: usize = 64;
const REGIONS: usize = 2;

/// What a block holding `hash` contains in `region`: derived from the hash alone.
fn pattern(hash: BlockHash, region: usize) -> [u8; BLOCK_BYTES] {
    let mut out = [0u8; BLOCK_BYTES];
    let bytes = hash.0.to_le_bytes();
    for (i, b) in out.iter_mut().enumerate() {
        *b = bytes[i % 16] ^ (i as u8).wrapping_mul(31) ^ (region as u8 * 0x55);
    }
    out
}

/// Simulated GPU memory: one fake device buffer per region.
struct GpuMemory(Vec<FakeGpu>);

impl GpuMemory {
    fn new() -> Self {
        Self(
            (0..REGIONS)
                .map(|_| FakeGpu::new(GPU_BLOCKS as usize * BLOCK_BYTES))
                .collect(),
        )
    }

    fn regions(&self) -> Vec<RegionSpec> {
        self.0
            .iter()
            .map(|buf| buf.region(GPU_BLOCKS, BLOCK_BYTES, BLOCK_BYTES))
            .collect()
    }

    /// The forward pass computing block `gpu` as `hash`. No transfer in flight reads or
    /// writes this block (the harness fences stores of preempted requests and frees blocks
    /// only after their stores completed).
    fn write(&self, gpu: u32, hash: BlockHash) {
        for (r, buf) in self.0.iter().enumerate() {
            buf.write(gpu as usize * BLOCK_BYTES, &pattern(hash, r));
        }
    }

    /// Whether block `gpu` holds `hash`'s bytes; the load that wrote it has completed.
    fn holds(&self, gpu: u32, hash: BlockHash) -> bool {
        self.0
            .iter()
            .enumerate()
            .all(|(r, buf)| buf.read(gpu as usize * BLOCK_BYTES, BLOCK_BYTES) == pattern(hash, r))
    }
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum State {
    Waiting,
    Loading,
    Running,
    /// Finished; GPU blocks kept until `finished_sending`.
    Draining,
    /// Aborted during its load; GPU blocks kept until `finished_recving`.
    AbortedLoading,
}

#[derive(Debug)]
struct Req {
    hashes: Vec<BlockHash>,
    gpu: Vec<u32>,
    computed_blocks: usize,
    state: State,
    /// Scheduled in an earlier step (the planner then sees it as a cached request).
    scheduled_before: bool,
    /// Async load in flight: (transfer id, first block position, blocks).
    load: Option<(u64, usize, usize)>,
}

struct Harness {
    rng: Rng,
    planner: Planner,
    engine: TransferEngine,
    gpu_mem: GpuMemory,
    gpu_free: BTreeSet<u32>,
    reqs: BTreeMap<String, Req>,
    next_req: u64,
    /// Store jobs in flight and the requests they read.
    stores: HashMap<u64, Vec<String>>,
    loads_verified: u64,
    failed_loads: u64,
    clock: Clock,
    /// Steps a copy takes.
    latency: u64,
    /// Jobs submitted and not yet collected, with the tick at which each is complete.
    due: BTreeMap<u64, u64>,
    /// The latest due tick: completions keep submission order, so no job is done earlier.
    last_due: u64,
    /// Jobs handed to the device (by the copy thread), and how many the harness gave it.
    accepted: Arc<AtomicU64>,
    nonempty_submitted: u64,
}

impl Harness {
    fn new(seed: u64, plan: FaultPlan, latency: u64) -> Self {
        let gpu_mem = GpuMemory::new();
        let clock = Clock::default();
        let device = SlowDevice::wrapping(
            FaultInjector::new(HostCopyBackend::new(), plan),
            clock.clone(),
            latency,
        );
        let accepted = device.accepted();
        let engine =
            TransferEngine::with_backend(gpu_mem.regions(), CPU_BLOCKS, config(), device).unwrap();
        Self {
            rng: Rng::new(seed),
            planner: Planner::new(
                PlannerConfig::new(BS as u32, CPU_BLOCKS),
                &[GroupKind::FullAttention],
            ),
            engine,
            gpu_mem,
            gpu_free: (0..GPU_BLOCKS).collect(),
            reqs: BTreeMap::new(),
            next_req: 0,
            stores: HashMap::new(),
            loads_verified: 0,
            failed_loads: 0,
            clock,
            latency,
            due: BTreeMap::new(),
            last_due: 0,
            accepted,
            nonempty_submitted: 0,
        }
    }

    /// Hands `job` to the engine, noting when it will be complete.
    fn send(&mut self, job: TransferJob) {
        let due = if job.pairs.is_empty() {
            // Completes without the device, behind the jobs before it.
            self.last_due
        } else {
            self.nonempty_submitted += 1;
            (self.clock.now() + self.latency).max(self.last_due)
        };
        self.last_due = due;
        self.due.insert(job.id, due);
        self.engine.submit(job).unwrap();
    }

    /// Moves the clock to `tick` and applies every completion due by then. The device
    /// dates a copy when the copy thread hands it over, so the clock moves only once every
    /// submitted job got there.
    fn advance_to(&mut self, tick: u64) {
        while self.accepted.load(Ordering::Acquire) < self.nonempty_submitted {
            std::thread::yield_now();
        }
        self.clock.advance_to(tick);
        let ready: Vec<u64> = self
            .due
            .iter()
            .filter(|(_, due)| **due <= tick)
            .map(|(id, _)| *id)
            .collect();
        let done = self.engine.wait_for(&ready, WAIT).unwrap();
        assert_eq!(
            done.len(),
            ready.len(),
            "jobs due by tick {tick} did not complete"
        );
        for c in &done {
            self.due.remove(&c.id);
        }
        self.apply(done);
    }

    fn arrive(&mut self) {
        let family = self.rng.below(4) as u128;
        let shared = 1 + self.rng.below(5) as u128;
        let mut hashes: Vec<BlockHash> = (0..shared)
            .map(|i| BlockHash((family + 1) * 1000 + i))
            .collect();
        for i in 0..self.rng.below(3) {
            hashes.push(BlockHash(
                1_000_000 + u128::from(self.next_req) * 10 + u128::from(i),
            ));
        }
        let id = format!("r{}", self.next_req);
        self.next_req += 1;
        self.reqs.insert(
            id,
            Req {
                hashes,
                gpu: Vec::new(),
                computed_blocks: 0,
                state: State::Waiting,
                scheduled_before: false,
                load: None,
            },
        );
    }

    /// vLLM's scheduler: admit a waiting request (lookup, allocate, accept some of the hit).
    fn admit(&mut self, id: &str) {
        let n = self.reqs[id].hashes.len();
        let hit = self
            .planner
            .lookup(id, &self.reqs[id].hashes, n * BS + 1, 0)
            .unwrap();
        assert_eq!(hit % BS, 0);
        assert!(hit < n * BS + 1);
        if self.gpu_free.len() < n + 1 {
            return; // stays waiting; the lookup will be repeated
        }
        let gpu: Vec<u32> = (0..=n)
            .map(|_| self.gpu_free.pop_first().unwrap())
            .collect();
        let accept = (hit / BS) * self.rng.below(5) as usize / 4;
        self.planner.on_alloc(id, &[&gpu], 0, accept * BS).unwrap();
        let r = self.reqs.get_mut(id).unwrap();
        r.gpu = gpu;
        r.scheduled_before = false;
        if accept > 0 {
            r.state = State::Loading;
            r.load = Some((0, 0, accept));
        } else {
            r.state = State::Running;
            r.computed_blocks = 0;
        }
    }

    fn preempt(&mut self, id: &str) {
        assert_eq!(self.reqs[id].state, State::Running);
        // vLLM tells the workers (metadata), not the planner: fence this request's stores
        // before its blocks are reused.
        let fence: Vec<u64> = self
            .stores
            .iter()
            .filter(|(_, reqs)| reqs.iter().any(|r| r == id))
            .map(|(t, _)| *t)
            .collect();
        // The fence waits as long as those stores take.
        let until = fence.iter().filter_map(|t| self.due.get(t)).max().copied();
        if let Some(until) = until {
            self.advance_to(until);
        }
        let r = self.reqs.get_mut(id).unwrap();
        let gpu = std::mem::take(&mut r.gpu);
        r.state = State::Waiting;
        r.computed_blocks = 0;
        self.gpu_free.extend(gpu);
    }

    fn finish(&mut self, id: &str) {
        let r = &self.reqs[id];
        let delay = self
            .planner
            .request_finished(id, &r.hashes, r.computed_blocks * BS)
            .unwrap();
        if delay {
            self.reqs.get_mut(id).unwrap().state = State::Draining;
        } else {
            let r = self.reqs.remove(id).unwrap();
            self.gpu_free.extend(r.gpu);
        }
    }

    /// One engine step in vLLM's order: schedule (preempt, admit), build the step's
    /// transfers, workers submit them, the forward pass computes, finished requests are
    /// handed to the planner, completions are applied.
    fn step(&mut self) {
        if self.rng.chance(40) {
            self.arrive();
        }
        for id in self.ids_in(State::Loading) {
            if self.rng.chance(3) {
                // Aborted while loading: vLLM frees its blocks on `finished_recving`.
                let hashes = &self.reqs[&id].hashes;
                let delay = self.planner.request_finished(&id, hashes, 0).unwrap();
                assert!(!delay);
                self.reqs.get_mut(&id).unwrap().state = State::AbortedLoading;
            }
        }
        let running = self.ids_in(State::Running);
        if let Some(id) = running.first() {
            if self.rng.chance(10) {
                self.preempt(id);
            }
        }
        for id in self.ids_in(State::Waiting) {
            if self.rng.chance(5) {
                self.finish(&id); // aborted while waiting: its pinned lookup is released
            } else if self.rng.chance(60) {
                self.admit(&id);
            }
        }
        let mut forward = Vec::new();
        let mut rows = Vec::new();
        for id in self.ids_in(State::Running) {
            let r = self.reqs.get_mut(&id).unwrap();
            let (kind, gpu) = if r.scheduled_before {
                (ScheduleKind::Running, Vec::new())
            } else {
                (ScheduleKind::New, r.gpu.clone())
            };
            let before = r.computed_blocks;
            r.scheduled_before = true;
            let end = (before + 1 + self.rng.below(3) as usize).min(r.hashes.len());
            rows.push((id.clone(), kind, before * BS, gpu));
            forward.push((id, before, end));
        }
        let reqs = &self.reqs;
        let scheduled = rows
            .iter()
            .map(|(id, kind, computed, gpu)| ScheduledRequest {
                req_id: id.as_str(),
                kind: *kind,
                num_computed_tokens: *computed,
                num_scheduled_tokens: 0,
                gpu_blocks: gpu.clone(),
                hashes: reqs[id].hashes.as_slice(),
            });
        let plan = self.planner.schedule(scheduled, []).unwrap();
        // A reset while the step's stores are in flight.
        if self.rng.chance(2) {
            self.planner.reset();
        }
        self.submit(plan);
        for (id, before, end) in forward {
            let r = self.reqs.get_mut(&id).unwrap();
            for b in before..end {
                self.gpu_mem.write(r.gpu[b], r.hashes[b]);
            }
            r.computed_blocks = end;
        }
        for id in self.ids_in(State::Running).into_iter().rev() {
            let r = &self.reqs[&id];
            if r.computed_blocks == r.hashes.len() || self.rng.chance(5) {
                self.finish(&id);
            }
        }
        self.advance_to(self.clock.now() + 1);
        self.check();
    }

    fn ids_in(&self, state: State) -> Vec<String> {
        self.reqs
            .iter()
            .filter(|(_, r)| r.state == state)
            .map(|(id, _)| id.clone())
            .collect()
    }

    fn submit(&mut self, plan: StepPlan) {
        for load in plan.loads {
            let r = self.reqs.get_mut(&load.req_id).unwrap();
            assert_eq!(r.state, State::Loading);
            r.load = Some((load.id, 0, load.cpu_blocks.len()));
            if !load.valid {
                // Workers report an impossible load failed at once.
                self.planner.complete(load.id, false).unwrap();
                self.after_completion();
                continue;
            }
            self.send(TransferJob::new(
                load.id,
                Direction::Load,
                load.gpu_blocks.into_iter().zip(load.cpu_blocks).collect(),
            ));
        }
        if let Some(store) = plan.store {
            let mut targets = BTreeSet::new();
            for c in &store.cpu_blocks {
                assert!(*c < CPU_BLOCKS, "CPU block {c} beyond the pool");
                assert!(targets.insert(*c), "CPU block {c} stored twice in one job");
            }
            self.stores.insert(store.id, store.req_ids.clone());
            self.send(TransferJob::new(
                store.id,
                Direction::Store,
                store.gpu_blocks.into_iter().zip(store.cpu_blocks).collect(),
            ));
        }
    }

    fn apply(&mut self, done: Vec<Completion>) {
        for c in done {
            let ok = c.result.is_ok();
            if c.direction == Direction::Load {
                let owner = self
                    .reqs
                    .iter()
                    .find(|(_, r)| r.load.is_some_and(|(t, _, _)| t == c.id))
                    .map(|(id, _)| id.clone());
                if let Some(id) = owner {
                    let r = &self.reqs[&id];
                    let (_, start, n) = r.load.unwrap();
                    if ok {
                        for i in start..start + n {
                            assert!(
                                self.gpu_mem.holds(r.gpu[i], r.hashes[i]),
                                "load {} wrote wrong bytes into block {i} of {id}",
                                c.id
                            );
                        }
                        self.loads_verified += n as u64;
                    } else {
                        self.failed_loads += 1;
                    }
                }
            } else {
                self.stores.remove(&c.id);
            }
            self.planner.complete(c.id, ok).unwrap();
            self.after_completion();
        }
    }

    fn after_completion(&mut self) {
        let c = self.planner.take_completions();
        for id in c.finished_recving {
            if self
                .reqs
                .get(&id)
                .is_some_and(|r| r.state == State::AbortedLoading)
            {
                let r = self.reqs.remove(&id).unwrap();
                self.gpu_free.extend(r.gpu);
                continue;
            }
            if let Some(r) = self.reqs.get_mut(&id) {
                // Loaded blocks count as computed; failed ones are recomputed.
                let loaded = r.load.take().map_or(0, |(_, _, n)| n);
                r.computed_blocks = if c.load_error_blocks.iter().any(|g| r.gpu.contains(g)) {
                    0
                } else {
                    loaded
                };
                r.scheduled_before = false;
                r.state = State::Running;
            }
        }
        for id in c.finished_sending {
            let r = self
                .reqs
                .remove(&id)
                .expect("finished_sending names a known request");
            assert_eq!(r.state, State::Draining, "{id} freed while not finished");
            self.gpu_free.extend(r.gpu);
        }
    }

    fn check(&self) {
        self.planner.cache().check_invariants().unwrap();
        // Every GPU block has exactly one owner: the free list or one request.
        let mut owned = BTreeSet::new();
        for r in self.reqs.values() {
            for g in &r.gpu {
                assert!(owned.insert(*g), "GPU block {g} owned twice");
                assert!(
                    !self.gpu_free.contains(g),
                    "GPU block {g} both free and owned"
                );
            }
        }
        assert_eq!(owned.len() + self.gpu_free.len(), GPU_BLOCKS as usize);
        assert!(self.planner.cache().pool().num_free() <= CPU_BLOCKS as usize);
    }

    /// Finishes everything and completes every transfer; then no pin may remain.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            let ids: Vec<String> = self.reqs.keys().cloned().collect();
            for id in ids {
                if let Some(State::Running | State::Waiting) = self.reqs.get(&id).map(|r| r.state) {
                    self.finish(&id);
                }
            }
            let plan = self
                .planner
                .schedule(Vec::<ScheduledRequest<'_, &[BlockHash]>>::new(), [])
                .unwrap();
            self.submit(plan);
            self.advance_to(self.clock.now() + 1);
            if self.reqs.is_empty() && !self.planner.has_work_in_flight() {
                break;
            }
        }
        assert!(
            self.reqs.is_empty(),
            "requests left: {:?}",
            self.reqs.keys()
        );
        assert_eq!(self.planner.num_requests(), 0);
        for b in 0..CPU_BLOCKS {
            assert_eq!(
                self.planner.cache().pool().ref_count(b),
                Some(0),
                "pin leaked on {b}"
            );
        }
        self.check();
    }
}

fn run(seed: u64, steps: usize, plan: FaultPlan, latency: u64) -> (u64, u64) {
    let mut h = Harness::new(seed, plan, latency);
    for _ in 0..steps {
        h.step();
    }
    h.drain();
    (h.loads_verified, h.failed_loads)
}

#[test]
fn stress_without_faults_loads_exact_bytes() {
    let mut verified = 0;
    for seed in 0..40 {
        verified += run(seed, 600, FaultPlan::default(), 1).0;
    }
    eprintln!("verified {verified} loaded blocks");
    assert!(
        verified > 1000,
        "the workload must exercise loads ({verified} blocks)"
    );
}

#[test]
fn stress_with_failed_and_delayed_copies_never_hangs_or_serves_wrong_bytes() {
    let plan = FaultPlan {
        fail_loads_every: 3,
        fail_stores_every: 4,
        ..FaultPlan::default()
    };
    let (mut verified, mut failed) = (0, 0);
    for seed in 100..130 {
        let (v, f) = run(seed, 500, plan, 3);
        verified += v;
        failed += f;
    }
    eprintln!("verified {verified} loaded blocks, {failed} loads failed");
    assert!(verified > 100, "verified {verified}");
    assert!(failed > 10, "failed {failed}");
}
