//! Without `disk_persist` the data file loses its name once open: the reserved capacity
//! goes back to the file system when its owner dies, even when no destructor runs (vLLM's
//! default `--shutdown-timeout 0` force-kills the worker at `SIGTERM`).

#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::Command;

use common::disk::{fetch_blocks, fill_blocks, options, store_blocks, tier, Scratch};
use offload_core::tier::disk::{DiskStore, ENTRY_BYTES};

/// A block size that is no multiple of 4 KiB.
const ODD: usize = 5003;
/// Where the child test puts its store.
const CHILD_DIR: &str = "KVOFFLOAD_TEST_DISK_CHILD_DIR";

#[test]
fn without_persist_the_data_file_is_unnamed_yet_reserved_and_byte_exact() {
    for page_cache in [false, true] {
        let s = Scratch::new("unlinked");
        let mut o = options(&s.rank_path(), ODD, 16);
        o.use_page_cache = page_cache;
        let store = DiskStore::open(&o).unwrap();
        assert_eq!(s.files(), ["kv.rank_0.idx"]);
        assert!(!store.data_path().exists());
        // The capacity is still reserved, in the live file.
        let meta = store.open_data_file().unwrap().metadata().unwrap();
        assert_eq!(meta.nlink(), 0);
        assert!(meta.len() >= 16 * ODD as u64, "{}", meta.len());
        assert!(meta.blocks() * 512 >= meta.len(), "not allocated: {meta:?}");
        let mut t = tier(&store);
        assert_eq!(store_blocks(&mut t, 0..10, ODD), 10);
        assert_eq!(
            fetch_blocks(&mut t, &[0, 5, 9, 12], ODD),
            [Some(true), Some(true), Some(true), None]
        );
        assert_eq!(
            fill_blocks(&mut t, &[1, 2, 3], ODD, &[700, 2500]),
            [Some(true); 3]
        );
        drop((t, store));
        assert!(s.files().is_empty(), "{:?}", s.files());
    }
}

#[test]
fn with_persist_the_data_file_keeps_its_name() {
    let s = Scratch::new("named");
    let mut o = options(&s.rank_path(), ODD, 8);
    o.persist = true;
    let store = DiskStore::open(&o).unwrap();
    assert_eq!(s.files(), ["kv.rank_0", "kv.rank_0.idx"]);
    assert_eq!(
        store.open_data_file().unwrap().metadata().unwrap().nlink(),
        1
    );
    drop(store);
    assert_eq!(s.files(), ["kv.rank_0", "kv.rank_0.idx"]);
}

/// Not a test of its own: the child process of
/// [`an_owner_that_dies_without_shutdown_leaves_only_the_small_index`], which opens a
/// store, writes blocks and aborts (no destructor runs, as with `SIGKILL`).
#[test]
#[ignore = "run as a child process by an_owner_that_dies_without_shutdown_leaves_only_the_small_index"]
fn child_opens_a_store_and_aborts() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let store = DiskStore::open(&options(&PathBuf::from(dir).join("kv.rank_0"), ODD, 64)).unwrap();
    assert_eq!(store_blocks(&mut tier(&store), 0..8, ODD), 8);
    std::process::abort();
}

#[test]
fn an_owner_that_dies_without_shutdown_leaves_only_the_small_index() {
    let s = Scratch::new("killed");
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_opens_a_store_and_aborts", "--ignored"])
        .env(CHILD_DIR, &s.dir)
        .output()
        .unwrap();
    assert!(
        !child.status.success()
            && String::from_utf8_lossy(&child.stdout).contains("running 1 test"),
        "the child must run and die by abort: {child:?}"
    );
    assert_eq!(s.files(), ["kv.rank_0.idx"]);
    // 1.5 entries of 128 B per slot (in whole sets) and a 4 KiB header: far below the
    // data's 64 slots of 8 KiB.
    let idx = std::fs::metadata(s.dir.join("kv.rank_0.idx"))
        .unwrap()
        .len();
    assert!(idx <= 4096 + 128 * ENTRY_BYTES as u64, "{idx}");
    // The next engine on the path takes the lock and starts empty.
    let store = DiskStore::open(&options(&s.rank_path(), ODD, 64)).unwrap();
    assert_eq!(fetch_blocks(&mut tier(&store), &[0, 7], ODD), [None, None]);
    drop(store);
    assert!(s.files().is_empty(), "{:?}", s.files());
}
