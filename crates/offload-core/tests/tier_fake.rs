//! Protocol faults a real cluster does not produce on demand, from a fake server on
//! loopback: a server that never answers, one that stalls after the handshake, one that
//! sends bytes that are not RESP, one that answers with the wrong types.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::tier::{hashes, layout, no_hang, FakeServer, Fault};
use offload_core::tier::{KeySpace, RedisStore, RemoteStore, RemoteTier, TierError, TierStats};

const DEADLINE: Duration = Duration::from_millis(300);
const HANG: Duration = Duration::from_secs(30);

fn keys(n: usize) -> (KeySpace, Vec<offload_core::tier::RemoteKey>) {
    let ks = KeySpace::new("fake", layout(0).fingerprint()).unwrap();
    let keys = hashes(9, n).iter().map(|h| ks.key(h).unwrap()).collect();
    (ks, keys)
}

#[test]
fn a_server_that_never_answers_fails_the_connect_at_its_deadline() {
    let server = FakeServer::start(Fault::Silent);
    let url = server.url();
    let err = no_hang(HANG, move || {
        RedisStore::connect(&[url], DEADLINE).unwrap_err()
    });
    assert!(
        matches!(
            err,
            TierError::Timeout { op: "connect", .. } | TierError::Connect { .. }
        ),
        "{err:?}"
    );
}

#[test]
fn a_stall_after_the_handshake_fails_every_key_at_the_deadline() {
    let server = FakeServer::start(Fault::StallData);
    let url = server.url();
    let (_, keys) = keys(50);
    let (exists, get, put) = no_hang(HANG, move || {
        let mut store = RedisStore::connect(&[url], DEADLINE).unwrap();
        let exists = store.exists(&keys);
        let get = store.get(&keys);
        let put = store.put(&[(keys[0].clone(), vec![1, 2, 3])]);
        (exists, get, put)
    });
    assert_eq!(exists.len(), 50);
    assert_eq!(get.len(), 50);
    for r in exists.iter().map(|r| r.as_ref().map(|_| ())) {
        assert!(
            matches!(r, Err(TierError::Timeout { op: "exists", .. })),
            "{r:?}"
        );
    }
    // After a timeout the connection is rebuilt; on a loaded machine the fake node may miss
    // the handshake's deadline, which fails the call as surely as the stall does.
    let failed_in_time = |r: Result<(), &TierError>, call: &str| {
        matches!(r, Err(TierError::Timeout { op, .. }) if *op == call || *op == "connect")
            || matches!(r, Err(TierError::Connect { .. }))
    };
    for r in get.iter().map(|r| r.as_ref().map(|_| ())) {
        assert!(failed_in_time(r, "get"), "{r:?}");
    }
    let put = put[0].as_ref().map(|_| ());
    assert!(failed_in_time(put, "put"), "{put:?}");
}

#[test]
fn a_stalled_store_is_a_miss_for_the_tier() {
    let server = FakeServer::start(Fault::StallData);
    let url = server.url();
    let (ks, _) = keys(0);
    let stats = no_hang(HANG, move || {
        let store = RedisStore::connect(&[url], DEADLINE).unwrap();
        let mut t = RemoteTier::new(Box::new(store), ks, Arc::new(TierStats::default()));
        let h = hashes(9, 8);
        assert_eq!(t.probe_chain(&h).unwrap(), 0);
        assert!(t.fetch(&h, 64).unwrap().iter().all(Option::is_none));
        t.stats().snapshot()
    });
    assert_eq!(stats.failed_keys, 16);
    // The probe's keys miss their deadline. The fetch that follows reconnects first, and on
    // a loaded machine the fake node may not answer the handshake in time: its keys fail
    // either way, as a timeout or as a connection error.
    assert!((8..=16).contains(&stats.timeouts), "{stats:?}");
}

#[test]
fn bytes_that_are_not_resp_are_errors_not_panics() {
    let server = FakeServer::start(Fault::Garbage);
    let url = server.url();
    let (_, keys) = keys(4);
    let get = no_hang(HANG, move || {
        let mut store = RedisStore::connect(&[url], DEADLINE).unwrap();
        store.get(&keys)
    });
    assert!(get.iter().all(Result::is_err), "{get:?}");
}

#[test]
fn answers_of_the_wrong_type_are_failed_keys() {
    let server = FakeServer::start(Fault::WrongType);
    let url = server.url();
    let (ks, keys) = keys(3);
    let (exists, stats) = no_hang(HANG, move || {
        let mut store = RedisStore::connect(&[url], DEADLINE).unwrap();
        let exists = store.exists(&keys);
        let mut t = RemoteTier::new(Box::new(store), ks, Arc::new(TierStats::default()));
        assert!(t
            .fetch(&hashes(9, 3), 64)
            .unwrap()
            .iter()
            .all(Option::is_none));
        (exists, t.stats().snapshot())
    });
    assert!(
        exists
            .iter()
            .all(|r| matches!(r, Err(TierError::Store { op: "exists", .. }))),
        "{exists:?}"
    );
    assert_eq!((stats.failed_keys, stats.get_hits), (3, 0));
}
