//! The remote tier against a real Redis Cluster on loopback (three masters started by
//! `scripts/redis_cluster.sh`, one cluster per test so faults stay local).

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::tier::{block, hashes, layout, no_hang, tier, Cluster, TIMEOUT};
use offload_core::tier::{value, KeySpace, RedisStore, RemoteStore, TierError, WriteBehind};

const BLOCK: usize = 16 << 10;
const HANG: Duration = Duration::from_secs(60);

#[test]
fn blocks_round_trip_byte_exact_with_one_round_trip_per_chain() {
    let cluster = Cluster::start(0, None);
    let mut t = tier(&cluster.seeds(), "rt", &layout(0));
    let h = hashes(1, 12);
    let blocks: Vec<([u8; 32], Vec<Vec<u8>>)> = h
        .iter()
        .enumerate()
        .map(|(i, h)| (*h, vec![block(i, BLOCK / 2), block(i + 100, BLOCK / 2)]))
        .collect();
    assert_eq!(t.store(&blocks[..8]).unwrap(), 8);

    assert_eq!(t.probe_chain(&h[..8]).unwrap(), 8);
    assert_eq!(
        t.probe_chain(&h).unwrap(),
        8,
        "blocks 8.. were never stored"
    );
    let mut gap = h.clone();
    gap[3] = [0xee; 32];
    assert_eq!(
        t.probe_chain(&gap).unwrap(),
        3,
        "the run ends at the first miss"
    );
    let s = t.stats().snapshot();
    assert_eq!(s.probe_round_trips, 3, "one existence round trip per chain");
    assert_eq!(s.probe_keys, 8 + 12 + 12);
    assert_eq!(s.probe_hits, 8 + 8 + 3);

    let got = t.fetch(&h[..10], BLOCK).unwrap();
    for (i, b) in got.iter().enumerate() {
        match b {
            Some(b) if i < 8 => assert_eq!(b.payload(), blocks[i].1.concat(), "block {i}"),
            None if i >= 8 => {}
            other => panic!("block {i}: {other:?}"),
        }
    }
    let s = t.stats().snapshot();
    assert_eq!(s.get_round_trips, 1);
    assert_eq!((s.get_hits, s.get_misses, s.corrupt_values), (8, 2, 0));
    assert_eq!(s.bytes_read, 8 * BLOCK as u64);
}

#[test]
fn write_behind_reaches_the_cluster() {
    let cluster = Cluster::start(0, None);
    let t = tier(&cluster.seeds(), "wb", &layout(0));
    let stats = std::sync::Arc::clone(t.stats());
    let mut writer = WriteBehind::spawn(t, 64 * BLOCK as u64).unwrap();
    let h = hashes(2, 40);
    for (i, h) in h.iter().enumerate() {
        assert!(writer.offer(h, block(i, BLOCK)));
    }
    assert!(writer.flush(HANG));
    writer.shutdown(Duration::ZERO);
    let s = stats.snapshot();
    assert_eq!(
        (s.writes_queued, s.writes_done, s.writes_dropped),
        (40, 40, 0)
    );
    assert!(s.write_round_trips <= 40);
    assert_eq!(writer.inflight_bytes(), 0);
    let mut reader = tier(&cluster.seeds(), "wb", &layout(0));
    let got = reader.fetch(&h, BLOCK).unwrap();
    for (i, b) in got.into_iter().enumerate() {
        assert_eq!(b.unwrap().payload(), block(i, BLOCK), "block {i}");
    }
}

#[test]
fn other_namespace_or_layout_misses() {
    let cluster = Cluster::start(0, None);
    let h = hashes(3, 4);
    let mut a = tier(&cluster.seeds(), "team-a", &layout(0));
    let blocks: Vec<_> = h.iter().map(|h| (*h, vec![block(1, BLOCK)])).collect();
    a.store(&blocks).unwrap();

    let mut other_ns = tier(&cluster.seeds(), "team-b", &layout(0));
    assert_eq!(other_ns.probe_chain(&h).unwrap(), 0);
    assert!(other_ns
        .fetch(&h, BLOCK)
        .unwrap()
        .iter()
        .all(Option::is_none));
    let mut other_rank = tier(&cluster.seeds(), "team-a", &layout(1));
    assert_eq!(other_rank.probe_chain(&h).unwrap(), 0);

    // A value copied under another layout's key is caught by its header.
    let mut raw = RedisStore::connect(&cluster.seeds(), TIMEOUT).unwrap();
    let ks_a = KeySpace::new("team-a", layout(0).fingerprint()).unwrap();
    let ks_b = KeySpace::new("team-a", layout(1).fingerprint()).unwrap();
    let v = raw
        .get(&[ks_a.key(&h[0]).unwrap()])
        .remove(0)
        .unwrap()
        .unwrap();
    assert!(raw.put(&[(ks_b.key(&h[0]).unwrap(), v)])[0].is_ok());
    assert_eq!(other_rank.probe_chain(&h).unwrap(), 1, "the key exists");
    assert!(other_rank.fetch(&h[..1], BLOCK).unwrap()[0].is_none());
    assert_eq!(other_rank.stats().snapshot().corrupt_values, 1);
}

