//! Transfer-engine fixtures: a fake device buffer, a device whose copies land when the test
//! says, and small helpers to run jobs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::transfer::{
    BackendError, Completion, CopyBackend, CopyRun, Direction, HostCopyBackend, RegionSpec, Ticket,
    TransferConfig, TransferEngine, TransferJob,
};
use offload_core::HostMemoryOptions;

use super::rng::Rng;

/// Long enough that a healthy engine never hits it.
pub const WAIT: Duration = Duration::from_secs(20);

/// Stand-in for device memory: a heap buffer touched only through its raw pointer, so the
/// copy thread's writes never alias a live Rust reference. Must outlive the engine (declare
/// it first).
#[derive(Debug)]
pub struct FakeGpu {
    ptr: *mut u8,
    len: usize,
}

impl FakeGpu {
    pub fn new(len: usize) -> Self {
        let ptr = Box::into_raw(vec![0u8; len].into_boxed_slice()).cast::<u8>();
        Self { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Only while no job touching this buffer is in flight.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` bytes; tests call this only when no copy touches them.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Only while no job touching this buffer is in flight.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and tests hold no other slice of it meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Fills the buffer with bytes drawn from `seed`.
    pub fn fill_random(&self, seed: u64) {
        Rng::new(seed).fill(self.bytes_mut());
    }

    /// Reads `len` bytes at `offset` through the raw pointer: allowed while copies into
    /// *other* bytes of the buffer run.
    pub fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.len);
        let mut out = vec![0u8; len];
        // SAFETY: in bounds; no copy writes these bytes (the caller's promise), and `out` is
        // a distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), len) };
        out
    }

    /// Writes `data` at `offset` through the raw pointer; same rule as [`read`](Self::read).
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds; no copy reads or writes these bytes (the caller's promise).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
    }

    pub fn region(&self, num_blocks: u32, bytes: usize, stride: usize) -> RegionSpec {
        assert!((num_blocks as usize - 1) * stride + bytes <= self.len);
        // SAFETY: the region lies inside this live buffer, which outlives the engine, and
        // tests access it only while no job on the accessed blocks is in flight.
        unsafe { RegionSpec::new(self.ptr as u64, num_blocks, bytes, stride) }
            .expect("valid region")
    }

    /// Block `id` of `spec` (a region of this buffer); same rule as [`bytes`](Self::bytes).
    pub fn block(&self, spec: &RegionSpec, id: u32) -> &[u8] {
        let start = id as usize * spec.block_stride();
        &self.bytes()[start..start + spec.block_bytes()]
    }
}

impl Drop for FakeGpu {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of this length.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// An engine config without the first-touch pass (tests allocate many small engines).
pub fn config() -> TransferConfig {
    TransferConfig {
        memory: HostMemoryOptions {
            first_touch: false,
            ..HostMemoryOptions::default()
        },
        ..TransferConfig::default()
    }
}

pub fn job(id: u64, direction: Direction, pairs: &[(u32, u32)]) -> TransferJob {
    TransferJob::new(id, direction, pairs.to_vec())
}

/// Submits `job` and waits for its completion.
pub fn run_one(engine: &TransferEngine, job: TransferJob) -> Completion {
    let id = job.id;
    engine.submit(job).expect("submit");
    let mut done = engine.wait_for(&[id], WAIT).expect("wait");
    assert_eq!(done.len(), 1);
    done.remove(0)
}

/// Polls until `n` completions arrived.
pub fn drain(engine: &TransferEngine, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} completions",
            out.len()
        );
        engine.poll_completions(&mut out);
        std::thread::sleep(Duration::from_millis(1));
    }
    out
}

/// A clock that only the test moves, in ticks.
#[derive(Debug, Clone, Default)]
pub struct Clock(Arc<AtomicU64>);

impl Clock {
    pub fn now(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    pub fn advance_to(&self, tick: u64) {
        self.0.fetch_max(tick, Ordering::AcqRel);
    }

    pub fn advance(&self, ticks: u64) {
        self.0.fetch_add(ticks, Ordering::AcqRel);
    }
}

/// A device whose copies take `latency` ticks of a test-driven [`Clock`]: `submit` only
/// records the runs, and the bytes land (on the inner backend, which may fail them) when a
/// `query` finds the clock at or past the due tick — as a DMA engine writes at the end of a
/// slow copy, not when it is queued. Test time, not machine speed, decides what is done.
#[derive(Debug)]
pub struct SlowDevice<B = HostCopyBackend> {
    inner: B,
    clock: Clock,
    latency: u64,
    pending: HashMap<u64, (u64, Direction, Vec<CopyRun>)>,
    next: u64,
    accepted: Arc<AtomicU64>,
}

impl SlowDevice {
    pub fn new(clock: Clock, latency: u64) -> Self {
        Self::wrapping(HostCopyBackend::new(), clock, latency)
    }
}

impl<B: CopyBackend> SlowDevice<B> {
    /// Delays `inner`'s copies.
    pub fn wrapping(inner: B, clock: Clock, latency: u64) -> Self {
        Self {
            inner,
            clock,
            latency,
            pending: HashMap::new(),
            next: 0,
            accepted: Arc::default(),
        }
    }

    /// Counts the jobs handed to this device so far (readable after it moved to the engine).
    pub fn accepted(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.accepted)
    }
}

impl<B: CopyBackend> CopyBackend for SlowDevice<B> {
    fn name(&self) -> &'static str {
        "slow"
    }

    unsafe fn submit(
        &mut self,
        direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError> {
        self.next += 1;
        let due = self.clock.now() + self.latency;
        self.pending
            .insert(self.next, (due, direction, runs.to_vec()));
        self.accepted.fetch_add(1, Ordering::Release);
        Ok(Ticket(self.next))
    }

    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
        let Some((due, _, _)) = self.pending.get(&ticket.0) else {
            return Err(BackendError::job(format!("unknown ticket {}", ticket.0)));
        };
        if self.clock.now() < *due {
            return Ok(false);
        }
        let Some((_, direction, runs)) = self.pending.remove(&ticket.0) else {
            return Ok(true);
        };
        // SAFETY: `submit`'s caller keeps every run valid until this query reports the
        // ticket done or failed, which is after this copy.
        let copied = unsafe { self.inner.submit(direction, &runs) }?;
        // The inner copy must be over before this ticket is: poll it here.
        loop {
            if self.inner.query(copied)? {
                return Ok(true);
            }
            std::thread::yield_now();
        }
    }
}
