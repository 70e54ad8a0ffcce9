//! A single-process LLM server loop that embeds offload-core, with host memory standing in
//! for GPU memory, so it runs anywhere:
//!
//! ```text
//! cargo run --release -p offload-core --example embedded_server
//! ```
//!
//! The "device" is a small KV cache of [`DEVICE_BLOCKS`] blocks, registered with the
//! crate's [`TransferEngine`] as its one region. Like vLLM's, it keeps the blocks of
//! finished requests as a prefix cache and evicts the least recently freed ones when a
//! new request needs room. A chat workload (users with shared system prompts, each turn
//! extending the previous one) keeps coming back to prefixes the device has evicted by
//! then; the CPU tier serves them instead of a recompute.
//!
//! The forward pass is simulated: a block's KV is bytes derived from its hash alone
//! ([`fill_block`]), so every block loaded back from CPU can be checked byte for byte.
//!
//! One engine step, in the order the [`Planner`] expects:
//! 1. **Admit** waiting requests: find the device prefix hit, ask [`Planner::lookup`] how
//!    many more tokens the CPU tier holds (pinned until used), allocate device blocks
//!    (evicting), and tell [`Planner::on_alloc`] how much of the hit was accepted.
//! 2. **Schedule**: [`Planner::schedule`] with the requests that run this step returns
//!    the step's [`StepPlan`]; each load and store becomes a [`TransferJob`] on the
//!    engine's copy thread.
//! 3. **Forward pass**: running requests compute their new tokens (writing each block
//!    that fills up) and sample one token each.
//! 4. **Completions**: [`TransferEngine::poll_completions`] → [`Planner::complete_all`]
//!    → [`Planner::take_completions`]. A finished load is verified and its request runs
//!    from the next step; `finished_sending` frees the device blocks of finished requests
//!    whose last stores were in flight.
//! 5. **Finish**: a request that sampled its last token calls
//!    [`Planner::request_finished`], which flushes its last full blocks to CPU and says
//!    whether the device blocks must be kept until that copy is done.
//!
//! The process exits with status 0 only if every reloaded byte matched.

use std::collections::{HashMap, VecDeque};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use offload_core::transfer::{Direction, RegionSpec, TransferConfig, TransferEngine, TransferJob};
use offload_core::GroupKind;
use offload_core::{
    BlockHash, Planner, PlannerConfig, ScheduleKind, ScheduledRequest, StepPlan, TransferId,
};

/// Tokens per KV block.
const BLOCK_TOKENS: usize = 16;
/// Bytes of one block's KV (all layers).
const BLOCK_BYTES: usize = 32 * 1024;
/// Device blocks: room for a few requests at a time, so the prefix cache evicts.
const DEVICE_BLOCKS: u32 = 96;
/// CPU-tier blocks: larger than the device, smaller than the workload.
const CPU_BLOCKS: u32 = 288;
/// Requests that hold device blocks at once.
const MAX_ACTIVE: usize = 4;
const USERS: u64 = 12;
const TURNS: u64 = 6;
const SYSTEM_PROMPTS: u64 = 3;
const SYSTEM_PROMPT_TOKENS: usize = 160;
const USER_MESSAGE_TOKENS: usize = 40;
const OUTPUT_TOKENS: usize = 24;

type BoxError = Box<dyn std::error::Error>;

fn main() -> Result<ExitCode, BoxError> {
    let device = DeviceMemory::new();
    let engine = TransferEngine::new(
        vec![device.region()?],
        CPU_BLOCKS,
        TransferConfig::default(),
    )?;
    let planner = Planner::new(
        PlannerConfig::new(BLOCK_TOKENS as u32, engine.num_cpu_blocks()),
        &[GroupKind::FullAttention],
    );
    let mut server = Server::new(planner, engine, device);
    let started = Instant::now();
    while !server.is_done() {
        server.step()?;
    }
    let elapsed = started.elapsed();
    server.engine.shutdown(Duration::from_secs(10))?;
    Ok(server.report(elapsed))
}