#[test]
fn corrupted_truncated_or_foreign_values_are_counted_misses() {
    let cluster = Cluster::start(0, None);
    let h = hashes(4, 5);
    let mut t = tier(&cluster.seeds(), "c", &layout(0));
    let blocks: Vec<_> = h
        .iter()
        .enumerate()
        .map(|(i, h)| (*h, vec![block(i, BLOCK)]))
        .collect();
    t.store(&blocks).unwrap();
    let mut raw = RedisStore::connect(&cluster.seeds(), TIMEOUT).unwrap();
    let keys: Vec<_> = h.iter().map(|h| t.keys().key(h).unwrap()).collect();
    let mut values: Vec<Vec<u8>> = raw
        .get(&keys)
        .into_iter()
        .map(|v| v.unwrap().unwrap())
        .collect();
    values[0][200] ^= 0x10; // a flipped bit in the payload
    let n = values[1].len();
    values[1].truncate(n - 100); // cut short
    values[2] = b"written by someone else".to_vec();
    // Block 3's value under block 4's key: intact, but another block.
    values[4] = value::encode(t.keys().fingerprint(), &h[3], &[&block(3, BLOCK)]);
    let puts: Vec<_> = [0, 1, 2, 4]
        .iter()
        .map(|&i| (keys[i].clone(), values[i].clone()))
        .collect();
    assert!(raw.put(&puts).iter().all(Result::is_ok));

    let got = t.fetch(&h, BLOCK).unwrap();
    assert!(got[0].is_none() && got[1].is_none() && got[2].is_none() && got[4].is_none());
    assert_eq!(got[3].as_ref().unwrap().payload(), block(3, BLOCK));
    let s = t.stats().snapshot();
    assert_eq!((s.corrupt_values, s.get_hits), (4, 1));
}

#[test]
fn killed_master_costs_misses_within_the_deadline_then_failover_recovers() {
    let cluster = Cluster::start(1, None);
    let seeds = cluster.seeds();
    let via = Cluster::port(&seeds[0]);
    let h = hashes(5, 48);
    let mut t = tier(&seeds, "kill", &layout(0));
    let blocks: Vec<_> = h
        .iter()
        .enumerate()
        .map(|(i, h)| (*h, vec![block(i, BLOCK)]))
        .collect();
    assert_eq!(t.store(&blocks).unwrap(), 48);
    let masters = cluster.masters(via);
    // Every write reached a replica before the crash, so failover loses nothing.
    for m in &masters {
        cluster.wait_replicated(m.port);
    }
    let owner: Vec<u16> = h
        .iter()
        .map(|h| cluster.master_of(via, t.keys().key(h).unwrap().as_str()))
        .collect();
    let victim = owner[0];
    let survivor = masters
        .iter()
        .map(|m| m.port)
        .find(|&p| p != victim)
        .unwrap();
    cluster.kill(victim);

    let mut t = no_hang(HANG, move || {
        // Calls right after the crash: blocks on the dead master fail, the others load.
        for _ in 0..2 {
            let got = t.fetch(&h, BLOCK).unwrap();
            for (i, b) in got.iter().enumerate() {
                if let Some(b) = b {
                    assert_eq!(b.payload(), block(i, BLOCK), "never wrong bytes");
                } else {
                    assert_eq!(owner[i], victim, "block {i} on a live master must load");
                }
            }
            assert!(got.iter().any(Option::is_some));
        }
        assert!(t.stats().snapshot().failed_keys > 0);
        t
    });
    let h = hashes(5, 48);
    // After failover every block loads again (a replica took over the dead master's slots).
    let recovered = no_hang(HANG, move || loop {
        let got = t.fetch(&h, BLOCK).unwrap();
        for (i, b) in got.iter().enumerate() {
            if let Some(b) = b {
                assert_eq!(b.payload(), block(i, BLOCK), "never wrong bytes");
            }
        }
        if got.iter().all(Option::is_some) {
            break t.stats().snapshot();
        }
        std::thread::sleep(Duration::from_millis(200));
    });
    assert!(recovered.get_hits >= 48);
    assert!(cluster.masters(survivor).iter().all(|m| m.port != victim));
}

