//! Disk tier bandwidth against the device's raw `O_DIRECT` sequential speed (what
//! `dd iflag=direct bs=4M` measures) and a Python loop doing Simple's one-`preadv`-at-a-
//! time reads with two buffer slots, all in one run on the same files; plus the checksum's
//! share of a read and the index rebuild at restart.
//!
//! Prints one JSON object (medians of `RUNS` interleaved runs, and every run). Settings by
//! environment: `KVOFFLOAD_BENCH_DIR` (default the temp dir: put it on the disk to
//! measure), `KVOFFLOAD_BENCH_BLOCK_BYTES` (2 MiB: a 16-token block of an 8B model in
//! bf16), `KVOFFLOAD_BENCH_BLOCKS` (128), `KVOFFLOAD_BENCH_REBUILD_BLOCKS` (100000; 0 skips),
//! `PYTHON` (python3).
//!
//!     cargo bench -p offload-core --bench disk > docs/benchmarks/disk_tier.json

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use offload_core::tier::disk::{DiskOptions, DiskStore};
use offload_core::tier::value::{decode, encode, encoded_len};
use offload_core::tier::{KeySpace, LayoutFingerprint, RemoteTier, TierStats};

const RUNS: usize = 5;
const RAW_CHUNK: usize = 4 << 20;
const BATCH: usize = 32;
const FP: LayoutFingerprint = LayoutFingerprint(0xbe9c);

const PY_SIMPLE_LOOP: &str = r#"
import mmap, os, sys, time
path, block, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
slots = [mmap.mmap(-1, block) for _ in range(2)]
views = [[memoryview(s)] for s in slots]
t = time.perf_counter()
for i in range(n):
    got = os.preadv(fd, views[i % 2], i * block)
    if got < block:
        raise OSError("short read")
print(time.perf_counter() - t)
"#;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Aligned(Vec<u8>, usize);

impl Aligned {
    fn new(len: usize) -> Self {
        let v = vec![0u8; len + 4096];
        let off = v.as_ptr().align_offset(4096);
        Self(v, off)
    }
    fn buf(&mut self, len: usize) -> &mut [u8] {
        &mut self.0[self.1..self.1 + len]
    }
}

/// GB/s of sequential `O_DIRECT` I/O over `len` bytes of `path` in 4 MiB calls.
fn raw(path: &Path, len: u64, write: bool) -> f64 {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open raw file");
    let mut buf = Aligned::new(RAW_CHUNK);
    buf.buf(RAW_CHUNK).fill(0x5a);
    let t = Instant::now();
    let mut off = 0;
    while off < len {
        let b = buf.buf(RAW_CHUNK);
        let n = if write {
            f.write_at(b, off)
        } else {
            f.read_at(b, off)
        }
        .expect("raw io");
        assert_eq!(n, RAW_CHUNK, "raw io short");
        off += RAW_CHUNK as u64;
    }
    len as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn python_simple_loop(path: &Path, block: u64, n: u64) -> f64 {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args(["-c", PY_SIMPLE_LOOP])
        .arg(path)
        .arg(block.to_string())
        .arg(n.to_string())
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let secs: f64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("seconds");
    (block * n) as f64 / secs / 1e9
}

fn hash(i: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&i.to_le_bytes());
    h
}

fn tier(store: &DiskStore) -> RemoteTier {
    RemoteTier::new(
        Box::new(store.clone()),
        KeySpace::new("bench", FP).expect("namespace"),
        Arc::new(TierStats::default()),
    )
}

fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut s = seed | 1;
    for i in (1..v.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
    v
}

