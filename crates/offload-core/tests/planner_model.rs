//! Model-based test of the planner: random sequences of server calls (arrivals, lookups,
//! allocations with part of the hit accepted, computation, hash lists rewritten as
//! vLLM's streaming sessions do, preemptions and resumptions, finishes, steps, per-rank
//! completions that may fail, resets) are played against simulated GPU and CPU memory. Every copy runs when a rank
//! reports it, so the test sees what each transfer read and wrote.
//!
//! Checked after every call: every store writes a GPU block's content under the key of
//! that content, every load reads exactly the content stored for the hash it serves, no
//! CPU block is written by two transfers or read while written, and the cache's
//! invariants hold. At the end, with every request finished and every transfer retired,
//! no pin is left and the planner forgets every request.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{HashMap, HashSet};

use common::planner::{chained, key, planner, store_keys, BS};
use offload_core::{
    BlockHash, BlockId, BlockKey, Planner, ScheduleKind, ScheduledRequest, StepPlan, TransferId,
};
use proptest::prelude::*;

/// CPU blocks: small, so stores evict and run out of space.
const CAP: u32 = 8;

#[derive(Debug, Clone)]
enum Op {
    /// A new request over prompt family `0` (requests of one family share their
    /// prefix), `1` blocks long, plus a block of its own when `2`.
    Arrive(u8, u8, bool),
    /// The server asks for the CPU hit after a GPU prefix hit of `1` blocks.
    Lookup(u8, u8),
    /// Allocate with the given fraction (0..=4 quarters) of the hit accepted, looking
    /// the request up first (GPU prefix hit of `3` blocks) when `2`, as vLLM does within
    /// one scheduler step, or using its last lookup.
    Alloc(u8, u8, bool, u8),
    /// Compute `1` more blocks in the coming step.
    Run(u8, u8),
    /// The server truncates the request's hashes to its computed blocks and regrows
    /// them with `2` blocks of family `1` (0: the family it regrew with last time).
    Rewrite(u8, u8, u8),
    Finish(u8),
    Step,
    /// A rank runs and reports a random transfer in flight; `1`: success.
    Complete(u8, bool),
    /// The server preempts a running request: its GPU blocks are freed and it waits to
    /// be resumed from scratch (looked up and allocated again).
    Preempt(u8),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..2, 1u8..8, any::<bool>()).prop_map(|(f, n, u)| Op::Arrive(f, n, u)),
        4 => (any::<u8>(), 0u8..3).prop_map(|(r, g)| Op::Lookup(r, g)),
        3 => (any::<u8>(), 0u8..5, prop::bool::weighted(0.75), 0u8..3)
            .prop_map(|(r, q, fresh, g)| Op::Alloc(r, q, fresh, g)),
        4 => (any::<u8>(), 1u8..4).prop_map(|(r, n)| Op::Run(r, n)),
        1 => (any::<u8>(), 0u8..3, 1u8..4).prop_map(|(r, f, n)| Op::Rewrite(r, f, n)),
        2 => any::<u8>().prop_map(Op::Finish),
        3 => Just(Op::Step),
        6 => (any::<u8>(), prop::bool::weighted(0.9)).prop_map(|(i, ok)| Op::Complete(i, ok)),
        1 => any::<u8>().prop_map(Op::Preempt),
        1 => Just(Op::Reset),
    ]
}

/// The content of block `b` of prompt family `family` (family 0: a block of request
/// `b`'s own).
fn block(family: u64, b: u64) -> u64 {
    (family << 32) | b
}

#[derive(Debug)]
struct ModelReq {
    id: String,
    family: u64,
    /// The server's hash list (what the planner reads through `HashSource`).
    hashes: Vec<BlockHash>,
    gpu: Vec<u32>,
    /// Tokens computed, including those the coming step computes.
    computed: usize,
    allocated: bool,
    offered: usize,
    /// Blocks of the GPU prefix hit the last lookup started after.
    gpu_hit: usize,
    loading: bool,
    finished: bool,
    /// A reset happened between the lookup and the allocation.
    stale: bool,
    /// Was preempted: its next allocation resumes it.
    preempted: bool,
}

/// How a request appears in the coming step.
#[derive(Debug)]
struct Scheduled {
    req: usize,
    kind: ScheduleKind,
    computed: usize,
    gpu: Vec<u32>,
}

#[derive(Debug)]
struct Flight {
    id: TransferId,
    pairs: Vec<(u32, BlockId)>,
    store: bool,
    valid: bool,
    /// Pairwise with `pairs`: the content each copy must move.
    expect: Vec<BlockHash>,
    acks: u32,
}

