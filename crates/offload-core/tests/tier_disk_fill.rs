//! Fetching blocks straight into the caller's memory (`RemoteTier::fetch_into`, the
//! worker's path): byte-exact fills across a CPU block's slices with `O_DIRECT` and the
//! page cache, and no block reported filled unless every check passed.

#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::FileExt;

use common::disk::{block, fill_blocks, hash, options, store_blocks, tier, Scratch, FP};
use offload_core::tier::disk::DiskStore;
use offload_core::tier::value::encode;
use offload_core::tier::{
    BlockFill, Fill, KeySpace, MemoryStore, RemoteStore, RemoteTier, StackedStore, TierStats,
    ValueParts,
};
use offload_core::transfer::FaultPlan;

/// A block size that is no multiple of 4 KiB (nor of 8).
const ODD: usize = 5003;
/// Slices of an `ODD` block: uneven, one of a single byte, across a 4 KiB edge.
const CUTS: [usize; 4] = [1, 7, 4099, 4100];

fn key(i: u32) -> offload_core::tier::RemoteKey {
    KeySpace::new("test", FP).unwrap().key(&hash(i)).unwrap()
}

fn open(s: &Scratch, len: usize, page_cache: bool, faults: &str) -> DiskStore {
    let mut o = options(&s.rank_path(), len, 16);
    o.use_page_cache = page_cache;
    o.faults = FaultPlan::parse(faults).unwrap();
    o.io_threads = 1;
    DiskStore::open(&o).unwrap()
}

#[test]
fn fills_are_byte_exact_across_slices_direct_and_buffered() {
    for page_cache in [false, true] {
        for (len, cuts) in [(ODD, &CUTS[..]), (ODD, &[][..]), (2 * 4096, &[4096][..])] {
            let s = Scratch::new("fill");
            let store = open(&s, len, page_cache, "");
            let mut t = tier(&store);
            assert_eq!(store_blocks(&mut t, 0..6, len), 6);
            let got = fill_blocks(&mut t, &[3, 0, 5, 1, 2, 4, 7], len, cuts);
            assert_eq!(
                got,
                [
                    Some(true),
                    Some(true),
                    Some(true),
                    Some(true),
                    Some(true),
                    Some(true),
                    None
                ],
                "len {len} cuts {cuts:?} page_cache {page_cache}"
            );
            let snap = store.snapshot();
            assert_eq!((snap.reads, snap.checksum_failures), (6, 0));
            let tier_snap = t.stats().snapshot();
            assert_eq!((tier_snap.get_hits, tier_snap.get_misses), (6, 1));
            assert_eq!(tier_snap.bytes_read, 6 * len as u64);
            // Destinations of another block size: through `get`, rejected as `fetch` does.
            assert_eq!(fill_blocks(&mut t, &[0], len - 1, &[]), [None]);
            assert_eq!(t.stats().snapshot().corrupt_values, 1);
        }
    }
}

