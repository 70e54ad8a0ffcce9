//! The disk tier's store: bytes, capacity, restarts, locks, corruption and I/O faults.

#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::FileExt;

use common::disk::{fetch_blocks, hash, options, store_blocks, tier, Scratch, FP};
use offload_core::tier::disk::{
    DiskChanges, DiskError, DiskProbe, DiskStore, DISABLE_AFTER_ERRORS, ENTRY_BYTES,
};
use offload_core::tier::{KeySpace, LayoutFingerprint, MemoryStore, RemoteStore, StackedStore};
use offload_core::transfer::FaultPlan;

/// A block size that is no multiple of 4 KiB (nor of 8).
const ODD: usize = 5003;

fn key(i: u32) -> offload_core::tier::RemoteKey {
    KeySpace::new("test", FP).unwrap().key(&hash(i)).unwrap()
}

#[test]
fn round_trip_is_byte_exact_direct_and_buffered() {
    for page_cache in [false, true] {
        for len in [ODD, 4096 - 56, 3 * 4096 + 1] {
            let s = Scratch::new("rt");
            let mut o = options(&s.rank_path(), len, 32);
            o.use_page_cache = page_cache;
            let store = DiskStore::open(&o).unwrap();
            assert_eq!(store.is_direct(), !page_cache, "ext4/xfs take O_DIRECT");
            let mut t = tier(&store);
            assert_eq!(store_blocks(&mut t, 0..10, len), 10);
            let got = fetch_blocks(&mut t, &(0..12).collect::<Vec<_>>(), len);
            assert_eq!(
                &got[..10],
                &[Some(true); 10],
                "len {len} page_cache {page_cache}"
            );
            assert_eq!(&got[10..], &[None, None]);
            let snap = store.snapshot();
            assert_eq!(snap.writes, 10);
            assert_eq!(snap.reads, 10);
            assert_eq!(snap.buffered_io, u64::from(page_cache));
        }
    }
}

#[test]
fn page_cache_io_runs_on_no_more_threads_than_cores_and_direct_io_on_all_asked_for() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let asked = 4 * cores + 1;
    for page_cache in [false, true] {
        let s = Scratch::new("width");
        let mut o = options(&s.rank_path(), ODD, 32);
        o.use_page_cache = page_cache;
        o.io_threads = asked;
        let store = DiskStore::open(&o).unwrap();
        let want = if store.is_direct() { asked } else { cores };
        assert_eq!(store.io_threads(), want, "page_cache {page_cache}");
        // Every width still moves every block.
        let mut t = tier(&store);
        assert_eq!(store_blocks(&mut t, 0..20, ODD), 20);
        let got = fetch_blocks(&mut t, &(0..20).collect::<Vec<_>>(), ODD);
        assert_eq!(got, vec![Some(true); 20], "page_cache {page_cache}");
    }
}

#[test]
fn capacity_is_reserved_and_never_exceeded_with_lru_eviction() {
    let s = Scratch::new("cap");
    let o = options(&s.rank_path(), ODD, 4);
    let store = DiskStore::open(&o).unwrap();
    let on_disk = |store: &DiskStore| {
        store.open_data_file().unwrap().metadata().unwrap().len()
            + std::fs::metadata(store.index_path()).unwrap().len()
    };
    assert!(on_disk(&store) <= o.capacity_bytes);
    assert_eq!(store.capacity_blocks(), 4);
    let mut t = tier(&store);
    assert_eq!(store_blocks(&mut t, 0..4, ODD), 4);
    // Touch 0: 1 is the least recently used and goes first.
    assert_eq!(fetch_blocks(&mut t, &[0], ODD), [Some(true)]);
    assert_eq!(store_blocks(&mut t, [4], ODD), 1);
    assert_eq!(
        fetch_blocks(&mut t, &[0, 1, 2, 3, 4], ODD),
        [Some(true), None, Some(true), Some(true), Some(true)]
    );
    // One block per batch: a batch larger than the capacity would find its own
    // blocks' slots busy.
    for i in 5..20 {
        assert_eq!(store_blocks(&mut t, [i], ODD), 1);
    }
    let snap = store.snapshot();
    assert_eq!(snap.resident_blocks, 4);
    assert_eq!(snap.evictions, 16);
    assert!(on_disk(&store) <= o.capacity_bytes);
    assert!(snap.capacity_bytes <= o.capacity_bytes);
    // The four most recent are the ones kept.
    assert_eq!(
        fetch_blocks(&mut t, &[16, 17, 18, 19], ODD),
        [Some(true); 4]
    );
}

