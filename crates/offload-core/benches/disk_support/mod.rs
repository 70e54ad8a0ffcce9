//! What `benches/disk.rs` measures with: raw sequential I/O, the Python copy of Simple's
//! read loop, reads (into CPU blocks laid out as the CPU tier's) and writes through the
//! tier, and just enough JSON writing.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use offload_core::tier::disk::DiskStore;
use offload_core::tier::{KeySpace, LayoutFingerprint, RemoteTier, TierStats};
use offload_core::transfer::{HostBlocks, RegionSpec, TransferConfig, TransferEngine};

/// Bytes of one raw call (`dd bs=4M`).
pub(crate) const RAW_CHUNK: usize = 4 << 20;

const PY_SIMPLE_LOOP: &str = r#"
import mmap, os, sys, time
path, block, n, direct = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
slots = [mmap.mmap(-1, block) for _ in range(2)]
views = [[memoryview(s)] for s in slots]
t = time.perf_counter()
for i in range(n):
    got = os.preadv(fd, views[i % 2], i * block)
    if got < block:
        raise OSError("short read")
print(time.perf_counter() - t)
"#;

/// Seconds of CPU this thread has used: a rate per CPU second is a rate per core even
/// when other processes share the cores.
pub(crate) fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec the call fills.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

pub(crate) fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
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

/// GB/s of sequential I/O over `len` bytes of `path` in 4 MiB calls, `O_DIRECT` when
/// `direct`.
pub(crate) fn raw(path: &Path, len: u64, write: bool, direct: bool) -> f64 {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(if direct { libc::O_DIRECT } else { 0 })
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

/// GB/s of reads of `piece`-byte pieces of `path`, in order or shuffled, `threads` in
/// flight (as the tier spreads a batch over its I/O threads), nothing copied or checked:
/// what the device gives the tier's access pattern. The tier reads a batch stored
/// together as runs of consecutive slots, one I/O a run, and blocks asked for in another
/// order one slot at a time; on a device whose speed depends on the call's size or on
/// how many calls are in flight, these, not the 4 MiB sequential read, bound the tier.
pub(crate) fn raw_pieces(
    path: &Path,
    len: u64,
    piece: u64,
    threads: usize,
    direct: bool,
    shuffle: bool,
) -> f64 {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(if direct { libc::O_DIRECT } else { 0 })
        .open(path)
        .expect("open raw file");
    let count = len / piece;
    let order: Vec<u64> = if shuffle {
        shuffled(count, 11)
    } else {
        (0..count).collect()
    };
    let next = AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                let mut buf = Aligned::new(piece as usize);
                while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let n = f
                        .read_at(buf.buf(piece as usize), i * piece)
                        .expect("raw io");
                    assert_eq!(n, piece as usize, "raw io short");
                }
            });
        }
    });
    (order.len() as u64 * piece) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// GB/s of the Python copy of Simple's read loop over `n` blocks of `path`.
pub(crate) fn python_simple_loop(path: &Path, block: u64, n: u64, direct: bool) -> f64 {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args(["-c", PY_SIMPLE_LOOP])
        .arg(path)
        .arg(block.to_string())
        .arg(n.to_string())
        .arg(if direct { "1" } else { "0" })
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

/// Writes `path` out and drops it from the page cache, so the next read comes from the
/// device; its size.
pub(crate) fn drop_cached(path: &Path) -> u64 {
    let f = std::fs::File::open(path).expect("open to drop from the cache");
    f.sync_all().expect("sync");
    // SAFETY: a valid open descriptor; the call only advises the kernel.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise");
    f.metadata().expect("size").len()
}

pub(crate) fn hash(i: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&i.to_le_bytes());
    h
}

pub(crate) fn tier(store: &DiskStore) -> RemoteTier {
    RemoteTier::new(
        Box::new(store.clone()),
        KeySpace::new("bench", LayoutFingerprint(0xbe9c)).expect("namespace"),
        Arc::new(TierStats::default()),
    )
}