#[test]
fn a_damaged_payload_or_entry_is_never_reported_filled() {
    for page_cache in [false, true] {
        let s = Scratch::new("fill-corrupt");
        let mut store = open(&s, ODD, page_cache, "");
        let mut t = tier(&store);
        assert_eq!(store_blocks(&mut t, 0..4, ODD), 4);
        // Block 4's key holds a sound value of block 9: every checksum holds, the entry
        // names another block's hash.
        let stray = encode(FP, &hash(9), &[&block(9, ODD)]);
        assert!(store.put(&[(key(4), stray)])[0].is_ok());
        let data = store.open_data_file().unwrap();
        let idx = std::fs::OpenOptions::new()
            .write(true)
            .open(store.index_path())
            .unwrap();
        let entry = |i: u32| store.entry_offset_of(&key(i)).unwrap();
        // A payload byte, in the second slice.
        data.write_all_at(&[0x00], store.offset_of(&key(0)).unwrap() + 3000)
            .unwrap();
        // A byte of the entry's block hash.
        idx.write_all_at(&[0x77], entry(1) + 48 + 3).unwrap();
        // The entry's payload checksum.
        idx.write_all_at(&[0x42; 8], entry(2) + 40).unwrap();
        let got = fill_blocks(&mut t, &[0, 1, 2, 3, 4], ODD, &CUTS);
        assert_eq!(
            got,
            [None, None, None, Some(true), None],
            "page_cache {page_cache}"
        );
        let snap = store.snapshot();
        // Three caught by the store's checks, the stray value by the entry's hash; all
        // four slots freed.
        assert_eq!(snap.checksum_failures, 4);
        assert_eq!(snap.resident_blocks, 1);
        assert_eq!(t.stats().snapshot().corrupt_values, 1);
        for i in [0, 1, 2, 4] {
            assert!(store.offset_of(&key(i)).is_none(), "block {i}'s slot freed");
        }
        // A truncated file: a short read, not a fill.
        data.set_len(0).unwrap();
        assert_eq!(fill_blocks(&mut t, &[3], ODD, &CUTS), [None]);
        assert_eq!(store.snapshot().errors_short, 1);
        assert_eq!(t.stats().snapshot().failed_keys, 1);
    }
}

#[test]
fn injected_read_faults_are_unfilled_and_counted() {
    for page_cache in [false, true] {
        let s = Scratch::new("fill-faults");
        let faults = "disk_read_eio_every=3,disk_short_read_every=4,disk_corrupt_read_every=5";
        let store = open(&s, ODD, page_cache, faults);
        let mut t = tier(&store);
        assert_eq!(store_blocks(&mut t, 0..6, ODD), 6);
        // One block a fetch, so one read each (a fetch of consecutive blocks is one read
        // with O_DIRECT): reads 3 (EIO), 4 (short) and 5 (a flipped byte) fail; the rest
        // are exact.
        let got: Vec<Option<bool>> = (0..5)
            .flat_map(|i| fill_blocks(&mut t, &[i], ODD, &CUTS))
            .collect();
        assert_eq!(
            got,
            [Some(true), Some(true), None, None, None],
            "page_cache {page_cache}"
        );
        let snap = store.snapshot();
        assert_eq!(
            (snap.errors_eio, snap.errors_short, snap.checksum_failures),
            (1, 1, 1)
        );
        assert_eq!(t.stats().snapshot().failed_keys, 2);
    }
}

#[test]
fn a_store_without_its_own_fill_fills_through_get() {
    let remote = MemoryStore::default();
    let keys = KeySpace::new("test", FP).unwrap();
    let mut t = RemoteTier::new(Box::new(remote.clone()), keys, Default::default());
    let blocks: Vec<_> = (0..3u32).map(|i| (hash(i), vec![block(i, ODD)])).collect();
    assert_eq!(t.store(&blocks).unwrap(), 3);
    // Block 1 damaged in the store: the default fill sums it (the memory store does not).
    let mut bad = encode(FP, &hash(1), &[&block(1, ODD)]);
    bad[100] ^= 1;
    remote.set_raw(key(1), bad);
    let got = fill_blocks(&mut t, &[0, 1, 2, 5], ODD, &CUTS);
    assert_eq!(got, [Some(true), None, Some(true), None]);
    let snap = t.stats().snapshot();
    assert_eq!(
        (snap.get_hits, snap.corrupt_values, snap.get_misses),
        (2, 1, 1)
    );
}

#[test]
fn stacked_fills_come_from_the_disk_then_the_remote_store() {
    let s = Scratch::new("fill-stack");
    let store = open(&s, ODD, false, "");
    let remote = MemoryStore::default();
    let stacked = StackedStore::new(Box::new(store.clone()), Box::new(remote.clone()));
    let stats = std::sync::Arc::new(TierStats::default());
    let mut t = RemoteTier::new(Box::new(stacked), KeySpace::new("test", FP).unwrap(), stats);
    assert_eq!(store_blocks(&mut t, 0..2, ODD), 2);
    remote.set_raw(key(9), encode(FP, &hash(9), &[&block(9, ODD)]));
    let got = fill_blocks(&mut t, &[0, 9, 1, 8], ODD, &CUTS);
    assert_eq!(got, [Some(true), Some(true), Some(true), None]);
    assert_eq!(store.snapshot().reads, 2, "the disk served its own blocks");
}

