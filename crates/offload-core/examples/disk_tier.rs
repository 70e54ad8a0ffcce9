//! The disk tier from Rust: blocks stored on the CPU tier are written to local files,
//! a restarted "engine" (a new transfer engine and a new disk store on the same files,
//! `persist` on) finds them, fetches them into its CPU blocks, loads them to its device,
//! and every byte is checked against what the first engine had.
//!
//! ```text
//! cargo run --release -p offload-core --example disk_tier [DIR]
//! ```
//!
//! The pieces are the remote tier's: a [`DiskStore`] is a `RemoteStore`, a
//! [`RemoteTier`] gives it keys and value checks, and a [`WorkerTier`] writes stored CPU
//! blocks behind and fetches planned ones (what the vLLM connector's workers run). A
//! scheduler attaches the same tier to its planner with
//! `Planner::attach_remote(ProbeQueue::spawn(tier)?, stats)`, the tier built on a
//! [`DiskProbe`] of rank 0's files (scheduler and workers may be different processes).
//! Exits non-zero if any byte differs.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::disk::{DiskOptions, DiskProbe, DiskStore};
use offload_core::tier::{FetchRequest, KeySpace, KvLayout, RemoteTier, TierStats, WorkerTier};
use offload_core::transfer::{Direction, RegionSpec, TransferConfig, TransferEngine, TransferJob};

const BLOCKS: u32 = 64;
/// No multiple of 4 KiB: the tier pads slots, not blocks.
const BLOCK_BYTES: usize = 40_000;
const WAIT: Duration = Duration::from_secs(30);

type BoxError = Box<dyn std::error::Error>;

fn layout() -> KvLayout {
    KvLayout {
        model_id: "example/model".into(),
        dtype: "bfloat16".into(),
        block_size: 16,
        num_layers: 4,
        num_kv_heads: 2,
        head_size: 64,
        tp_rank: 0,
        tp_size: 1,
        kv_cache_group: 0,
        hash_algo: "sha256".into(),
        none_hash_seed: "vllm-none-hash".into(),
        // A restart with other weights must not find these blocks: the digest of the
        // checkpoint that computed them (here a made-up one).
        weights: "sha256:example-checkpoint".into(),
    }
}

fn hash(i: u32) -> Vec<u8> {
    let mut h = vec![0u8; 16];
    h[..4].copy_from_slice(&i.to_le_bytes());
    h[8] = 0xd1;
    h
}

/// A transfer engine over `device` (one region of `BLOCKS` blocks) with `BLOCKS` CPU blocks.
fn engine(device: &mut [u8]) -> Result<TransferEngine, BoxError> {
    // SAFETY: `device` outlives the engine (dropped before it in `main`) and is only
    // read back after the engine's copies completed.
    let region =
        unsafe { RegionSpec::new(device.as_mut_ptr() as u64, BLOCKS, BLOCK_BYTES, BLOCK_BYTES)? };
    Ok(TransferEngine::new(
        vec![region],
        BLOCKS,
        TransferConfig::default(),
    )?)
}

fn tier(store: DiskStore, stats: &Arc<TierStats>) -> Result<RemoteTier, BoxError> {
    let keys = KeySpace::new("example", layout().fingerprint())?;
    Ok(RemoteTier::new(Box::new(store), keys, Arc::clone(stats)))
}

fn main() -> Result<ExitCode, BoxError> {
    let dir = std::env::args().nth(1).map_or_else(
        || std::env::temp_dir().join("kvoffload-disk-example"),
        Into::into,
    );
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("kv.rank_0");
    let mut opts = DiskOptions::new(&path, 64 << 20, BLOCK_BYTES as u64, layout().fingerprint());
    opts.persist = true;

    // Engine A: device blocks -> CPU blocks -> written behind to disk.
    let mut dev_a: Vec<u8> = (0..BLOCKS as usize * BLOCK_BYTES)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
        .collect();
    let a = engine(&mut dev_a)?;
    let pairs: Vec<(u32, u32)> = (0..BLOCKS).map(|i| (i, i)).collect();
    a.submit(TransferJob::new(1, Direction::Store, pairs))?;
    a.wait_for(&[1], WAIT)?;
    let store = DiskStore::open(&opts)?;
    let stats = Arc::new(TierStats::default());
    let mut wa = WorkerTier::spawn(
        a.host_blocks(),
        tier(store.clone(), &stats)?,
        Some(tier(store.clone(), &stats)?),
        256 << 20,
    )?;
    let hashes: Vec<Vec<u8>> = (0..BLOCKS).map(hash).collect();
    let ids: Vec<u32> = (0..BLOCKS).collect();
    // SAFETY: the store completed and nothing else touches engine A's CPU blocks.
    let taken = unsafe { wa.write_stored(&hashes, &ids) };
    wa.shutdown(WAIT);
    let written = store.snapshot();
    drop(store);
    drop(a);
    println!(
        "engine A: {taken} blocks offered, {} written ({} bytes)",
        written.writes, written.bytes_written
    );

    // A scheduler's view: which blocks of the chain are on disk.
    let keys = KeySpace::new("example", layout().fingerprint())?;
    let probe = DiskProbe::new(&path, layout().fingerprint());
    let mut scheduler_tier = RemoteTier::new(Box::new(probe), keys, Arc::new(TierStats::default()));
    let on_disk = scheduler_tier.probe_chain(&hashes)?;

    // Engine B (a restart): recovers the index, fetches into CPU blocks in reverse order,
    // loads them to its device.
    let started = Instant::now();
    let store = DiskStore::open(&opts)?;
    let recovered = store.snapshot().recovered_blocks;
    let open_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut dev_b = vec![0u8; dev_a.len()];
    let b = engine(&mut dev_b)?;
    let stats_b = Arc::new(TierStats::default());
    let mut wb = WorkerTier::spawn(b.host_blocks(), tier(store.clone(), &stats_b)?, None, 0)?;
    let cpu: Vec<u32> = (0..BLOCKS).rev().collect();
    let req = FetchRequest {
        id: 9,
        hashes: hashes.clone(),
        cpu_blocks: cpu.clone(),
    };
    let started = Instant::now();
    // SAFETY: engine B's CPU blocks are used by nothing else until the report.
    unsafe { wb.fetch(req) };
    let filled = loop {
        if let Some((_, n)) = wb.take_reports().first() {
            break *n;
        }
        if started.elapsed() > WAIT {
            return Err("the fetch never reported".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let fetch_s = started.elapsed().as_secs_f64();
    let pairs: Vec<(u32, u32)> = (0..BLOCKS).map(|i| (i, cpu[i as usize])).collect();
    b.submit(TransferJob::new(2, Direction::Load, pairs))?;
    b.wait_for(&[2], WAIT)?;
    wb.shutdown(WAIT);
    drop(b);
    let same = dev_a == dev_b;
    println!(
        "scheduler probe: {on_disk}/{BLOCKS} on disk; engine B: {recovered} blocks recovered \
         in {open_ms:.1} ms, {filled} fetched in {:.1} ms ({:.2} GB/s), direct I/O: {}",
        fetch_s * 1e3,
        (filled * BLOCK_BYTES) as f64 / fetch_s / 1e9,
        store.is_direct()
    );
    // The example's files: removed by a store without `persist` when it closes.
    drop(store);
    opts.persist = false;
    drop(DiskStore::open(&opts)?);
    let _ = std::fs::remove_dir(&dir);
    if same && filled == BLOCKS as usize {
        println!("every byte of {BLOCKS} blocks matched");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("MISMATCH: bytes differ or blocks missing");
        Ok(ExitCode::FAILURE)
    }
}
