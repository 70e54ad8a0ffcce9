//! Index benchmarks: lookup (hit and miss), insert, evict-and-insert and pin/unpin, over
//! the prefix index alone and over the block cache (pool + index + LRU kept consistent).
//!
//! Every case sets `Throughput::Elements`, so criterion's `thrpt` line is operations per
//! second (one element = one key looked up, inserted, evicted or pinned). A one-line
//! `ns/op` and `M ops/s` summary per case is printed too. Sizes: the CPU pool of the
//! scheduler benchmark (48,505 blocks) and a 1 Mi-block pool (a 64 GiB tier of 64 KiB
//! blocks), whose map no longer fits in the CPU caches.
//!
//! Run: `cargo bench -p offload-core --bench index` (add `-- --measurement-time 2` on a
//! small machine; `-- --test` runs each case once as a smoke test).
// criterion's macros generate undocumented public items.
#![allow(missing_docs)]

mod common;

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::Rng;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use offload_core::{BlockCache, BlockHash, BlockKey, EvictionPolicy, Lru, PrefixIndex};

/// Pool sizes: the scheduler benchmark's CPU pool, and a big one.
const SIZES: [u32; 2] = [48_505, 1 << 20];
/// Keys per timed batch, so the loop overhead and `Instant` reads vanish.
const BATCH: usize = 4096;
/// The prefix length of the Python comparison (`benches/compare_index.py`).
const PREFIX: usize = 128;

/// Median ns per op of the samples one case took.
fn report(name: &str, samples: Mutex<Vec<f64>>) {
    let mut s = samples.into_inner().expect("samples");
    s.sort_by(f64::total_cmp);
    if let Some(ns) = s.get(s.len() / 2) {
        println!("{name}: {ns:.1} ns/op, {:.1} M ops/s", 1e3 / ns);
    }
}

/// Times `op` over `iters` batches of `per_iter` operations, recording ns/op.
fn timed(samples: &Mutex<Vec<f64>>, iters: u64, per_iter: usize, mut op: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        op();
    }
    let d = start.elapsed();
    samples
        .lock()
        .expect("samples")
        .push(d.as_nanos() as f64 / iters as f64 / per_iter as f64);
    d
}

/// A cache of `cap` blocks, every one published under a key of `keys` (`Ready`, evictable).
fn full_cache(cap: u32, keys: &[BlockKey]) -> BlockCache {
    let mut cache = BlockCache::new(cap, false);
    for k in keys {
        let b = cache.reserve(*k).expect("a free block");
        cache.publish(b).expect("publish");
    }
    cache
}

fn lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("index/lookup");
    g.throughput(Throughput::Elements(BATCH as u64));
    for &cap in &SIZES {
        let mut rng = Rng(u64::from(cap));
        let keys = rng.keys(cap as usize);
        let mut index = PrefixIndex::with_capacity(cap as usize);
        for (i, k) in keys.iter().enumerate() {
            index.insert(*k, i as u32);
        }
        // Probe streams: every key once in an order unrelated to insertion (the whole
        // map is touched, as a pool's worth of distinct prefixes would), a hot set of
        // BATCH keys looked up again and again, and keys never inserted.
        let mut uniform = keys.clone();
        for i in (1..uniform.len()).rev() {
            uniform.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        let hot: Vec<BlockKey> = uniform[..BATCH].to_vec();
        let misses = rng.keys(cap as usize);
        for (label, probe) in [("hit", &uniform), ("hit_hot", &hot), ("miss", &misses)] {
            let samples = Mutex::new(Vec::new());
            let mut at = 0;
            g.bench_function(BenchmarkId::new(label, cap), |b| {
                b.iter_custom(|iters| {
                    timed(&samples, iters, BATCH, || {
                        if at + BATCH > probe.len() {
                            at = 0;
                        }
                        for k in &probe[at..at + BATCH] {
                            black_box(index.get(black_box(k)));
                        }
                        at += BATCH;
                    })
                });
            });
            report(&format!("index/lookup/{label}/{cap}"), samples);
        }
    }
    g.finish();

    // A request's prefix through the cache: the longest run of ready blocks (128 lookups
    // plus a state check each), as `Planner::lookup` does it.
    let mut g = c.benchmark_group("cache/ready_prefix");
    g.throughput(Throughput::Elements(PREFIX as u64));
    for &cap in &SIZES {
        let mut rng = Rng(7 + u64::from(cap));
        let keys = rng.keys(cap as usize);
        let cache = full_cache(cap, &keys);
        // Every 128-key chunk of the pool is one prefix; each iteration asks for the next.
        let hashes: Vec<BlockHash> = keys.iter().map(|k| k.hash).collect();
        let prefixes: Vec<&[BlockHash]> = hashes.chunks_exact(PREFIX).collect();
        let samples = Mutex::new(Vec::new());
        let mut at = 0;
        g.bench_function(BenchmarkId::new("hit128", cap), |b| {
            b.iter_custom(|iters| {
                timed(&samples, iters, PREFIX, || {
                    at = (at + 1) % prefixes.len();
                    assert_eq!(cache.ready_prefix(0, black_box(prefixes[at])), PREFIX);
                })
            });
        });
        report(&format!("cache/ready_prefix/hit128/{cap}"), samples);
    }
    g.finish();
}