struct Model {
    p: Planner,
    world: u32,
    lazy: bool,
    reqs: Vec<ModelReq>,
    /// The requests the coming step schedules, each at most once.
    step: Vec<Scheduled>,
    /// What each GPU block holds (written when a request computes it or loads it).
    gpu_mem: HashMap<u32, BlockHash>,
    /// What each CPU block holds (written when a store copy runs).
    cpu_mem: HashMap<BlockId, BlockHash>,
    flights: Vec<Flight>,
    next_gpu: u32,
}

impl Model {
    fn new(world: u32, lazy: bool) -> Self {
        Self {
            p: planner(CAP, world, lazy),
            world,
            lazy,
            reqs: Vec::new(),
            step: Vec::new(),
            gpu_mem: HashMap::new(),
            cpu_mem: HashMap::new(),
            flights: Vec::new(),
            next_gpu: 0,
        }
    }

    /// The `i`-th (modulo) request for which `eligible(request, scheduled_this_step)`
    /// holds: every op acts on some request it applies to.
    fn pick(&self, i: u8, eligible: impl Fn(&ModelReq, bool) -> bool) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.reqs.len())
            .filter(|&k| eligible(&self.reqs[k], self.step.iter().any(|s| s.req == k)))
            .collect();
        (!candidates.is_empty()).then(|| candidates[usize::from(i) % candidates.len()])
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Arrive(family, n, unique) => {
                let family = u64::from(family) + 1;
                let mut content: Vec<u64> = (0..u64::from(n)).map(|b| block(family, b)).collect();
                if unique {
                    content.push(block(0, self.reqs.len() as u64));
                }
                let h = chained(None, content);
                self.reqs.push(ModelReq {
                    id: format!("r{}", self.reqs.len()),
                    family,
                    hashes: h,
                    gpu: Vec::new(),
                    computed: 0,
                    allocated: false,
                    offered: 0,
                    gpu_hit: 0,
                    loading: false,
                    finished: false,
                    stale: false,
                    preempted: false,
                });
            }
            Op::Lookup(i, gpu_hit) => {
                if let Some(k) = self.pick(i, |r, _| !r.allocated && !r.finished) {
                    self.lookup(k, gpu_hit.into())?;
                }
            }
            Op::Alloc(i, quarters, fresh, gpu_hit) => {
                let Some(k) = self.pick(i, |r, _| !r.allocated && !r.finished) else {
                    return Ok(());
                };
                if fresh {
                    self.lookup(k, gpu_hit.into())?;
                }
                let r = &mut self.reqs[k];
                let accept = (r.offered / BS * usize::from(quarters) / 4) * BS;
                r.gpu = (self.next_gpu..self.next_gpu + r.hashes.len() as u32 + 1).collect();
                self.next_gpu += r.gpu.len() as u32;
                // The GPU prefix cache held the first blocks: they are in the new table.
                for b in 0..r.gpu_hit {
                    self.gpu_mem.insert(r.gpu[b], r.hashes[b]);
                }
                let computed = r.gpu_hit * BS;
                self.p.on_alloc(&r.id, &[&r.gpu], computed, accept).unwrap();
                r.allocated = true;
                r.loading = accept > 0;
                r.computed = computed + accept;
                self.step.push(Scheduled {
                    req: k,
                    kind: if r.preempted {
                        ScheduleKind::Resumed
                    } else {
                        ScheduleKind::New
                    },
                    computed,
                    gpu: r.gpu.clone(),
                });
            }
            Op::Run(i, n) => {
                let Some(k) = self.pick(i, |r, stepped| {
                    r.allocated && !r.loading && !r.finished && !stepped
                }) else {
                    return Ok(());
                };
                let r = &mut self.reqs[k];
                // The planner is told the tokens computed before this step; the step
                // computes `n` more blocks.
                self.step.push(Scheduled {
                    req: k,
                    kind: ScheduleKind::Running,
                    computed: r.computed,
                    gpu: Vec::new(),
                });
                let end = (r.computed / BS + usize::from(n)).min(r.hashes.len());
                for b in r.computed / BS..end {
                    self.gpu_mem.insert(r.gpu[b], r.hashes[b]);
                }
                r.computed = end * BS;
            }
            Op::Rewrite(i, family, n) => {
                let Some(k) = self.pick(i, |r, stepped| !r.loading && !r.finished && !stepped)
                else {
                    return Ok(());
                };
                let r = &mut self.reqs[k];
                // vLLM's `_update_request_as_session`: keep the computed blocks' hashes,
                // regrow with the next chunk. An allocated request's block table keeps its
                // size, so the list never outgrows it; a waiting one (nothing computed) is
                // looked up again before it is allocated.
                let family = (u64::from(family) + r.family - 1) % 3 + 1;
                r.family = family;
                let keep = r.computed / BS;
                let mut len = keep + usize::from(n);
                if r.allocated {
                    len = len.min(r.gpu.len() - 1);
                } else {
                    r.offered = 0;
                    r.gpu_hit = 0;
                }
                r.hashes.truncate(keep);
                let regrown = (keep as u64..len as u64).map(|b| block(family, b));
                let tail = chained(r.hashes.last().copied(), regrown);
                r.hashes.extend(tail);
            }
            Op::Finish(i) => {
                let Some(k) = self.pick(i, |r, stepped| !r.finished && !r.loading && !stepped)
                else {
                    return Ok(());
                };
                let r = &mut self.reqs[k];
                self.p
                    .request_finished(&r.id, &r.hashes, r.computed)
                    .unwrap();
                r.finished = true;
            }
            Op::Step => self.run_step()?,
            Op::Complete(i, ok) => {
                if self.flights.is_empty() {
                    return Ok(());
                }
                let f = usize::from(i) % self.flights.len();
                self.run_copy(f, ok)?;
            }
            Op::Preempt(i) => {
                let Some(k) = self.pick(i, |r, stepped| {
                    r.allocated && !r.loading && !r.finished && !stepped
                }) else {
                    return Ok(());
                };
                let r = &mut self.reqs[k];
                // Its old GPU blocks are never reused here, so stores still reading them
                // need no fence.
                r.allocated = false;
                r.preempted = true;
                r.computed = 0;
                r.offered = 0;
                r.gpu_hit = 0;
            }
            Op::Reset => {
                self.p.reset();
                for r in &mut self.reqs {
                    r.stale = true;
                }
            }
        }
        if let Err(e) = self.p.cache().check_invariants() {
            prop_assert!(false, "{}", e);
        }
        Ok(())
    }

    /// The server asks for request `k`'s CPU hit after a GPU prefix hit of `gpu_hit`
    /// blocks (at most its whole prompt but the last token).
    fn lookup(&mut self, k: usize, gpu_hit: usize) -> Result<(), TestCaseError> {
        let r = &mut self.reqs[k];
        let tokens = r.hashes.len() * BS + 1;
        let gpu_hit = gpu_hit.min(r.hashes.len());
        let hit = self
            .p
            .lookup(&r.id, &r.hashes, tokens, gpu_hit * BS)
            .unwrap();
        prop_assert!(hit % BS == 0 && gpu_hit * BS + hit < tokens);
        // Every hit block is servable: its store completed.
        for (b, h) in r.hashes[gpu_hit..gpu_hit + hit / BS].iter().enumerate() {
            prop_assert!(
                self.p.cache().get_ready(&key(*h)).is_some(),
                "hit block {} not ready",
                b
            );
        }
        r.offered = hit;
        r.gpu_hit = gpu_hit;
        r.stale = false;
        Ok(())
    }

    /// Hands the coming step to the planner and records the transfers it issues.
    fn run_step(&mut self) -> Result<(), TestCaseError> {
        let candidates: Vec<(u32, BlockKey)> = if self.lazy {
            // Every computed block of finished requests, oldest first.
            self.reqs
                .iter()
                .filter(|r| r.finished)
                .flat_map(|r| (0..r.computed / BS).map(|b| (r.gpu[b], key(r.hashes[b]))))
                .collect()
        } else {
            Vec::new()
        };
        let scheduled: Vec<_> = self
            .step
            .drain(..)
            .map(|s| ScheduledRequest {
                req_id: self.reqs[s.req].id.as_str(),
                kind: s.kind,
                num_computed_tokens: s.computed,
                num_scheduled_tokens: 0,
                gpu_blocks: s.gpu,
                hashes: self.reqs[s.req].hashes.as_slice(),
            })
            .collect();
        let plan = self.p.schedule(scheduled, candidates).unwrap();
        self.record(plan)
    }

    fn record(&mut self, plan: StepPlan) -> Result<(), TestCaseError> {
        for l in plan.loads {
            let r = self.reqs.iter().find(|r| r.id == l.req_id).unwrap();
            // Only a reset between lookup and allocation invalidates a hit.
            prop_assert!(l.valid || r.stale);
            // The load starts where the GPU prefix hit of the request's lookup ended.
            let start = r.gpu.iter().position(|g| l.gpu_blocks.first() == Some(g));
            let start = start.unwrap_or(0);
            let expect = r.hashes[start..start + l.cpu_blocks.len()].to_vec();
            self.flights.push(Flight {
                id: l.id,
                pairs: l.gpu_blocks.into_iter().zip(l.cpu_blocks).collect(),
                store: false,
                valid: l.valid,
                expect,
                acks: 0,
            });
        }
        if let Some(s) = plan.store {
            // Each block is stored under the key of the content its GPU block holds.
            let content: Vec<Option<BlockHash>> = s
                .gpu_blocks
                .iter()
                .map(|g| self.gpu_mem.get(g).copied())
                .collect();
            let keys: Vec<Option<BlockHash>> =
                store_keys(&self.p, &s).into_iter().map(Some).collect();
            prop_assert_eq!(&keys, &content, "store under a stale key");
            let expect = content.into_iter().flatten().collect();
            self.flights.push(Flight {
                id: s.id,
                pairs: s.gpu_blocks.into_iter().zip(s.cpu_blocks).collect(),
                store: true,
                valid: true,
                expect,
                acks: 0,
            });
        }
        // No CPU block is written by two transfers, or read while written.
        let mut written = HashSet::new();
        for f in self.flights.iter().filter(|f| f.store) {
            for (_, c) in &f.pairs {
                prop_assert!(written.insert(*c), "CPU block {} written twice", c);
            }
        }
        for f in self.flights.iter().filter(|f| !f.store) {
            for (_, c) in &f.pairs {
                prop_assert!(!written.contains(c), "CPU block {} read while written", c);
            }
        }
        Ok(())
    }

    /// One rank runs transfer `flights[f]` and reports it.
    fn run_copy(&mut self, f: usize, ok: bool) -> Result<(), TestCaseError> {
        let flight = &mut self.flights[f];
        // Workers report invalid loads failed without copying.
        let ok = ok && flight.valid;
        for ((gpu, cpu), h) in flight.pairs.iter().zip(&flight.expect) {
            if flight.store {
                prop_assert_eq!(
                    self.gpu_mem.get(gpu),
                    Some(h),
                    "GPU block changed under a store"
                );
                if ok {
                    self.cpu_mem.insert(*cpu, *h);
                }
            } else {
                prop_assert_eq!(self.cpu_mem.get(cpu), Some(h), "load read wrong bytes");
                if ok {
                    self.gpu_mem.insert(*gpu, *h);
                }
            }
        }
        flight.acks += 1;
        let id = flight.id;
        if flight.acks == self.world {
            self.flights.remove(f);
        }
        self.p.complete(id, ok).unwrap();
        let c = self.p.take_completions();
        for req in c.finished_recving {
            let r = self.reqs.iter_mut().find(|r| r.id == req).unwrap();
            r.loading = false;
        }
        // The server recomputes the blocks of failed loads.
        for r in &mut self.reqs {
            if r.gpu.iter().any(|g| c.load_error_blocks.contains(g)) {
                r.computed = 0;
            }
        }
        Ok(())
    }

    /// Finishes every request and retires every transfer; then nothing may be left.
    fn drain(mut self) -> Result<(), TestCaseError> {
        self.run_step()?;
        for r in &self.reqs {
            if !r.finished && !r.loading {
                self.p
                    .request_finished(&r.id, &r.hashes, r.computed)
                    .unwrap();
            }
        }
        for r in &mut self.reqs {
            r.finished |= !r.loading;
        }
        self.run_step()?;
        while !self.flights.is_empty() {
            self.run_copy(0, true)?;
        }
        // Requests that were loading finished their loads above.
        for r in &mut self.reqs {
            if !r.finished {
                prop_assert!(!r.loading);
                self.p
                    .request_finished(&r.id, &r.hashes, r.computed)
                    .unwrap();
                r.finished = true;
            }
        }
        self.run_step()?;
        while !self.flights.is_empty() {
            self.run_copy(0, true)?;
        }
        prop_assert!(!self.p.has_work_in_flight());
        prop_assert_eq!(self.p.num_requests(), 0);
        for b in 0..CAP {
            prop_assert_eq!(
                self.p.cache().pool().ref_count(b),
                Some(0),
                "pin leaked on {}",
                b
            );
        }
        Ok(())
    }
}

fn run_model(ops: Vec<Op>, world: u32, lazy: bool) -> Result<(), TestCaseError> {
    let mut m = Model::new(world, lazy);
    for op in ops {
        m.apply(op)?;
    }
    m.drain()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn eager_planner_never_serves_unstored_or_wrong_blocks(ops in prop::collection::vec(op(), 1..200)) {
        run_model(ops, 1, false)?;
    }

    #[test]
    fn eager_planner_over_two_ranks(ops in prop::collection::vec(op(), 1..200)) {
        run_model(ops, 2, false)?;
    }

    #[test]
    fn lazy_planner_never_serves_unstored_or_wrong_blocks(ops in prop::collection::vec(op(), 1..200)) {
        run_model(ops, 1, true)?;
    }
}