/// splitmix64: a cheap, well-mixed function of one word.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The chained hash of a full block: it covers the block's tokens and, through
/// `parent`, every block before it (as vLLM's block hashes do).
fn block_hash(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let seed = parent.map_or(0x5EED, |p| p.0);
    let (mut lo, mut hi) = (seed as u64, (seed >> 64) as u64);
    for &t in tokens {
        lo = mix(lo ^ u64::from(t));
        hi = mix(hi ^ lo);
    }
    BlockHash((u128::from(hi) << 64) | u128::from(lo))
}

/// The KV the forward pass computes for the block with hash `hash`: a function of the
/// hash alone, different in every word, so a wrong or misplaced copy shows.
fn fill_block(hash: BlockHash, out: &mut [u8]) {
    let seed = (hash.0 as u64) ^ ((hash.0 >> 64) as u64).rotate_left(17);
    for (i, word) in out.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(&mix(seed ^ i as u64).to_le_bytes());
    }
}

/// Token `i` of a system prompt (`kind` 0), a user message (1) or a model output (2):
/// deterministic, so every run sends the same workload.
fn token(kind: u64, a: u64, b: u64, i: usize) -> u32 {
    (mix((kind << 56) ^ (a << 40) ^ (b << 24) ^ i as u64) % 50_000) as u32
}

/// The device's KV memory. It is accessed only through raw pointers to one block at a
/// time, because the engine's copy thread reads and writes other blocks concurrently.
struct DeviceMemory {
    base: *mut u8,
    /// Owns the memory behind `base`; never touched directly.
    _memory: Vec<u8>,
}

impl DeviceMemory {
    fn new() -> Self {
        let mut memory = vec![0u8; DEVICE_BLOCKS as usize * BLOCK_BYTES];
        Self {
            base: memory.as_mut_ptr(),
            _memory: memory,
        }
    }

    fn region(&self) -> Result<RegionSpec, BoxError> {
        // SAFETY: the memory lives in `self`, which `main` keeps until the engine is shut
        // down (and the heap buffer never moves). The server touches a block only when
        // no transfer in flight uses it: it writes blocks of running requests that no
        // store reads yet (stores read blocks computed in earlier steps), and reads a
        // loaded block only after its load completed.
        let region =
            unsafe { RegionSpec::new(self.base as u64, DEVICE_BLOCKS, BLOCK_BYTES, BLOCK_BYTES)? };
        Ok(region)
    }

    /// The address of device block `block`.
    fn block_ptr(&self, block: u32) -> *mut u8 {
        assert!(block < DEVICE_BLOCKS, "device block {block} out of range");
        self.base.wrapping_add(block as usize * BLOCK_BYTES)
    }

    /// The forward pass writes the KV of the block with hash `hash`.
    fn compute(&self, block: u32, hash: BlockHash) {
        // SAFETY: in bounds (checked by `block_ptr`). The block belongs to a running
        // request: no load writes it, and no store reads it before the step after this.
        let kv = unsafe { std::slice::from_raw_parts_mut(self.block_ptr(block), BLOCK_BYTES) };
        fill_block(hash, kv);
    }

    /// Whether `block` holds exactly the KV of `hash`.
    fn holds(&self, block: u32, hash: BlockHash) -> bool {
        let mut expected = vec![0u8; BLOCK_BYTES];
        fill_block(hash, &mut expected);
        // SAFETY: in bounds (checked by `block_ptr`). The load that wrote this block has
        // completed, and nothing else writes a block whose request is not running.
        let kv = unsafe { std::slice::from_raw_parts(self.block_ptr(block), BLOCK_BYTES) };
        kv == expected.as_slice()
    }
}

/// The device's block allocator with a prefix cache, as vLLM's block pool: a block whose
/// KV is complete stays findable by its hash after its request ends, until it is taken
/// from the free queue for a new allocation.
struct DeviceBlocks {
    refs: Vec<u32>,
    content: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, u32>,
    /// Blocks nobody holds, least recently freed first.
    free: VecDeque<u32>,
    evictions: u64,
}