/// `0..n` in a seeded random order.
pub(crate) fn shuffled(n: u64, seed: u64) -> Vec<u64> {
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

/// Layer regions of the bench's CPU blocks: a block is one slice per region, as a
/// 32-layer model's (K and V of a layer together) lays it out in the CPU tier.
const REGIONS: usize = 32;

/// CPU blocks laid out as the CPU tier's, `blocks` of `block` bytes over [`REGIONS`]
/// regions (the last one takes what does not divide evenly): what the worker's fetches
/// fill. The engine keeps the "device" side, one block a region, alive with them.
pub(crate) struct CpuBlocks {
    pub(crate) blocks: HostBlocks,
    _engine: TransferEngine,
    _device: Vec<u8>,
}

impl CpuBlocks {
    pub(crate) fn new(block: usize, blocks: u32) -> Self {
        let regions = REGIONS.min(block);
        let part = block / regions;
        let sizes: Vec<usize> = (0..regions)
            .map(|r| {
                if r + 1 == regions {
                    block - part * r
                } else {
                    part
                }
            })
            .collect();
        let mut device = vec![0u8; block];
        let base = device.as_mut_ptr() as u64;
        let mut at = 0u64;
        let specs: Vec<RegionSpec> = sizes
            .iter()
            .map(|&len| {
                // SAFETY: each region is one block of `len` bytes inside `device`, which
                // outlives the engine (fields drop in order: the engine first); no copy
                // job is ever submitted.
                let spec = unsafe { RegionSpec::new(base + at, 1, len, len) }.expect("region");
                at += len as u64;
                spec
            })
            .collect();
        let engine = TransferEngine::new(specs, blocks, TransferConfig::default()).expect("engine");
        Self {
            blocks: engine.host_blocks(),
            _engine: engine,
            _device: device,
        }
    }
}

/// GB/s of payload read through the tier the worker's way (`fetch_into`: read, verify,
/// straight into the CPU blocks of `cpu`), `batch` blocks a fetch into CPU blocks
/// `0..batch`, as the worker fills the blocks the scheduler reserved.
pub(crate) fn tier_read(
    t: &mut RemoteTier,
    cpu: &CpuBlocks,
    order: &[u64],
    block: usize,
    batch: usize,
) -> f64 {
    let start = Instant::now();
    for chunk in order.chunks(batch) {
        let hashes: Vec<[u8; 16]> = chunk.iter().map(|&i| hash(i)).collect();
        let dests: Vec<Vec<&mut [u8]>> = (0..chunk.len() as u32)
            .map(|id| {
                // SAFETY: the bench is the only user of these blocks, and each id appears
                // once per fetch, so no two destinations alias.
                unsafe { cpu.blocks.block_parts_mut(id) }.expect("CPU block")
            })
            .collect();
        let got = t.fetch_into(&hashes, dests).expect("fetch");
        assert!(got.iter().all(|&ok| ok), "a block missed");
    }
    (order.len() * block) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// GB/s of payload written through the tier, blocks `ids`, `batch` blocks a store, from
/// CPU blocks as the worker writes behind (a block's layer slices: the `j`th block of a
/// store comes from CPU block `j`). The ids must be new to the tier: a block already
/// there is not written again.
pub(crate) fn tier_write(
    t: &mut RemoteTier,
    cpu: &CpuBlocks,
    ids: &[u64],
    block: usize,
    batch: usize,
) -> f64 {
    let start = Instant::now();
    for chunk in ids.chunks(batch) {
        let blocks: Vec<([u8; 16], Vec<&[u8]>)> = (0..chunk.len() as u32)
            .zip(chunk)
            .map(|(id, &i)| {
                // SAFETY: the bench is the only user of these blocks and nothing writes
                // them while they are stored; the slices are only read.
                let parts = unsafe { cpu.blocks.block_parts_mut(id) }.expect("CPU block");
                (hash(i), parts.into_iter().map(|p| &*p).collect())
            })
            .collect();
        assert_eq!(
            t.store(&blocks).expect("store"),
            chunk.len(),
            "a write skipped"
        );
    }
    (ids.len() * block) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Just enough JSON writing for objects of numbers, strings, lists and objects.
#[derive(Default)]
pub(crate) struct Obj(Vec<(String, String)>);

impl Obj {
    pub(crate) fn num(mut self, k: &str, v: f64) -> Self {
        self.0.push((k.into(), format!("{v}")));
        self
    }
    pub(crate) fn text(mut self, k: &str, v: &str) -> Self {
        self.0.push((k.into(), format!("{v:?}")));
        self
    }
    pub(crate) fn list(mut self, k: &str, v: &[f64]) -> Self {
        let items: Vec<String> = v.iter().map(|x| format!("{x}")).collect();
        self.0.push((k.into(), format!("[{}]", items.join(", "))));
        self
    }
    pub(crate) fn obj(mut self, k: &str, v: Obj) -> Self {
        self.0.push((k.into(), v.render()));
        self
    }
    pub(crate) fn objs(mut self, k: &str, v: Vec<Obj>) -> Self {
        let items: Vec<String> = v.iter().map(Obj::render).collect();
        self.0.push((k.into(), format!("[{}]", items.join(", "))));
        self
    }
    pub(crate) fn render(&self) -> String {
        let items: Vec<String> = self.0.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
        format!("{{{}}}", items.join(", "))
    }
}
