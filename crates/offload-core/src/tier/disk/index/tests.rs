//! The index's unit tests: the clock hand's placement, restores, tags, and random
//! operations against the invariants.

#![allow(clippy::unwrap_used)]

use super::*;

/// A geometry of `slots` slots of 4000-byte blocks, entries in one set where they fit.
fn geo(slots: u64) -> Geometry {
    let g = Geometry::fit(Geometry::capacity_for(slots, 4000).unwrap(), 4000, 1).unwrap();
    assert_eq!(g.slots, slots);
    g
}

fn put(ix: &mut SlotIndex, d: u128) -> (u64, u64, Vec<u64>) {
    let mut evicted = Vec::new();
    let Placement::Write { entry, slot } = ix.place(d, &mut evicted) else {
        panic!("{d} not placed")
    };
    ix.finish_write(entry, true);
    ix.check_invariants().unwrap();
    (entry, slot, evicted)
}

#[test]
fn a_batch_goes_to_consecutive_slots_and_the_clock_keeps_blocks_in_use() {
    let mut ix = SlotIndex::new(geo(8));
    let slots: Vec<u64> = (1..=8u128).map(|d| put(&mut ix, d).1).collect();
    assert_eq!(slots, (0..8).collect::<Vec<_>>(), "in order from the hand");
    assert_eq!(ix.resident(), 8);
    // Block 1 (slot 0) is read: the hand passes it once; block 2 (slot 1) goes.
    let l = ix.begin_read(1).unwrap();
    assert_eq!(l.slot, 0);
    ix.end_read(l.entry);
    let (_, slot, evicted) = put(&mut ix, 9);
    assert_eq!(slot, 1);
    assert_eq!(evicted.len(), 1);
    assert_eq!(ix.find(2), None);
    // A block being read is never a victim; nor is one being written.
    let held = ix.begin_read(3).unwrap();
    let mut ev = Vec::new();
    let Placement::Write { entry, slot } = ix.place(10, &mut ev) else {
        panic!()
    };
    assert_eq!(slot, 3, "slot 2 (block 3) is being read");
    assert_eq!(ix.find(10), None, "not readable while written");
    assert_eq!(
        ix.place(10, &mut ev),
        Placement::Present,
        "written by another batch"
    );
    ix.finish_write(entry, true);
    ix.end_read(held.entry);
    ix.check_invariants().unwrap();
    // Every block held by a reader: nothing can go.
    let all: Vec<Location> = [1u128, 3, 9, 10, 5, 6, 7, 8]
        .iter()
        .map(|&d| ix.begin_read(d).unwrap())
        .collect();
    assert_eq!(ix.place(11, &mut ev), Placement::Busy);
    for l in all {
        ix.end_read(l.entry);
    }
    assert_eq!(ix.resident(), 8);
    ix.check_invariants().unwrap();
}

#[test]
fn a_failed_write_frees_its_slot_and_entry() {
    let mut ix = SlotIndex::new(geo(4));
    let mut ev = Vec::new();
    let Placement::Write { entry, slot } = ix.place(7, &mut ev) else {
        panic!()
    };
    ix.finish_write(entry, false);
    ix.check_invariants().unwrap();
    assert_eq!(ix.resident(), 0);
    assert_eq!(ix.find(7), None);
    // The hand moved on; the freed slot is taken when it comes round again.
    let taken: Vec<u64> = (10..14u128).map(|d| put(&mut ix, d).1).collect();
    assert_eq!(taken, [1, 2, 3, slot]);
}

#[test]
fn of_two_entries_naming_one_slot_the_later_write_is_restored() {
    let mut ix = SlotIndex::new(geo(4));
    assert_eq!(ix.restore(0, 5, 10, 2), None);
    assert_eq!(ix.restore(1, 6, 4, 2), Some(1), "older: loses");
    assert_eq!(ix.find(5), Some(0));
    assert_eq!(ix.restore(2, 7, 12, 2), Some(0), "newer: wins");
    assert_eq!(ix.find(5), None);
    assert_eq!(ix.find(7), Some(2));
    assert_eq!(
        ix.restore(3, 8, 13, 9),
        None,
        "a slot past the file is not restored"
    );
    assert_eq!(ix.find(8), None);
    assert_eq!(ix.resident(), 1);
    ix.check_invariants().unwrap();
    // The hand goes on after the latest write.
    assert_eq!(put(&mut ix, 40).1, 3);
}