#[test]
fn a_block_read_in_several_groups_is_exact_and_every_group_is_verified() {
    // Larger than the page cache path's read group (256 KiB), no multiple of 4 KiB, its
    // slices cut across group edges: bytes damaged in a later group are caught too.
    let len = 3 * (256 << 10) + ODD;
    let cuts = [100, 300_000, 700_000];
    for page_cache in [false, true] {
        let s = Scratch::new("fill-groups");
        let store = open(&s, len, page_cache, "");
        let mut t = tier(&store);
        assert_eq!(store_blocks(&mut t, 0..3, len), 3);
        let data = store.open_data_file().unwrap();
        let payload = |i: u32| store.offset_of(&key(i)).unwrap();
        data.write_all_at(&[0x01], payload(1) + len as u64 - 10)
            .unwrap();
        data.write_all_at(&[0x02], payload(2) + (256 << 10) + 50)
            .unwrap();
        assert_eq!(
            fill_blocks(&mut t, &[0, 1, 2], len, &cuts),
            [Some(true), None, None],
            "page_cache {page_cache}"
        );
        assert_eq!(store.snapshot().checksum_failures, 2);
    }
}

/// `len` bytes starting on a 4 KiB boundary (and `skew` bytes past it), inside `buf`.
fn aligned(buf: &mut Vec<u8>, len: usize, skew: usize) -> &mut [u8] {
    buf.resize(len + 4096 + skew, 0);
    let at = buf.as_ptr().align_offset(4096) + skew;
    &mut buf[at..at + len]
}

/// Writes block `i` from `len`-byte memory cut in `slice`-byte slices (`skew` bytes off a
/// page) with `put_parts`, fills it back into memory laid out the same way with
/// `get_into`; whether it came back byte-exact, and the store's counters' change of
/// (direct reads, direct writes, bounced reads, bounced writes).
fn round_trip(
    store: &mut DiskStore,
    i: u32,
    len: usize,
    slice: usize,
    skew: usize,
) -> (bool, [u64; 4]) {
    let before = store.snapshot();
    let mut src = Vec::new();
    let src = aligned(&mut src, len, skew);
    src.copy_from_slice(&block(i, len));
    let h = hash(i);
    let parts = ValueParts::new(FP, &h, src.chunks(slice).collect());
    assert!(store.put_parts(&[(key(i), parts)])[0].is_ok());
    let mut dst = Vec::new();
    let dst = aligned(&mut dst, len, skew);
    dst.fill(0xc3);
    let mut fills = [BlockFill::new(&h, dst.chunks_mut(slice).collect())];
    let got = store.get_into(&[key(i)], FP, &mut fills);
    let exact = got[0] == Ok(Fill::Filled) && *dst == block(i, len)[..];
    let after = store.snapshot();
    let moved = [
        after.direct_reads - before.direct_reads,
        after.direct_writes - before.direct_writes,
        after.bounced_reads - before.bounced_reads,
        after.bounced_writes - before.bounced_writes,
    ];
    (exact, moved)
}