#[test]
fn without_persist_files_are_emptied_at_start_and_removed_at_shutdown() {
    let s = Scratch::new("nopersist");
    let mut o = options(&s.rank_path(), ODD, 8);
    o.persist = true;
    {
        let store = DiskStore::open(&o).unwrap();
        assert_eq!(store_blocks(&mut tier(&store), 0..3, ODD), 3);
    }
    assert_eq!(s.files(), ["kv.rank_0", "kv.rank_0.idx"]);
    o.persist = false;
    let store = DiskStore::open(&o).unwrap();
    // Open, the data file has no name any more (tier_disk_unlinked.rs).
    assert_eq!(s.files(), ["kv.rank_0.idx"]);
    assert_eq!(store.snapshot().recovered_blocks, 0);
    assert_eq!(
        fetch_blocks(&mut tier(&store), &[0, 1, 2], ODD),
        [None, None, None]
    );
    drop(store);
    assert!(s.files().is_empty(), "{:?}", s.files());
}

#[test]
fn restart_with_persist_rebuilds_the_index_and_serves_blocks() {
    let s = Scratch::new("persist");
    let mut o = options(&s.rank_path(), ODD, 64);
    o.persist = true;
    {
        let store = DiskStore::open(&o).unwrap();
        assert_eq!(store_blocks(&mut tier(&store), 0..40, ODD), 40);
    }
    let store = DiskStore::open(&o).unwrap();
    let snap = store.snapshot();
    assert_eq!(snap.recovered_blocks, 40);
    assert_eq!(snap.resident_blocks, 40);
    let ids: Vec<u32> = (0..40).collect();
    assert_eq!(
        fetch_blocks(&mut tier(&store), &ids, ODD),
        vec![Some(true); 40]
    );
    drop(store);
    // Another layout (model, dtype, weights...) never sees them: the files are wiped.
    let mut other = o.clone();
    other.fingerprint = LayoutFingerprint(FP.0 + 1);
    let store = DiskStore::open(&other).unwrap();
    assert_eq!(store.snapshot().recovered_blocks, 0);
}

#[test]
fn a_second_engine_on_the_same_path_is_refused() {
    let s = Scratch::new("lock");
    let o = options(&s.rank_path(), ODD, 8);
    let first = DiskStore::open(&o).unwrap();
    let err = DiskStore::open(&o).unwrap_err();
    assert!(matches!(err, DiskError::Locked { .. }), "{err}");
    assert!(err.to_string().contains("kv.rank_0.idx"), "{err}");
    drop(first);
    assert!(DiskStore::open(&o).is_ok(), "the lock goes with the engine");
}