#[test]
fn random_operations_keep_the_invariants() {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut ix = SlotIndex::new(geo(40));
    let mut writing: Vec<u64> = Vec::new();
    let mut reading: Vec<u64> = Vec::new();
    let mut ev = Vec::new();
    for _ in 0..20_000 {
        let d = u128::from(next() % 120 + 1) << 64 | u128::from(next() % 3);
        match next() % 6 {
            0 | 1 => {
                if let Placement::Write { entry, .. } = ix.place(d, &mut ev) {
                    writing.push(entry);
                }
            }
            2 if !writing.is_empty() => {
                let e = writing.swap_remove((next() % writing.len() as u64) as usize);
                ix.finish_write(e, next() % 8 != 0);
            }
            3 => {
                if let Some(l) = ix.begin_read(d) {
                    reading.push(l.entry);
                }
            }
            4 if !reading.is_empty() => {
                let e = reading.swap_remove((next() % reading.len() as u64) as usize);
                ix.end_read(e);
            }
            5 => {
                if let Some(e) = ix.find(d) {
                    if !reading.contains(&e) {
                        ix.drop_entry(e, d);
                    }
                }
            }
            _ => {}
        }
        ix.check_invariants().unwrap();
        // A readable block's slot is its own.
        if let Some(e) = ix.find(d) {
            let s = ix.slot_of(e);
            assert_eq!(ix.owners[s as usize], e as u32 + 1);
        }
    }
}

#[test]
fn a_tag_match_with_another_digest_is_not_a_hit() {
    let mut ix = SlotIndex::with_slots(128).unwrap();
    assert_eq!(ix.bytes_per_slot(), 55.0);
    assert_eq!(ix.slots(), 128);
    // Same set (high half), same tag (low 16 bits), another digest.
    let a = 5u128 << 64 | 0x1234_0007;
    let b = 5u128 << 64 | 0x9999_0007;
    let Placement::Write { entry, .. } = ix.place(a, &mut Vec::new()) else {
        panic!()
    };
    ix.finish_write(entry, true);
    assert_eq!(ix.find(a), Some(entry));
    assert_eq!(ix.find(b), None);
    let mut found = Vec::new();
    ix.find_many(&[b, a, b, a], &mut found);
    assert_eq!(found, [None, Some(entry), None, Some(entry)]);
    ix.drop_entry(entry, a);
    assert_eq!(ix.find(a), None, "a dropped block's tag is cleared");
    assert_eq!(ix.resident(), 0);
    ix.check_invariants().unwrap();
}

#[test]
fn find_many_agrees_with_find_on_hits_misses_and_tag_collisions() {
    let mut ix = SlotIndex::with_slots(64 * 16).unwrap();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut keys = Vec::new();
    for _ in 0..600 {
        let d = u128::from(next()) << 64 | u128::from(next());
        if let Placement::Write { entry, .. } = ix.place(d, &mut Vec::new()) {
            ix.finish_write(entry, true);
        }
        // A miss in the same set with the same tag, and a plain miss.
        keys.extend([
            d,
            d ^ 0x1_0000,
            u128::from(next()) << 64 | u128::from(next()),
        ]);
    }
    let want: Vec<_> = keys.iter().map(|&d| ix.find(d)).collect();
    assert!(want.iter().filter(|s| s.is_some()).count() > 500);
    let mut got = Vec::new();
    // Batches shorter than the lookahead, of one chunk, and of several plus a tail.
    for len in [1, 5, 64, 200, keys.len()] {
        ix.find_many(&keys[..len], &mut got);
        assert_eq!(got, want[..len]);
    }
}