#[test]
fn frozen_master_times_out_then_failover_recovers() {
    let cluster = Cluster::start(1, None);
    let seeds = cluster.seeds();
    let via = Cluster::port(&seeds[0]);
    let h = hashes(8, 48);
    let mut t = tier(&seeds, "freeze", &layout(0));
    let blocks: Vec<_> = h
        .iter()
        .enumerate()
        .map(|(i, h)| (*h, vec![block(i, BLOCK)]))
        .collect();
    assert_eq!(t.store(&blocks).unwrap(), 48);
    for m in cluster.masters(via) {
        cluster.wait_replicated(m.port);
    }
    let victim = cluster.master_of(via, t.keys().key(&h[0]).unwrap().as_str());
    cluster.freeze(victim);
    let stats = no_hang(HANG, move || {
        let first = t.fetch(&h, BLOCK).unwrap();
        assert!(first[0].is_none(), "a frozen master answers nothing");
        assert!(t.stats().snapshot().timeouts > 0);
        loop {
            let got = t.fetch(&h, BLOCK).unwrap();
            for (i, b) in got.iter().enumerate() {
                if let Some(b) = b {
                    assert_eq!(b.payload(), block(i, BLOCK), "never wrong bytes");
                }
            }
            if got.iter().all(Option::is_some) {
                break t.stats().snapshot();
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    assert!(stats.get_hits >= 48);
    // A frozen process ignores SIGTERM until it runs again; the fixture's stop must not wait.
    cluster.kill(victim);
}

#[test]
fn moved_and_ask_redirections_are_followed() {
    let cluster = Cluster::start(0, None);
    let seeds = cluster.seeds();
    let via = Cluster::port(&seeds[0]);
    let mut t = tier(&seeds, "redirect", &layout(0));
    let h = hashes(6, 64);
    let keys: Vec<String> = h
        .iter()
        .map(|h| t.keys().key(h).unwrap().as_str().to_string())
        .collect();
    let blocks: Vec<_> = h
        .iter()
        .enumerate()
        .map(|(i, h)| (*h, vec![block(i, BLOCK)]))
        .collect();
    t.store(&blocks).unwrap();
    let masters = cluster.masters(via);
    let (src, src_id) = (masters[0].port, masters[0].id.clone());
    let (dst, dst_id) = (masters[1].port, masters[1].id.clone());
    let on_src: Vec<usize> = (0..h.len())
        .filter(|&i| cluster.master_of(via, &keys[i]) == src)
        .collect();
    let (a, b) = (on_src[0], on_src[1]);
    let (slot_a, slot_b) = (cluster.slot(via, &keys[a]), cluster.slot(via, &keys[b]));
    assert_ne!(slot_a, slot_b);
    let setslot = |port: u16, slot: u16, how: &str, id: &str| {
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(how)
            .arg(id)
            .query(&mut cluster.node(port))
            .unwrap();
    };
    let migrate = |key: &str| {
        let _: () = redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(dst)
            .arg(key)
            .arg(0)
            .arg(5000)
            .query(&mut cluster.node(src))
            .unwrap();
    };
    // Slot of block a moves to dst for good: the tier's cached route is stale (MOVED).
    setslot(dst, slot_a, "IMPORTING", &src_id);
    setslot(src, slot_a, "MIGRATING", &dst_id);
    migrate(&keys[a]);
    for m in &masters {
        setslot(m.port, slot_a, "NODE", &dst_id);
    }
    // Slot of block b is mid-migration: its key already moved, the slot did not (ASK).
    setslot(dst, slot_b, "IMPORTING", &src_id);
    setslot(src, slot_b, "MIGRATING", &dst_id);
    migrate(&keys[b]);

    let got = t.fetch(&[h[a], h[b]], BLOCK).unwrap();
    assert_eq!(got[0].as_ref().unwrap().payload(), block(a, BLOCK), "MOVED");
    assert_eq!(got[1].as_ref().unwrap().payload(), block(b, BLOCK), "ASK");
    assert_eq!(t.probe_chain(&[h[a], h[b]]).unwrap(), 2);
    assert_eq!(t.stats().snapshot().failed_keys, 0);
}

#[test]
fn refused_credentials_fail_at_connect_naming_the_url_without_the_password() {
    let cluster = Cluster::start(0, Some("right-pw"));
    let seeds = cluster.seeds();
    let port = Cluster::port(&seeds[0]);
    for url in [
        format!("redis://:wrong-pw@127.0.0.1:{port}"),
        format!("redis://default:wrong-pw@127.0.0.1:{port}"),
        format!("redis://127.0.0.1:{port}"),
    ] {
        let err = no_hang(HANG, move || {
            RedisStore::connect(&[url], TIMEOUT).unwrap_err()
        });
        let msg = err.to_string();
        assert!(matches!(err, TierError::Connect { .. }), "{err:?}");
        assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
        assert!(
            !msg.contains("wrong-pw") && !msg.contains("right-pw"),
            "{msg}"
        );
    }
    // The right password, as the default ACL user, works.
    let url = format!("redis://default:right-pw@127.0.0.1:{port}");
    let mut t = tier(&[url], "auth", &layout(0));
    let h = hashes(7, 2);
    t.store(&[(h[0], vec![block(0, 64)])]).unwrap();
    assert_eq!(t.probe_chain(&h).unwrap(), 1);
}
