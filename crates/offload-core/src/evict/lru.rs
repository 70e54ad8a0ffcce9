//! [`Lru`]: exact least-recently-used order as an intrusive doubly linked list.

use crate::key::BlockId;

use super::EvictionPolicy;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Links {
    prev: u32,
    next: u32,
    linked: bool,
}

/// Least-recently-used order as an intrusive doubly linked list over the block slab.
///
/// # Examples
/// ```
/// use offload_core::{EvictionPolicy, Lru};
///
/// let mut lru = Lru::new(3);
/// lru.insert(0);
/// lru.insert(1);
/// lru.insert(2);
/// lru.remove(0); // pinned by a lookup
/// lru.insert(0); // released again: now the most recently used
/// assert_eq!(lru.pop_victim(), Some(1));
/// ```
#[derive(Debug, Clone)]
pub struct Lru {
    links: Vec<Links>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    /// An empty LRU for block ids `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        Self {
            links: vec![
                Links {
                    prev: NIL,
                    next: NIL,
                    linked: false,
                };
                capacity as usize
            ],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    fn unlink(&mut self, block: BlockId) {
        let Links { prev, next, .. } = self.links[block as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        self.links[block as usize] = Links {
            prev: NIL,
            next: NIL,
            linked: false,
        };
        self.len -= 1;
    }
}

impl EvictionPolicy for Lru {
    fn insert(&mut self, block: BlockId) {
        let Some(l) = self.links.get(block as usize) else {
            return;
        };
        if l.linked {
            self.unlink(block);
        }
        self.links[block as usize] = Links {
            prev: self.tail,
            next: NIL,
            linked: true,
        };
        if self.tail == NIL {
            self.head = block;
        } else {
            self.links[self.tail as usize].next = block;
        }
        self.tail = block;
        self.len += 1;
    }

    fn remove(&mut self, block: BlockId) {
        if self.contains(block) {
            self.unlink(block);
        }
    }

    fn pop_victim(&mut self) -> Option<BlockId> {
        let victim = self.head;
        if victim == NIL {
            return None;
        }
        self.unlink(victim);
        Some(victim)
    }

    fn contains(&self, block: BlockId) -> bool {
        self.links.get(block as usize).is_some_and(|l| l.linked)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn clear(&mut self) {
        for l in &mut self.links {
            *l = Links {
                prev: NIL,
                next: NIL,
                linked: false,
            };
        }
        self.head = NIL;
        self.tail = NIL;
        self.len = 0;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn victims_come_oldest_first() {
        let mut lru = Lru::new(4);
        for b in [2, 0, 3] {
            lru.insert(b);
        }
        assert_eq!(lru.len(), 3);
        assert_eq!(lru.pop_victim(), Some(2));
        assert_eq!(lru.pop_victim(), Some(0));
        assert_eq!(lru.pop_victim(), Some(3));
        assert_eq!(lru.pop_victim(), None);
        assert!(lru.is_empty());
    }

    #[test]
    fn reinsert_moves_to_most_recent() {
        let mut lru = Lru::new(3);
        lru.insert(0);
        lru.insert(1);
        lru.insert(0);
        assert_eq!(lru.len(), 2);
        assert_eq!(lru.pop_victim(), Some(1));
    }

    #[test]
    fn out_of_range_ids_are_ignored() {
        let mut lru = Lru::new(1);
        lru.insert(5);
        lru.remove(5);
        assert!(!lru.contains(5));
        assert!(lru.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32),
        Remove(u32),
        Pop,
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u32..16).prop_map(Op::Insert),
            3 => (0u32..16).prop_map(Op::Remove),
            2 => Just(Op::Pop),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// The intrusive list behaves exactly like a queue with move-to-back.
        #[test]
        fn lru_matches_a_reference_queue(ops in proptest::collection::vec(op(), 1..200)) {
            let mut lru = Lru::new(16);
            let mut model: VecDeque<u32> = VecDeque::new();
            for op in ops {
                match op {
                    Op::Insert(b) => {
                        model.retain(|&x| x != b);
                        model.push_back(b);
                        lru.insert(b);
                    }
                    Op::Remove(b) => {
                        model.retain(|&x| x != b);
                        lru.remove(b);
                    }
                    Op::Pop => prop_assert_eq!(lru.pop_victim(), model.pop_front()),
                    Op::Clear => {
                        model.clear();
                        lru.clear();
                    }
                }
                prop_assert_eq!(lru.len(), model.len());
                for b in 0..16 {
                    prop_assert_eq!(lru.contains(b), model.contains(&b));
                }
            }
        }
    }
}