/// GB/s of payload read through the tier (fetch: read, verify), in batches.
fn tier_read(t: &mut RemoteTier, order: &[u64], block: usize) -> f64 {
    let start = Instant::now();
    for chunk in order.chunks(BATCH) {
        let hashes: Vec<[u8; 16]> = chunk.iter().map(|&i| hash(i)).collect();
        let got = t.fetch(&hashes, block).expect("fetch");
        assert!(got.iter().all(Option::is_some), "a block missed");
    }
    (order.len() * block) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn tier_write(t: &mut RemoteTier, n: u64, payload: &[u8]) -> f64 {
    let start = Instant::now();
    let ids: Vec<u64> = (0..n).collect();
    for chunk in ids.chunks(BATCH) {
        let blocks: Vec<([u8; 16], Vec<&[u8]>)> =
            chunk.iter().map(|&i| (hash(i), vec![payload])).collect();
        assert_eq!(t.store(&blocks).expect("store"), chunk.len());
    }
    (n as usize * payload.len()) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn rebuild(dir: &Path, blocks: u64) -> serde_like::Obj {
    let block = 4000usize;
    let value = encoded_len(16, block) as u64;
    let cap = 4096 + 2 * blocks * (4096 + 64);
    let path = dir.join("rebuild.rank_0");
    let mut opts = DiskOptions::new(&path, cap, value, FP);
    opts.persist = true;
    let payload = vec![7u8; block];
    {
        let store = DiskStore::open(&opts).expect("open");
        let mut t = tier(&store);
        let ids: Vec<u64> = (0..blocks).collect();
        for chunk in ids.chunks(256) {
            let b: Vec<([u8; 16], Vec<&[u8]>)> = chunk
                .iter()
                .map(|&i| (hash(i), vec![&payload[..]]))
                .collect();
            t.store(&b).expect("store");
        }
    }
    let t = Instant::now();
    let store = DiskStore::open(&opts).expect("reopen");
    let secs = t.elapsed().as_secs_f64();
    let recovered = store.snapshot().recovered_blocks;
    let rebuild_s = store.snapshot().rebuild_micros as f64 / 1e6;
    opts.persist = false;
    drop(store);
    drop(DiskStore::open(&opts).expect("wipe"));
    serde_like::Obj::default()
        .num("blocks", recovered as f64)
        .num("open_seconds", secs)
        .num("rebuild_seconds", rebuild_s)
        .num("seconds_per_100k", secs * 1e5 / recovered.max(1) as f64)
}

/// Just enough JSON writing for flat objects of numbers, strings and lists.
mod serde_like {
    #[derive(Default)]
    pub(super) struct Obj(Vec<(String, String)>);
    impl Obj {
        pub(super) fn num(mut self, k: &str, v: f64) -> Self {
            self.0.push((k.into(), format!("{v}")));
            self
        }
        pub(super) fn text(mut self, k: &str, v: &str) -> Self {
            self.0.push((k.into(), format!("{v:?}")));
            self
        }
        pub(super) fn list(mut self, k: &str, v: &[f64]) -> Self {
            let items: Vec<String> = v.iter().map(|x| format!("{x}")).collect();
            self.0.push((k.into(), format!("[{}]", items.join(", "))));
            self
        }
        pub(super) fn obj(mut self, k: &str, v: Obj) -> Self {
            self.0.push((k.into(), v.render()));
            self
        }
        pub(super) fn render(&self) -> String {
            let items: Vec<String> = self.0.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
            format!("{{{}}}", items.join(", "))
        }
    }
}

fn main() {
    let dir = PathBuf::from(
        std::env::var("KVOFFLOAD_BENCH_DIR")
            .unwrap_or_else(|_| std::env::temp_dir().display().to_string()),
    )
    .join(format!("kvoffload-disk-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("bench dir");
    let block = env_u64("KVOFFLOAD_BENCH_BLOCK_BYTES", 2 << 20) as usize;
    let n = env_u64("KVOFFLOAD_BENCH_BLOCKS", 128);
    let value = encoded_len(16, block) as u64;
    let slot = value.div_ceil(4096) * 4096;
    let raw_len = (n * block as u64).div_ceil(RAW_CHUNK as u64) * RAW_CHUNK as u64;
    let raw_path = dir.join("raw");
    let py_path = dir.join("simple");
    let py_block = (block as u64).div_ceil(4096) * 4096;
    let payload: Vec<u8> = (0..block).map(|i| (i * 31 % 251) as u8).collect();
    // Twice the blocks: a block's set is chosen by its hash, so a full set evicts before
    // the whole capacity is used (see `layout`).
    let opts = DiskOptions::new(dir.join("kv.rank_0"), 4096 + 2 * n * (slot + 64), value, FP);
    let store = DiskStore::open(&opts).expect("open the tier");
    let mut t = tier(&store);
    let names = [
        "raw_write",
        "tier_write",
        "raw_read",
        "tier_read_seq",
        "tier_read_shuffled",
        "python_simple_read",
    ];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    // The Python loop's file: the raw file's first n blocks, aligned as Simple lays them.
    raw(
        &py_path,
        (n * py_block).div_ceil(RAW_CHUNK as u64) * RAW_CHUNK as u64,
        true,
    );
    for run in 0..RUNS {
        runs[0].push(raw(&raw_path, raw_len, true));
        runs[1].push(tier_write(&mut t, n, &payload));
        runs[2].push(raw(&raw_path, raw_len, false));
        let seq: Vec<u64> = (0..n).collect();
        runs[3].push(tier_read(&mut t, &seq, block));
        runs[4].push(tier_read(&mut t, &shuffled(n, run as u64 + 1), block));
        runs[5].push(python_simple_loop(&py_path, py_block, n));
    }
    // The checksum's share of a read: verifying values already in memory.
    let values: Vec<Vec<u8>> = (0..n).map(|i| encode(FP, &hash(i), &[&payload])).collect();
    let started = Instant::now();
    for (i, v) in values.iter().enumerate() {
        decode(v, FP, &hash(i as u64), block).expect("valid");
    }
    let verify_gbps = (n as usize * block) as f64 / started.elapsed().as_secs_f64() / 1e9;
    let snap = store.snapshot();
    drop(t);
    drop(store);
    let rebuild_blocks = env_u64("KVOFFLOAD_BENCH_REBUILD_BLOCKS", 100_000);
    let mut out = serde_like::Obj::default()
        .num("block_bytes", block as f64)
        .num("blocks", n as f64)
        .num("runs", RUNS as f64)
        .num("batch", BATCH as f64)
        .num("direct_io", if snap.buffered_io == 0 { 1.0 } else { 0.0 })
        .text("dir", &dir.display().to_string());
    let mut medians = serde_like::Obj::default();
    let mut all = serde_like::Obj::default();
    let mut med = Vec::new();
    for (name, v) in names.iter().zip(runs.iter_mut()) {
        all = all.list(name, v);
        let m = median(v);
        med.push(m);
        medians = medians.num(&format!("{name}_gbps"), m);
    }
    medians = medians.num("verify_gbps", verify_gbps);
    out = out.obj("medians", medians).obj("runs_gbps", all);
    let ratios = serde_like::Obj::default()
        .num("read_seq_vs_raw", med[3] / med[2])
        .num("read_shuffled_vs_raw", med[4] / med[2])
        .num("write_vs_raw", med[1] / med[0])
        .num("read_vs_python_simple", med[3] / med[5])
        .num("checksum_share_of_read", med[3] / verify_gbps);
    out = out.obj("ratios", ratios);
    if rebuild_blocks > 0 {
        out = out.obj("rebuild", rebuild(&dir, rebuild_blocks));
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}", out.render());
}
