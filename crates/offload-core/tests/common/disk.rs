//! Disk tier fixtures: a scratch directory removed on drop, and a tier on a disk store
//! with distinctive block bytes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use offload_core::tier::disk::{capacity_for_blocks, DiskOptions, DiskStore};
use offload_core::tier::{KeySpace, LayoutFingerprint, RemoteTier, TierStats};

/// Fingerprint of the tests' layout.
pub const FP: LayoutFingerprint = LayoutFingerprint(0x5eed_d15c);
/// Bytes of a block hash, as the binding gives them.
pub const HASH_BYTES: usize = 16;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A fresh directory under the system temp dir, removed with its files on drop.
pub struct Scratch {
    pub dir: PathBuf,
}

impl Scratch {
    pub fn new(name: &str) -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("kvoffload-disk-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Self { dir }
    }

    /// A rank path inside the directory.
    pub fn rank_path(&self) -> PathBuf {
        self.dir.join("kv.rank_0")
    }

    /// The names of the files in the directory.
    pub fn files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.dir)
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Options for blocks of `block_bytes` in `slots` slots at `path`.
pub fn options(path: &Path, block_bytes: usize, slots: u64) -> DiskOptions {
    let capacity = capacity_for_blocks(slots, block_bytes as u64).expect("a capacity");
    DiskOptions::new(path, capacity, block_bytes as u64, FP)
}

/// Block `i`'s hash.
pub fn hash(i: u32) -> [u8; HASH_BYTES] {
    let mut h = [0u8; HASH_BYTES];
    h[..4].copy_from_slice(&i.to_le_bytes());
    h[15] = 0xa5;
    h
}

/// Block `i`'s bytes: every byte depends on `i` and its position.
pub fn block(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u32).wrapping_mul(2_654_435_761).wrapping_add(i * 97) as u8 ^ (j >> 8) as u8)
        .collect()
}

/// A block-level tier on `store`.
pub fn tier(store: &DiskStore) -> RemoteTier {
    RemoteTier::new(
        Box::new(store.clone()),
        KeySpace::new("test", FP).expect("namespace"),
        Arc::new(TierStats::default()),
    )
}

/// Stores blocks `ids` of `len` bytes through `t`; returns how many were written.
pub fn store_blocks(t: &mut RemoteTier, ids: impl IntoIterator<Item = u32>, len: usize) -> usize {
    let blocks: Vec<([u8; HASH_BYTES], Vec<Vec<u8>>)> = ids
        .into_iter()
        .map(|i| (hash(i), vec![block(i, len)]))
        .collect();
    t.store(&blocks).expect("store")
}

/// Which of blocks `ids` come back byte-exact (`None`: a miss).
pub fn fetch_blocks(t: &mut RemoteTier, ids: &[u32], len: usize) -> Vec<Option<bool>> {
    let hashes: Vec<[u8; HASH_BYTES]> = ids.iter().map(|&i| hash(i)).collect();
    t.fetch(&hashes, len)
        .expect("fetch")
        .into_iter()
        .zip(ids)
        .map(|(b, &i)| b.map(|b| b.payload() == block(i, len).as_slice()))
        .collect()
}

/// Fills blocks `ids` of `len` bytes through `t` the worker's way (`fetch_into`), each
/// destination cut at `cuts` (a CPU block's slices, one per layer region) and dirty
/// beforehand: `Some(true)` filled and byte-exact, `Some(false)` reported filled with a
/// wrong byte (never acceptable), `None` not filled.
pub fn fill_blocks(
    t: &mut RemoteTier,
    ids: &[u32],
    len: usize,
    cuts: &[usize],
) -> Vec<Option<bool>> {
    let hashes: Vec<[u8; HASH_BYTES]> = ids.iter().map(|&i| hash(i)).collect();
    let mut memory: Vec<Vec<u8>> = ids.iter().map(|_| vec![0xc3; len]).collect();
    let dests: Vec<Vec<&mut [u8]>> = memory.iter_mut().map(|m| split(m, cuts)).collect();
    let filled = t.fetch_into(&hashes, dests).expect("fetch_into");
    filled
        .into_iter()
        .zip(&memory)
        .zip(ids)
        .map(|((ok, m), &i)| ok.then(|| *m == block(i, len)))
        .collect()
}

/// `buf` cut at the offsets `cuts` (ascending, within it) into consecutive slices.
pub fn split<'a>(buf: &'a mut [u8], cuts: &[usize]) -> Vec<&'a mut [u8]> {
    let mut parts = Vec::with_capacity(cuts.len() + 1);
    let mut rest = buf;
    let mut at = 0;
    for &c in cuts {
        let (head, tail) = rest.split_at_mut(c - at);
        parts.push(head);
        rest = tail;
        at = c;
    }
    parts.push(rest);
    parts
}