fn insert(c: &mut Criterion) {
    let mut g = c.benchmark_group("index/insert");
    for &cap in &SIZES {
        g.throughput(Throughput::Elements(u64::from(cap)));
        let keys = Rng(11).keys(cap as usize);
        // Filling an empty, pre-sized index with a pool's worth of keys (the index never
        // reallocates); the clear between iterations is not timed.
        let mut index = PrefixIndex::with_capacity(cap as usize);
        let samples = Mutex::new(Vec::new());
        g.bench_function(BenchmarkId::new("fill", cap), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    index.clear();
                    let start = Instant::now();
                    for (i, k) in keys.iter().enumerate() {
                        black_box(index.insert(*k, i as u32));
                    }
                    total += start.elapsed();
                }
                samples
                    .lock()
                    .expect("samples")
                    .push(total.as_nanos() as f64 / iters as f64 / f64::from(cap));
                total
            });
        });
        report(&format!("index/insert/fill/{cap}"), samples);
    }
    g.finish();

    // A store into a pool with free blocks: reserve (alloc + index insert) then publish
    // (ready + LRU insert). The batch of blocks is returned untimed by evicting them.
    let mut g = c.benchmark_group("cache/store");
    g.throughput(Throughput::Elements(BATCH as u64));
    let cap = SIZES[0];
    let mut rng = Rng(13);
    let samples = Mutex::new(Vec::new());
    g.bench_function(BenchmarkId::new("reserve_publish_free", cap), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut cache = BlockCache::new(BATCH as u32, false);
                let keys = rng.keys(BATCH);
                let start = Instant::now();
                for k in &keys {
                    let block = cache.reserve(*k).expect("a free block");
                    cache.publish(block).expect("publish");
                }
                total += start.elapsed();
                black_box(&cache);
            }
            samples
                .lock()
                .expect("samples")
                .push(total.as_nanos() as f64 / iters as f64 / BATCH as f64);
            total
        });
    });
    report(
        &format!("cache/store/reserve_publish_free/{}", BATCH),
        samples,
    );
    g.finish();
}