#[test]
fn a_64_kib_block_takes_a_64_kib_slot_and_aligned_slices_move_without_a_copy() {
    const BLOCK: usize = 64 << 10;
    const DIRECT: [u64; 4] = [1, 1, 0, 0];
    const BOUNCED: [u64; 4] = [0, 0, 1, 1];
    let s = Scratch::new("fill-direct");
    let mut store = open(&s, BLOCK, false, "");
    assert_eq!(
        store.slot_bytes(),
        BLOCK as u64,
        "no page of header per block"
    );
    let data_len = store.open_data_file().unwrap().metadata().unwrap().len();
    assert_eq!(data_len, store.capacity_blocks() * BLOCK as u64);
    let (mem, unit) = store.direct_io_alignment().expect("ext4/xfs take O_DIRECT");
    assert!(mem <= 4096 && unit <= 4096, "{mem} {unit}");
    // Page-aligned 4 KiB slices: direct on any file system that takes O_DIRECT.
    assert_eq!(round_trip(&mut store, 0, BLOCK, 4096, 0), (true, DIRECT));
    assert_eq!(round_trip(&mut store, 1, BLOCK, 16384, 0), (true, DIRECT));
    // A CPU block of a 32-layer model: 2 KiB slices, aligned, but smaller than a page:
    // through the aligned buffer (slower directly, `slot_io.rs`), exact all the same.
    assert_eq!(round_trip(&mut store, 5, BLOCK, 2048, 0), (true, BOUNCED));
    // Slices off their alignment by one byte: through the aligned buffer, exact all the
    // same.
    assert_eq!(round_trip(&mut store, 2, BLOCK, 4096, 1), (true, BOUNCED));
    // A block that ends inside an alignment unit: the tail through a scratch page, on
    // both sides; the last slice's bytes past it never leak.
    let s_odd = Scratch::new("fill-direct-odd");
    let mut odd = open(&s_odd, ODD, false, "");
    assert_eq!(round_trip(&mut odd, 3, ODD, 4096, 0), (true, DIRECT));
    assert_eq!(round_trip(&mut odd, 4, ODD, 4096, 3), (true, BOUNCED));
    assert_eq!(
        odd.snapshot().checksum_failures + store.snapshot().checksum_failures,
        0
    );
}

/// Stores blocks `ids` of `len` bytes in one batch from page-aligned memory cut in 4 KiB
/// slices (as a CPU block's are), so a direct transfer takes every slice as it is; how
/// many were written.
fn store_aligned(store: &mut DiskStore, ids: &[u32], len: usize) -> usize {
    let mut memory: Vec<Vec<u8>> = ids.iter().map(|_| Vec::new()).collect();
    let sources: Vec<&[u8]> = memory
        .iter_mut()
        .zip(ids)
        .map(|(m, &i)| {
            let a = aligned(m, len, 0);
            a.copy_from_slice(&block(i, len));
            &*a
        })
        .collect();
    let hashes: Vec<[u8; 16]> = ids.iter().map(|&i| hash(i)).collect();
    let entries: Vec<_> = ids
        .iter()
        .zip(&sources)
        .zip(&hashes)
        .map(|((&i, src), h)| (key(i), ValueParts::new(FP, h, src.chunks(4096).collect())))
        .collect();
    store
        .put_parts(&entries)
        .iter()
        .filter(|r| r.is_ok())
        .count()
}

/// Fills blocks `ids` of `len` bytes into page-aligned memory cut in 4 KiB slices: which
/// came back filled and byte-exact.
fn fill_aligned(store: &mut DiskStore, ids: &[u32], len: usize) -> Vec<bool> {
    let hashes: Vec<[u8; 16]> = ids.iter().map(|&i| hash(i)).collect();
    let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
    let mut memory: Vec<Vec<u8>> = ids.iter().map(|_| Vec::new()).collect();
    let mut fills: Vec<BlockFill<'_, '_>> = memory
        .iter_mut()
        .zip(&hashes)
        .map(|(m, h)| {
            let a = aligned(m, len, 0);
            a.fill(0xc3);
            BlockFill::new(h, a.chunks_mut(4096).collect())
        })
        .collect();
    let got = store.get_into(&keys, FP, &mut fills);
    drop(fills);
    got.iter()
        .zip(&memory)
        .zip(ids)
        .map(|((g, m), &i)| {
            let at = m.as_ptr().align_offset(4096);
            *g == Ok(Fill::Filled) && m[at..at + len] == block(i, len)[..]
        })
        .collect()
}