#[test]
fn an_unusable_disk_path_is_refused_naming_the_key_and_the_path() {
    // A parent that cannot be created: /proc takes no new directories, even for root.
    let o = options(
        std::path::Path::new("/proc/kvoffload-absent/kv.rank_0"),
        ODD,
        8,
    );
    let err = DiskStore::open(&o).unwrap_err();
    assert!(matches!(err, DiskError::Open { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("disk_path"), "{msg}");
    assert!(msg.contains("/proc/kvoffload-absent"), "{msg}");
}

#[test]
fn corrupted_and_truncated_blocks_are_counted_misses_and_free_their_slot() {
    // Both read paths verify: O_DIRECT in the copy out of the aligned buffer, buffered
    // in the value the kernel filled.
    for page_cache in [false, true] {
        let s = Scratch::new("corrupt");
        let mut o = options(&s.rank_path(), ODD, 16);
        o.use_page_cache = page_cache;
        let store = DiskStore::open(&o).unwrap();
        let mut t = tier(&store);
        assert_eq!(store_blocks(&mut t, 0..3, ODD), 3);
        let data = store.open_data_file().unwrap();
        // Flipped payload bytes, one of them the last (past the last whole alignment
        // unit): caught by the payload's checksum.
        let at = store.offset_of(&key(0)).unwrap();
        data.write_all_at(&[0xff, 0x00, 0xff], at + 2000).unwrap();
        data.write_all_at(&[0x42], at + ODD as u64 - 1).unwrap();
        // The entry's payload checksum changed: caught by the entry's own checksum.
        let idx = std::fs::OpenOptions::new()
            .write(true)
            .open(store.index_path())
            .unwrap();
        idx.write_all_at(&[0x42; 8], store.entry_offset_of(&key(1)).unwrap() + 40)
            .unwrap();
        assert_eq!(
            fetch_blocks(&mut t, &[0, 1, 2], ODD),
            [None, None, Some(true)]
        );
        let snap = store.snapshot();
        assert_eq!(snap.checksum_failures, 2);
        assert_eq!(snap.resident_blocks, 1);
        assert!(store.offset_of(&key(0)).is_none(), "slot freed");
        assert_eq!(
            t.stats().snapshot().corrupt_values,
            0,
            "the store caught both, on its own threads"
        );
        // Truncated file: a short read is a miss, never a hang or a panic.
        data.set_len(0).unwrap();
        assert_eq!(fetch_blocks(&mut t, &[2], ODD), [None]);
        assert_eq!(store.snapshot().errors_short, 1);
    }
}

#[test]
fn values_encoded_into_reused_io_buffers_serve_exact_bytes_only() {
    // Writes encode straight into the store's reused I/O buffers (`put_parts`) and reads
    // go through the same buffers: the bytes on disk are `value::encode`'s, and a buffer
    // that held another block never leaks into a caller's block.
    for page_cache in [false, true] {
        let s = Scratch::new("reuse");
        let mut o = options(&s.rank_path(), ODD, 16);
        o.use_page_cache = page_cache;
        let mut store = DiskStore::open(&o).unwrap();
        let mut t = tier(&store);
        // In parts, cut across the tier's copy pieces, as a block's layer regions come.
        let blocks: Vec<_> = (0..4u32)
            .map(|i| {
                let b = common::disk::block(i, ODD);
                (
                    hash(i),
                    vec![b[..7].to_vec(), b[7..4099].to_vec(), b[4099..].to_vec()],
                )
            })
            .collect();
        assert_eq!(t.store(&blocks).unwrap(), 4);
        let encoded = |i: u32| {
            offload_core::tier::value::encode(FP, &hash(i), &[&common::disk::block(i, ODD)])
        };
        let got = store.get(&[key(0), key(1)]);
        let [Ok(Some(v0)), Ok(Some(v1))] = &got[..] else {
            panic!("{got:?}");
        };
        assert_eq!(
            (v0, v1),
            (&encoded(0), &encoded(1)),
            "page_cache {page_cache}"
        );
        let data = store.open_data_file().unwrap();
        data.write_all_at(&[0xff; 3], store.offset_of(&key(2)).unwrap() + 3000)
            .unwrap();
        assert_eq!(
            fetch_blocks(&mut t, &[2], ODD),
            [None],
            "the bad block is a miss"
        );
        assert_eq!(
            fetch_blocks(&mut t, &[3, 0, 1], ODD),
            [Some(true); 3],
            "page_cache {page_cache}"
        );
        assert_eq!(store.snapshot().checksum_failures, 1);
    }
}

#[test]
fn a_half_written_block_is_never_served_after_restart() {
    let s = Scratch::new("torn");
    let mut o = options(&s.rank_path(), ODD, 16);
    o.persist = true;
    {
        let store = DiskStore::open(&o).unwrap();
        let slot_bytes = store.slot_bytes() as usize;
        assert_eq!(store_blocks(&mut tier(&store), 0..3, ODD), 3);
        let data = store.open_data_file().unwrap();
        // Block 0: the entry committed, the data only half there (a crash mid-write).
        let at = store.offset_of(&key(0)).unwrap();
        data.write_all_at(&vec![0u8; slot_bytes / 2], at + slot_bytes as u64 / 2)
            .unwrap();
        // Block 1: its entry torn (written without its checksum).
        let idx = std::fs::OpenOptions::new()
            .write(true)
            .open(store.index_path())
            .unwrap();
        idx.write_all_at(&[0x13; 20], store.entry_offset_of(&key(1)).unwrap() + 30)
            .unwrap();
    }
    let store = DiskStore::open(&o).unwrap();
    assert_eq!(
        store.snapshot().recovered_blocks,
        2,
        "the torn entry is not an entry"
    );
    assert_eq!(
        fetch_blocks(&mut tier(&store), &[0, 1, 2], ODD),
        [None, None, Some(true)]
    );
    assert_eq!(store.snapshot().checksum_failures, 1);
}

#[test]
fn injected_write_faults_are_counted_skips() {
    let s = Scratch::new("enospc");
    let mut o = options(&s.rank_path(), ODD, 16);
    o.faults = FaultPlan::parse("disk_enospc_every=2,disk_write_eio_every=3").unwrap();
    let store = DiskStore::open(&o).unwrap();
    let mut t = tier(&store);
    // Writes 2 and 4 ENOSPC, 3 EIO (6 would be ENOSPC): 1, 5 written.
    assert_eq!(store_blocks(&mut t, 0..5, ODD), 2);
    let snap = store.snapshot();
    assert_eq!(
        (snap.errors_enospc, snap.errors_eio, snap.writes),
        (2, 1, 2)
    );
    assert_eq!(t.stats().snapshot().writes_failed, 3);
    let got = fetch_blocks(&mut t, &(0..5).collect::<Vec<_>>(), ODD);
    assert_eq!(got.iter().filter(|g| **g == Some(true)).count(), 2);
    assert!(got.iter().all(|g| *g != Some(false)));
    assert_eq!(snap.resident_blocks, 2);
}

#[test]
fn injected_read_faults_are_misses() {
    let s = Scratch::new("eio");
    let mut o = options(&s.rank_path(), ODD, 16);
    o.faults =
        FaultPlan::parse("disk_read_eio_every=3,disk_short_read_every=4,disk_corrupt_read_every=5")
            .unwrap();
    o.io_threads = 1;
    let store = DiskStore::open(&o).unwrap();
    let mut t = tier(&store);
    assert_eq!(store_blocks(&mut t, 0..6, ODD), 6);
    let got = fetch_blocks(&mut t, &(0..5).collect::<Vec<_>>(), ODD);
    // Reads 3 (EIO), 4 (short) and 5 (a flipped byte) fail; the rest are exact.
    assert_eq!(got, [Some(true), Some(true), None, None, None]);
    let snap = store.snapshot();
    assert_eq!(
        (snap.errors_eio, snap.errors_short, snap.checksum_failures),
        (1, 1, 1)
    );
}

#[test]
fn repeated_errors_disable_the_tier() {
    let s = Scratch::new("disable");
    let mut o = options(&s.rank_path(), ODD, 64);
    o.faults = FaultPlan::parse("disk_write_eio_every=1").unwrap();
    let store = DiskStore::open(&o).unwrap();
    let mut t = tier(&store);
    let n = DISABLE_AFTER_ERRORS as u32;
    // One block a batch: one write each (a batch's blocks go out in runs, one write a
    // run, and a failed write counts once).
    assert_eq!(
        (0..n)
            .map(|i| store_blocks(&mut t, [i], ODD))
            .sum::<usize>(),
        0
    );
    let snap = store.snapshot();
    assert_eq!((snap.disabled, snap.errors_eio), (1, u64::from(n)));
    // Off: nothing more reaches the disk, every call still answers.
    assert_eq!(store_blocks(&mut t, n..n + 5, ODD), 0);
    assert_eq!(fetch_blocks(&mut t, &[0], ODD), [None]);
    assert_eq!(store.snapshot().errors_eio, u64::from(n));
}

#[test]
fn the_schedulers_probe_sees_what_the_worker_wrote() {
    let s = Scratch::new("probe");
    let mut probe = DiskProbe::new(s.rank_path(), FP);
    assert_eq!(probe.exists(&[key(0)]), [Ok(false)], "no files yet");
    let store = DiskStore::open(&options(&s.rank_path(), ODD, 16)).unwrap();
    assert_eq!(store_blocks(&mut tier(&store), 0..3, ODD), 3);
    let got: Vec<bool> = probe
        .exists(&[key(0), key(1), key(2), key(3)])
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(got, [true, true, true, false]);
    assert!(
        probe.get(&[key(0)])[0].is_err(),
        "the probe never reads blocks"
    );
    let mut foreign = DiskProbe::new(s.rank_path(), LayoutFingerprint(1));
    assert_eq!(foreign.exists(&[key(0)]), [Ok(false)]);
}

#[test]
fn an_evicted_blocks_entry_is_erased_and_a_stale_one_loses_its_slot_at_restart() {
    let s = Scratch::new("stale");
    let mut o = options(&s.rank_path(), ODD, 4);
    o.persist = true;
    let mut probe = DiskProbe::new(s.rank_path(), FP);
    let stale = {
        let store = DiskStore::open(&o).unwrap();
        let mut t = tier(&store);
        assert_eq!(store_blocks(&mut t, 0..4, ODD), 4);
        let at = store.entry_offset_of(&key(0)).unwrap();
        let idx = std::fs::File::open(store.index_path()).unwrap();
        let mut raw = vec![0u8; ENTRY_BYTES];
        idx.read_exact_at(&mut raw, at).unwrap();
        // The clock hand comes back to block 0's slot first: block 4 takes it, and the
        // scheduler's probe no longer finds block 0.
        assert_eq!(store_blocks(&mut t, [4], ODD), 1);
        assert_eq!(
            store.offset_of(&key(4)),
            Some(0),
            "the hand wrapped to the first slot"
        );
        assert_eq!(probe.exists(&[key(0), key(4)]), [Ok(false), Ok(true)]);
        raw
    };
    // As if the engine had died before erasing block 0's entry: two entries of the set
    // (the only one, of six entries) name slot 0. Put back into a free entry of the set.
    let idx = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(s.dir.join("kv.rank_0.idx"))
        .unwrap();
    let free = (0..6u64)
        .map(|e| 4096 + e * ENTRY_BYTES as u64)
        .find(|&at| {
            let mut raw = vec![1u8; ENTRY_BYTES];
            idx.read_exact_at(&mut raw, at).unwrap();
            raw.iter().all(|&b| b == 0)
        })
        .unwrap();
    idx.write_all_at(&stale, free).unwrap();
    assert_eq!(probe.exists(&[key(0)]), [Ok(true)]);
    let store = DiskStore::open(&o).unwrap();
    assert_eq!(store.snapshot().recovered_blocks, 4, "blocks 1 to 4");
    assert_eq!(
        fetch_blocks(&mut tier(&store), &[0, 1, 4], ODD),
        [None, Some(true), Some(true)]
    );
    assert_eq!(
        probe.exists(&[key(0)]),
        [Ok(false)],
        "the losing entry is erased at restart"
    );
    assert_eq!(store.snapshot().checksum_failures, 0);
}

#[test]
fn disk_in_front_of_a_remote_store() {
    let s = Scratch::new("stack");
    let store = DiskStore::open(&options(&s.rank_path(), ODD, 16)).unwrap();
    let remote = MemoryStore::default();
    let keys = KeySpace::new("test", FP).unwrap();
    let stats = std::sync::Arc::new(offload_core::tier::TierStats::default());
    let stacked = StackedStore::new(Box::new(store.clone()), Box::new(remote.clone()));
    let mut t = offload_core::tier::RemoteTier::new(Box::new(stacked), keys, stats);
    assert_eq!(store_blocks(&mut t, 0..4, ODD), 4);
    assert_eq!(
        remote.get_raw(&key(3)),
        Some(offload_core::tier::value::encode(
            FP,
            &hash(3),
            &[&common::disk::block(3, ODD)]
        )),
        "written to both, the remote store's copy encoded by the default `put_parts`"
    );
    assert_eq!(store.snapshot().writes, 4);
    // Block 9 only remote: found there after the disk missed.
    let mut only_remote = tier(&store);
    let value = offload_core::tier::value::encode(FP, &hash(9), &[&common::disk::block(9, ODD)]);
    remote.set_raw(key(9), value);
    assert_eq!(fetch_blocks(&mut t, &[0, 9], ODD), [Some(true), Some(true)]);
    assert_eq!(fetch_blocks(&mut only_remote, &[9], ODD), [None]);
    assert_eq!(store.snapshot().reads, 1);
}

#[test]
fn changes_name_every_block_that_came_onto_the_disk_and_left_it() {
    let s = Scratch::new("changes");
    let mut o = options(&s.rank_path(), ODD, 4);
    o.persist = true;
    o.report_changes = true;
    {
        let store = DiskStore::open(&o).unwrap();
        let mut t = tier(&store);
        assert_eq!(store_blocks(&mut t, 0..4, ODD), 4);
        let c = store.take_changes();
        assert_eq!(c.stored, (0..4).map(hash).collect::<Vec<_>>());
        assert!(c.removed.is_empty());
        // Written again: already there, nothing to say.
        assert_eq!(store_blocks(&mut t, [2], ODD), 1);
        assert_eq!(store.take_changes(), DiskChanges::default());
        // Block 0 is the least recently used: a fifth block evicts it.
        assert_eq!(fetch_blocks(&mut t, &[1, 2, 3], ODD), [Some(true); 3]);
        assert_eq!(store_blocks(&mut t, [4], ODD), 1);
        let c = store.take_changes();
        assert_eq!((c.stored, c.removed), (vec![hash(4)], vec![hash(0)]));
        // A block that fails its check leaves the disk.
        let data = store.open_data_file().unwrap();
        data.write_all_at(&[0xff; 3], store.offset_of(&key(1)).unwrap() + 2000)
            .unwrap();
        assert_eq!(fetch_blocks(&mut t, &[1], ODD), [None]);
        assert_eq!(store.take_changes().removed, vec![hash(1)]);
    }
    // After a restart the recovered blocks are named once a read or a write finds them.
    let store = DiskStore::open(&o).unwrap();
    assert_eq!(store.snapshot().recovered_blocks, 3);
    assert_eq!(store.take_changes(), DiskChanges::default());
    assert_eq!(store_blocks(&mut tier(&store), [3], ODD), 1);
    assert_eq!(
        fetch_blocks(&mut tier(&store), &[2, 3], ODD),
        [Some(true); 2]
    );
    assert_eq!(store.take_changes().stored, vec![hash(3), hash(2)]);
    // Without `report_changes` nothing is recorded.
    drop(store);
    o.report_changes = false;
    let store = DiskStore::open(&o).unwrap();
    assert_eq!(store_blocks(&mut tier(&store), [7], ODD), 1);
    assert_eq!(store.take_changes(), DiskChanges::default());
}

#[test]
fn a_tier_that_turns_itself_off_removes_every_block_it_named() {
    let s = Scratch::new("changes-off");
    let mut o = options(&s.rank_path(), ODD, 64);
    o.report_changes = true;
    // Writes go through; every read fails.
    o.faults = FaultPlan::parse("disk_read_eio_every=1").unwrap();
    let store = DiskStore::open(&o).unwrap();
    let mut t = tier(&store);
    assert_eq!(store_blocks(&mut t, 0..4, ODD), 4);
    assert_eq!(store.take_changes().stored.len(), 4);
    for _ in 0..DISABLE_AFTER_ERRORS {
        let _ = t.fetch(&[hash(0)], ODD);
    }
    assert_eq!(store.snapshot().disabled, 1);
    let mut removed = store.take_changes().removed;
    removed.sort_unstable();
    assert_eq!(removed, (0..4).map(hash).collect::<Vec<_>>());
}