fn evict_insert(c: &mut Criterion) {
    // Steady state of a full pool: each store evicts the least recently used block
    // (index remove + LRU pop) and takes it for a new key (index insert), then publishes.
    let mut g = c.benchmark_group("cache/evict_insert");
    g.throughput(Throughput::Elements(BATCH as u64));
    for &cap in &SIZES {
        let mut rng = Rng(17 + u64::from(cap));
        let keys = rng.keys(cap as usize);
        let mut cache = full_cache(cap, &keys);
        let samples = Mutex::new(Vec::new());
        g.bench_function(BenchmarkId::new("reserve_publish", cap), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let batch = rng.keys(BATCH);
                    let start = Instant::now();
                    for k in &batch {
                        let block = cache.reserve(*k).expect("an evictable block");
                        cache.publish(block).expect("publish");
                    }
                    total += start.elapsed();
                }
                samples
                    .lock()
                    .expect("samples")
                    .push(total.as_nanos() as f64 / iters as f64 / BATCH as f64);
                total
            });
        });
        assert_eq!(cache.num_evictable(), cap as usize);
        report(
            &format!("cache/evict_insert/reserve_publish/{cap}"),
            samples,
        );
    }
    g.finish();
}

fn pin_unpin(c: &mut Criterion) {
    // A lookup pins its hit (ref count + out of the LRU) and the load's completion unpins
    // it (back in as most recently used): one element = one pin plus one unpin.
    let mut g = c.benchmark_group("cache/pin_unpin");
    g.throughput(Throughput::Elements(BATCH as u64));
    for &cap in &SIZES {
        let mut rng = Rng(19 + u64::from(cap));
        let keys = rng.keys(cap as usize);
        let mut cache = full_cache(cap, &keys);
        // Blocks in random order, each once per pass over the pool.
        let mut blocks: Vec<u32> = (0..cap).collect();
        for i in (1..blocks.len()).rev() {
            blocks.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        let samples = Mutex::new(Vec::new());
        let mut at = 0;
        g.bench_function(BenchmarkId::new("block", cap), |b| {
            b.iter_custom(|iters| {
                timed(&samples, iters, BATCH, || {
                    if at + BATCH > blocks.len() {
                        at = 0;
                    }
                    for &blk in &blocks[at..at + BATCH] {
                        cache.pin(black_box(blk)).expect("pin");
                        cache.unpin(blk).expect("unpin");
                    }
                    at += BATCH;
                })
            });
        });
        report(&format!("cache/pin_unpin/block/{cap}"), samples);

        // A 128-block prefix: pin all, then unpin all (the hit's life in the planner).
        let samples = Mutex::new(Vec::new());
        let mut at = 0;
        g.throughput(Throughput::Elements(PREFIX as u64));
        g.bench_function(BenchmarkId::new("prefix128", cap), |b| {
            b.iter_custom(|iters| {
                timed(&samples, iters, PREFIX, || {
                    if at + PREFIX > blocks.len() {
                        at = 0;
                    }
                    let prefix = &blocks[at..at + PREFIX];
                    for &blk in prefix {
                        cache.pin(black_box(blk)).expect("pin");
                    }
                    for &blk in prefix {
                        cache.unpin(blk).expect("unpin");
                    }
                    at += PREFIX;
                })
            });
        });
        report(&format!("cache/pin_unpin/prefix128/{cap}"), samples);
        g.throughput(Throughput::Elements(BATCH as u64));
    }
    g.finish();

    // The LRU alone: move a block to the most recently used end.
    let mut g = c.benchmark_group("lru/touch");
    g.throughput(Throughput::Elements(BATCH as u64));
    let cap = SIZES[1];
    let mut lru = Lru::new(cap);
    for b in 0..cap {
        lru.insert(b);
    }
    let mut rng = Rng(23);
    let blocks: Vec<u32> = (0..BATCH)
        .map(|_| (rng.next() % u64::from(cap)) as u32)
        .collect();
    let samples = Mutex::new(Vec::new());
    g.bench_function(BenchmarkId::new("remove_insert", cap), |b| {
        b.iter_custom(|iters| {
            timed(&samples, iters, BATCH, || {
                for &blk in &blocks {
                    lru.remove(black_box(blk));
                    lru.insert(blk);
                }
            })
        });
    });
    report(&format!("lru/touch/remove_insert/{cap}"), samples);
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = lookup, insert, evict_insert, pin_unpin
}
criterion_main!(benches);
