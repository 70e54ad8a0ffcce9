//! Unit tests of [`BlockCache`]: eviction, pinning, aborts and resets, and a property test
//! that checks every invariant after every operation against a model of the cache.
#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;

fn key(h: u128) -> BlockKey {
    BlockKey::new(0, BlockHash(h))
}

#[test]
fn full_pool_evicts_least_recently_used_ready_block() {
    let mut cache = BlockCache::new(2, true);
    let a = cache.reserve(key(1)).unwrap();
    let b = cache.reserve(key(2)).unwrap();
    cache.publish(a).unwrap();
    cache.publish(b).unwrap();
    let c = cache.reserve(key(3)).unwrap();
    assert_eq!(c, a);
    assert!(!cache.contains(&key(1)));
    assert_eq!(
        cache.drain_events(),
        vec![KvEvent::Removed {
            group: 0,
            hashes: vec![BlockHash(1)]
        }]
    );
    cache.check_invariants().unwrap();
}

#[test]
fn pinned_and_pending_blocks_are_never_evicted() {
    let mut cache = BlockCache::new(2, false);
    let a = cache.reserve(key(1)).unwrap();
    cache.publish(a).unwrap();
    cache.pin(a).unwrap();
    let _pending = cache.reserve(key(2)).unwrap();
    assert!(cache.reserve(key(3)).is_none());
    cache.unpin(a).unwrap();
    assert_eq!(cache.reserve(key(3)), Some(a));
}

#[test]
fn duplicate_keys_are_not_reserved_twice() {
    let mut cache = BlockCache::new(2, false);
    cache.reserve(key(1)).unwrap();
    assert!(cache.reserve(key(1)).is_none());
}

#[test]
fn aborted_store_is_never_served_and_frees_its_block() {
    let mut cache = BlockCache::new(1, false);
    let a = cache.reserve(key(1)).unwrap();
    cache.abort(a).unwrap();
    assert_eq!(cache.ready_prefix(0, &[BlockHash(1)]), 0);
    assert_eq!(cache.pool().num_free(), 1);
    cache.check_invariants().unwrap();
}

#[test]
fn clear_frees_idle_blocks_and_detaches_busy_ones() {
    let mut cache = BlockCache::new(3, true);
    let idle = cache.reserve(key(1)).unwrap();
    cache.publish(idle).unwrap();
    let loading = cache.reserve(key(2)).unwrap();
    cache.publish(loading).unwrap();
    cache.pin(loading).unwrap();
    let storing = cache.reserve(key(3)).unwrap();
    cache.clear();
    cache.check_invariants().unwrap();
    assert_eq!(cache.pool().num_free(), 1);
    assert_eq!(cache.ready_prefix(0, &[BlockHash(2)]), 0);
    // The late store completion must not publish into the new epoch.
    cache.publish(storing).unwrap();
    assert_eq!(cache.ready_prefix(0, &[BlockHash(3)]), 0);
    cache.unpin(loading).unwrap();
    assert_eq!(cache.pool().num_free(), 3);
    cache.check_invariants().unwrap();
    assert_eq!(cache.drain_events(), vec![KvEvent::AllCleared]);
}

#[derive(Debug, Clone)]
enum Op {
    Reserve(u8),
    Publish(u8),
    Abort(u8),
    Lookup(u8),
    Invalidate(u8),
    Release(u8),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => any::<u8>().prop_map(Op::Reserve),
        4 => any::<u8>().prop_map(Op::Publish),
        1 => any::<u8>().prop_map(Op::Abort),
        4 => any::<u8>().prop_map(Op::Lookup),
        1 => any::<u8>().prop_map(Op::Invalidate),
        4 => any::<u8>().prop_map(Op::Release),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Random stores, completions, pinned lookups, releases and resets against a
    /// model of which keys are servable and how many pins each block holds.
    #[test]
    fn cache_keeps_its_invariants(ops in proptest::collection::vec(op(), 1..300)) {
        const CAP: u32 = 8;
        let mut cache = BlockCache::new(CAP, true);
        // Model: in-flight stores (block -> key), pins held by lookups, servable keys.
        let mut storing: Vec<(BlockId, BlockKey)> = Vec::new();
        let mut lookup_pins: Vec<BlockId> = Vec::new();
        let mut servable: HashSet<BlockKey> = HashSet::new();
        for op in ops {
            match op {
                Op::Reserve(k) => {
                    let k = key(u128::from(k % 24));
                    let present = cache.contains(&k);
                    match cache.reserve(k) {
                        Some(b) => {
                            prop_assert!(!present);
                            prop_assert!(storing.iter().all(|(x, _)| *x != b));
                            prop_assert!(!lookup_pins.contains(&b));
                            storing.push((b, k));
                        }
                        None => {
                            let all_busy = storing.len() + lookup_pins.iter().collect::<HashSet<_>>().len() >= CAP as usize;
                            prop_assert!(present || all_busy || cache.num_evictable() == 0);
                        }
                    }
                }
                Op::Publish(i) | Op::Abort(i) if !storing.is_empty() => {
                    let (b, k) = storing.remove(usize::from(i) % storing.len());
                    let indexed = cache.index().get(&k) == Some(b);
                    if matches!(op, Op::Publish(_)) {
                        cache.publish(b).unwrap();
                        if indexed { servable.insert(k); }
                    } else {
                        cache.abort(b).unwrap();
                    }
                }
                Op::Lookup(k) => {
                    // Any block may be the guess: only a ready one holding the key
                    // may be served.
                    let guess = u32::from(k / 24) % (CAP + 1);
                    let k = key(u128::from(k % 24));
                    prop_assert_eq!(cache.get_ready_near(&k, guess), cache.get_ready(&k));
                    if let Some(b) = cache.get_ready(&k) {
                        prop_assert!(servable.contains(&k), "served a key whose store did not complete");
                        cache.pin(b).unwrap();
                        lookup_pins.push(b);
                    }
                }
                Op::Invalidate(k) => {
                    let k = key(u128::from(k % 24));
                    if let Some(b) = cache.index().get(&k) {
                        cache.invalidate(b).unwrap();
                        prop_assert!(cache.get_ready(&k).is_none(), "an invalidated key is served");
                        servable.remove(&k);
                    }
                }
                Op::Release(i) if !lookup_pins.is_empty() => {
                    let b = lookup_pins.remove(usize::from(i) % lookup_pins.len());
                    cache.unpin(b).unwrap();
                }
                Op::Clear => {
                    cache.clear();
                    servable.clear();
                }
                _ => {}
            }
            // Evictions silently drop servable keys; keep the model in step.
            servable.retain(|k| cache.get_ready(k).is_some());
            if let Err(e) = cache.check_invariants() {
                prop_assert!(false, "{}", e);
            }
            let mut pins: HashMap<BlockId, u32> = HashMap::new();
            for b in &lookup_pins { *pins.entry(*b).or_default() += 1; }
            for (b, _) in &storing { *pins.entry(*b).or_default() += 1; }
            for b in 0..CAP {
                prop_assert_eq!(cache.pool().ref_count(b).unwrap(), pins.get(&b).copied().unwrap_or(0));
            }
            prop_assert!(cache.pool().num_free() <= CAP as usize);
        }
    }
}