#[test]
fn a_batch_goes_to_consecutive_slots_and_moves_in_runs_each_block_verified() {
    const BLOCK: usize = 64 << 10;
    let s = Scratch::new("fill-runs");
    let mut store = open(&s, BLOCK, false, "");
    let ids: Vec<u32> = (0..8).collect();
    assert_eq!(store_aligned(&mut store, &ids, BLOCK), 8);
    let first = store.offset_of(&key(0)).unwrap();
    for &i in &ids {
        assert_eq!(
            store.offset_of(&key(i)),
            Some(first + u64::from(i) * BLOCK as u64),
            "block {i} follows the one before it"
        );
    }
    assert_eq!(store.snapshot().direct_writes, 8);
    assert_eq!(fill_aligned(&mut store, &ids, BLOCK), [true; 8]);
    // Out of order, a miss between: still exact.
    let ids2 = [5, 6, 7, 40, 0, 1];
    assert_eq!(
        fill_aligned(&mut store, &ids2, BLOCK),
        [true, true, true, false, true, true]
    );
    assert_eq!(store.snapshot().direct_reads, 13);
    assert_eq!(store.snapshot().checksum_failures, 0);
}

#[test]
fn a_fault_in_a_run_costs_the_blocks_it_touched_not_the_run() {
    const BLOCK: usize = 64 << 10;
    let ids: Vec<u32> = (0..8).collect();
    // Every read flips the byte in the middle of what it read: one I/O for the eight
    // blocks damages block 4 alone, which its own checksum catches.
    let s = Scratch::new("fill-runs-corrupt");
    let mut store = open(&s, BLOCK, false, "disk_corrupt_read_every=1");
    assert_eq!(store_aligned(&mut store, &ids, BLOCK), 8);
    assert_eq!(
        fill_aligned(&mut store, &ids, BLOCK),
        [true, true, true, true, false, true, true, true]
    );
    assert_eq!(store.snapshot().checksum_failures, 1);
    // A failed read fails every block it was reading, and counts as one failed I/O.
    let s = Scratch::new("fill-runs-eio");
    let mut store = open(&s, BLOCK, false, "disk_read_eio_every=1");
    assert_eq!(store_aligned(&mut store, &ids, BLOCK), 8);
    assert_eq!(fill_aligned(&mut store, &ids, BLOCK), [false; 8]);
    assert_eq!(store.snapshot().errors_eio, 1);
    // A failed write: nothing of the run is readable; one failed I/O.
    let s = Scratch::new("fill-runs-enospc");
    let mut store = open(&s, BLOCK, false, "disk_enospc_every=1");
    assert_eq!(store_aligned(&mut store, &ids, BLOCK), 0);
    let snap = store.snapshot();
    assert_eq!((snap.resident_blocks, snap.errors_enospc), (0, 1));
    assert_eq!(fill_aligned(&mut store, &ids, BLOCK), [false; 8]);
    // Blocks that do not fill their slots, in uneven slices: a run all the same, through
    // aligned buffers, the flipped byte costing the block it landed in alone.
    let s = Scratch::new("fill-runs-odd");
    let store = open(&s, ODD, false, "disk_corrupt_read_every=1");
    let mut t = tier(&store);
    assert_eq!(store_blocks(&mut t, 0..6, ODD), 6);
    let snap = store.snapshot();
    assert_eq!((snap.bounced_writes, snap.errors_eio), (6, 0));
    let first = store.offset_of(&key(0)).unwrap();
    assert_eq!(
        store.offset_of(&key(5)),
        Some(first + 5 * store.slot_bytes())
    );
    // The middle byte of six slots is the first of the fourth.
    let middle = 3;
    let got = fill_blocks(&mut t, &[0, 1, 2, 3, 4, 5], ODD, &CUTS);
    let want: Vec<Option<bool>> = (0..6).map(|i| (i != middle).then_some(true)).collect();
    assert_eq!(got, want, "only block {middle} is damaged");
    assert_eq!(store.snapshot().checksum_failures, 1);
}