impl DeviceBlocks {
    fn new(blocks: u32) -> Self {
        Self {
            refs: vec![0; blocks as usize],
            content: vec![None; blocks as usize],
            cached: HashMap::new(),
            free: (0..blocks).collect(),
            evictions: 0,
        }
    }

    /// The device blocks holding the longest cached prefix of `hashes`, at most `max`.
    fn prefix_hit(&self, hashes: &[BlockHash], max: usize) -> Vec<u32> {
        hashes[..max.min(hashes.len())]
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// A block table of `total` blocks starting with the prefix hit `hit`, or `None` when
    /// the free queue cannot supply the rest.
    fn allocate(&mut self, hit: &[u32], total: usize) -> Option<Vec<u32>> {
        let hit_in_free = hit.iter().filter(|&&b| self.refs[b as usize] == 0).count();
        if self.free.len() - hit_in_free < total - hit.len() {
            return None;
        }
        for &b in hit {
            if self.refs[b as usize] == 0 {
                self.free.retain(|&f| f != b);
            }
            self.refs[b as usize] += 1;
        }
        let mut table = hit.to_vec();
        while table.len() < total {
            let b = self.free.pop_front()?;
            if let Some(h) = self.content[b as usize].take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                }
                self.evictions += 1;
            }
            self.refs[b as usize] = 1;
            table.push(b);
        }
        Some(table)
    }

    /// `block` now holds the complete KV of `hash`: later requests may reuse it.
    fn register(&mut self, block: u32, hash: BlockHash) {
        self.content[block as usize] = Some(hash);
        self.cached.entry(hash).or_insert(block);
    }

    /// Drops a request's hold on its blocks. They join the free queue last block first,
    /// so a request's tail is evicted before its prefix (as in vLLM).
    fn free(&mut self, table: &[u32]) {
        for &b in table.iter().rev() {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.free.push_back(b);
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    /// Its CPU hit is being copied to blocks `first..first + n` of its table.
    Loading {
        first: usize,
        n: usize,
    },
    /// Runs for the first time in the next step.
    Admitted,
    Running,
    /// Finished; its blocks are freed on `finished_sending`.
    Draining,
}

struct Request {
    id: String,
    user: u64,
    turn: u64,
    /// Prompt and sampled tokens.
    tokens: Vec<u32>,
    max_tokens: usize,
    /// One chained hash per full block of `tokens`: the list the planner reads.
    hashes: Vec<BlockHash>,
    table: Vec<u32>,
    /// Tokens whose KV is in device memory.
    computed: usize,
    state: State,
}

impl Request {
    fn new(user: u64, turn: u64, history: Vec<u32>) -> Self {
        let mut tokens = history;
        tokens.extend((0..USER_MESSAGE_TOKENS).map(|i| token(1, user, turn, i)));
        let max_tokens = tokens.len() + OUTPUT_TOKENS;
        let mut r = Self {
            id: format!("user{user}-turn{turn}"),
            user,
            turn,
            tokens,
            max_tokens,
            hashes: Vec::new(),
            table: Vec::new(),
            computed: 0,
            state: State::Waiting,
        };
        r.hash_full_blocks();
        r
    }

    /// Hashes the blocks that filled up since the last call, as the server's tokenizer
    /// side does when tokens are appended.
    fn hash_full_blocks(&mut self) {
        while (self.hashes.len() + 1) * BLOCK_TOKENS <= self.tokens.len() {
            let k = self.hashes.len();
            let h = block_hash(
                self.hashes.last().copied(),
                &self.tokens[k * BLOCK_TOKENS..(k + 1) * BLOCK_TOKENS],
            );
            self.hashes.push(h);
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    steps: u64,
    requests: u64,
    prompt_tokens: u64,
    device_hit_tokens: u64,
    cpu_hit_tokens: u64,
    computed_prompt_tokens: u64,
    verified_blocks: u64,
    verified_bytes: u64,
    mismatched_blocks: u64,
    failed_loads: u64,
    /// Time with at least one copy in flight.
    copy_busy: Duration,
}

struct Server {
    planner: Planner,
    /// Declared before `device`: dropped first, its copy thread stops before the memory
    /// it copies into is freed.
    engine: TransferEngine,
    device: DeviceMemory,
    blocks: DeviceBlocks,
    requests: HashMap<String, Request>,
    waiting: VecDeque<String>,
    /// Requests holding device blocks, in admission order.
    active: Vec<String>,
    in_flight: Vec<TransferId>,
    busy_since: Option<Instant>,
    counters: Counters,
}

impl Server {
    fn new(planner: Planner, engine: TransferEngine, device: DeviceMemory) -> Self {
        let mut server = Self {
            planner,
            engine,
            device,
            blocks: DeviceBlocks::new(DEVICE_BLOCKS),
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            active: Vec::new(),
            in_flight: Vec::new(),
            busy_since: None,
            counters: Counters::default(),
        };
        for user in 0..USERS {
            let system = user % SYSTEM_PROMPTS;
            let prompt = (0..SYSTEM_PROMPT_TOKENS)
                .map(|i| token(0, system, 0, i))
                .collect();
            server.arrive(Request::new(user, 0, prompt));
        }
        server
    }

    fn arrive(&mut self, r: Request) {
        assert!(
            r.max_tokens.div_ceil(BLOCK_TOKENS) <= DEVICE_BLOCKS as usize,
            "request {} needs more blocks than the device has",
            r.id
        );
        self.counters.requests += 1;
        self.counters.prompt_tokens += r.tokens.len() as u64;
        self.waiting.push_back(r.id.clone());
        self.requests.insert(r.id.clone(), r);
    }

    fn is_done(&self) -> bool {
        self.requests.is_empty() && !self.planner.has_work_in_flight()
    }

    fn step(&mut self) -> Result<(), BoxError> {
        self.counters.steps += 1;
        self.admit()?;
        let plan = self.schedule()?;
        self.submit(plan)?;
        let finished = self.forward();
        self.apply_completions()?;
        for id in finished {
            self.finish(&id)?;
        }
        Ok(())
    }

    /// Step 1: admits waiting requests, oldest first, while device blocks last.
    fn admit(&mut self) -> Result<(), BoxError> {
        while self.active.len() < MAX_ACTIVE {
            let Some(id) = self.waiting.front() else {
                break;
            };
            let r = self
                .requests
                .get_mut(id)
                .ok_or("waiting request vanished")?;
            // The last prompt token is always computed: it yields the first output.
            let hit = self
                .blocks
                .prefix_hit(&r.hashes, (r.tokens.len() - 1) / BLOCK_TOKENS);
            let device_hit = hit.len() * BLOCK_TOKENS;
            let cpu_hit =
                self.planner
                    .lookup(&r.id, r.hashes.as_slice(), r.tokens.len(), device_hit)?;
            let total = r.max_tokens.div_ceil(BLOCK_TOKENS);
            let Some(table) = self.blocks.allocate(&hit, total) else {
                // No room: it waits (its CPU hit stays pinned) until requests finish.
                break;
            };
            self.planner
                .on_alloc(&r.id, &[&table], device_hit, cpu_hit)?;
            self.counters.device_hit_tokens += device_hit as u64;
            r.table = table;
            r.computed = device_hit;
            r.state = if cpu_hit > 0 {
                State::Loading {
                    first: hit.len(),
                    n: cpu_hit / BLOCK_TOKENS,
                }
            } else {
                State::Admitted
            };
            let id = self.waiting.pop_front().ok_or("waiting queue emptied")?;
            self.active.push(id);
        }
        Ok(())
    }

    /// Step 2: tells the planner what runs this step and gets the step's copies.
    fn schedule(&mut self) -> Result<StepPlan, BoxError> {
        let requests = &self.requests;
        let scheduled = self.active.iter().filter_map(|id| {
            let r = requests.get(id)?;
            let (kind, gpu_blocks) = match r.state {
                State::Admitted => (ScheduleKind::New, r.table.clone()),
                State::Running => (ScheduleKind::Running, Vec::new()),
                _ => return None,
            };
            Some(ScheduledRequest {
                req_id: r.id.as_str(),
                kind,
                num_computed_tokens: r.computed,
                num_scheduled_tokens: 0,
                gpu_blocks,
                hashes: r.hashes.as_slice(),
            })
        });
        Ok(self.planner.schedule(scheduled, [])?)
    }

    /// Hands the plan's copies to the engine (the worker side of the protocol).
    fn submit(&mut self, plan: StepPlan) -> Result<(), BoxError> {
        let loads = plan.loads.into_iter().map(|l| {
            let pairs = l.gpu_blocks.into_iter().zip(l.cpu_blocks).collect();
            (
                l.id,
                l.valid,
                TransferJob::new(l.id, Direction::Load, pairs),
            )
        });
        let store = plan.store.map(|s| {
            let pairs = s.gpu_blocks.into_iter().zip(s.cpu_blocks).collect();
            (s.id, true, TransferJob::new(s.id, Direction::Store, pairs))
        });
        for (id, valid, job) in loads.chain(store) {
            if !valid {
                // A load the planner had no hit for: report it failed, never copy it.
                self.planner.complete(id, false)?;
                continue;
            }
            self.engine.submit(job)?;
            self.in_flight.push(id);
            self.busy_since.get_or_insert_with(Instant::now);
        }
        Ok(())
    }

    /// Step 3: every running request computes its pending tokens and samples one more.
    /// Returns the requests that sampled their last token.
    fn forward(&mut self) -> Vec<String> {
        let mut finished = Vec::new();
        for id in &self.active {
            let Some(r) = self.requests.get_mut(id) else {
                continue;
            };
            match r.state {
                State::Admitted => {
                    self.counters.computed_prompt_tokens += (r.tokens.len() - r.computed) as u64;
                    r.state = State::Running;
                }
                State::Running => {}
                _ => continue,
            }
            for k in r.computed / BLOCK_TOKENS..r.tokens.len() / BLOCK_TOKENS {
                self.device.compute(r.table[k], r.hashes[k]);
                self.blocks.register(r.table[k], r.hashes[k]);
            }
            r.computed = r.tokens.len();
            let next = token(2, r.user, r.turn, r.tokens.len());
            r.tokens.push(next);
            r.hash_full_blocks();
            if r.tokens.len() == r.max_tokens {
                finished.push(id.clone());
            }
        }
        finished
    }

    /// Step 4: applies what the engine finished. Blocks when nothing can run until a copy
    /// completes, so the loop never spins.
    fn apply_completions(&mut self) -> Result<(), BoxError> {
        let mut done = Vec::new();
        self.engine.poll_completions(&mut done);
        let can_run = self.active.iter().any(|id| {
            self.requests
                .get(id)
                .is_some_and(|r| matches!(r.state, State::Admitted | State::Running))
        });
        if done.is_empty() && !can_run && !self.in_flight.is_empty() {
            done = self
                .engine
                .wait_for(&self.in_flight, Duration::from_secs(10))?;
        }
        for c in &done {
            self.in_flight.retain(|&id| id != c.id);
        }
        if self.in_flight.is_empty() {
            if let Some(since) = self.busy_since.take() {
                self.counters.copy_busy += since.elapsed();
            }
        }
        self.planner
            .complete_all(done.iter().map(|c| (c.id, c.result.is_ok())))?;
        let completions = self.planner.take_completions();
        for id in &completions.finished_recving {
            let r = self.requests.get_mut(id).ok_or("loaded request vanished")?;
            let State::Loading { first, n } = r.state else {
                continue;
            };
            r.state = State::Admitted;
            let range = first..first + n;
            if range
                .clone()
                .any(|k| completions.load_error_blocks.contains(&r.table[k]))
            {
                // The copy failed: the request recomputes those tokens.
                self.counters.failed_loads += 1;
                continue;
            }
            for k in range {
                if self.device.holds(r.table[k], r.hashes[k]) {
                    self.counters.verified_blocks += 1;
                    self.counters.verified_bytes += BLOCK_BYTES as u64;
                    self.blocks.register(r.table[k], r.hashes[k]);
                } else {
                    self.counters.mismatched_blocks += 1;
                }
            }
            r.computed = (first + n) * BLOCK_TOKENS;
            self.counters.cpu_hit_tokens += (n * BLOCK_TOKENS) as u64;
        }
        for id in &completions.finished_sending {
            self.release(id)?;
        }
        Ok(())
    }

    /// Step 5: a request sampled its last token. Its user sends the next turn, which
    /// extends this conversation.
    fn finish(&mut self, id: &str) -> Result<(), BoxError> {
        let r = self
            .requests
            .get_mut(id)
            .ok_or("finished request vanished")?;
        let keep = self
            .planner
            .request_finished(id, r.hashes.as_slice(), r.computed)?;
        r.state = State::Draining;
        let (user, turn, history) = (r.user, r.turn, r.tokens.clone());
        if !keep {
            self.release(id)?;
        }
        if turn + 1 < TURNS {
            self.arrive(Request::new(user, turn + 1, history));
        }
        Ok(())
    }

    /// Frees a finished request's device blocks.
    fn release(&mut self, id: &str) -> Result<(), BoxError> {
        let r = self
            .requests
            .remove(id)
            .ok_or("released request vanished")?;
        self.blocks.free(&r.table);
        self.active.retain(|a| a != id);
        Ok(())
    }

    fn report(&self, elapsed: Duration) -> ExitCode {
        let c = &self.counters;
        let p = self.planner.stats();
        let e = self.engine.stats();
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let gib_per_s =
            |b: u64, d: Duration| b as f64 / d.as_secs_f64().max(1e-9) / f64::from(1 << 30);
        println!(
            "served {} requests ({USERS} users x {TURNS} turns) in {} steps, {:.1} ms",
            c.requests,
            c.steps,
            elapsed.as_secs_f64() * 1e3
        );
        println!(
            "device: {DEVICE_BLOCKS} blocks of {} KiB, {} cached blocks evicted; CPU tier: \
             {CPU_BLOCKS} blocks, {} evicted",
            BLOCK_BYTES / 1024,
            self.blocks.evictions,
            p.evicted_blocks
        );
        println!(
            "prompt tokens: {} = {} from the device prefix cache + {} loaded from CPU + {} \
             computed",
            c.prompt_tokens, c.device_hit_tokens, c.cpu_hit_tokens, c.computed_prompt_tokens
        );
        println!(
            "CPU tier: {} lookups, {} blocks stored, {} loaded, {} failed loads",
            p.lookups, p.stored_blocks, p.load_blocks, c.failed_loads
        );
        println!(
            "copies: {} jobs, {:.1} MiB stored + {:.1} MiB loaded, {:.2} GiB/s while in flight",
            e.jobs_succeeded + e.jobs_failed,
            mib(e.bytes_stored),
            mib(e.bytes_loaded),
            gib_per_s(e.bytes_stored + e.bytes_loaded, c.copy_busy)
        );
        if c.mismatched_blocks > 0 {
            println!(
                "FAILED: {} of {} reloaded blocks hold the wrong bytes",
                c.mismatched_blocks,
                c.mismatched_blocks + c.verified_blocks
            );
            return ExitCode::FAILURE;
        }
        if c.verified_blocks == 0 {
            println!("FAILED: no block was reloaded from CPU, so nothing was verified");
            return ExitCode::FAILURE;
        }
        println!(
            "verified {} bytes in {} reloaded blocks: every byte matches what was stored",
            c.verified_bytes, c.verified_blocks
        );
        ExitCode::SUCCESS
    }
}
