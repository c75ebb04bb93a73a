//! Eviction policies of a pool, and the bounded ghost lists of the adaptive one.
//!
//! - `lru`: one list of evictable entries, least recently used first; eviction takes its head.
//! - `adaptive`: two lists, *probation* (entries not used since they came in) and *protected* (entries used
//!   again, or keys that came back from a ghost list). Each list keeps its evictable entries least recently used
//!   first. The keys last evicted from each list are remembered in its ghost list (at most `capacity` keys each).
//!   A target size for probation adapts as in ARC (Megiddo and Modha, FAST'03): a key coming back from the
//!   probation ghost raises it, one from the protected ghost lowers it. Eviction takes probation's head while
//!   probation is over its target, else the less recently used of the two heads, so a target of the whole pool
//!   is exactly LRU. One-off prompts (a scan) pass through probation without flushing what was used twice.
//!
//! The target moves by a sixteenth of ARC's step: a prompt misses in a run of pages (a returning conversation
//! brings back its whole history at once), and a whole run moving the target by a page each made it swing by a
//! prompt's length per request (docs/EVICTION.md has the measurements). It starts at half the pool.
use crate::error::{invalid, Result};
use crate::index::chain::{Key, KeyMap};

const NIL: u32 = u32::MAX;

/// The eviction policy of a pool (`IndexConfig(eviction_policy=...)`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    #[default]
    Lru,
    Adaptive,
}

impl Policy {
    pub const NAMES: [&'static str; 2] = ["lru", "adaptive"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "lru" => Ok(Self::Lru),
            "adaptive" => Ok(Self::Adaptive),
            other => Err(invalid(format!("eviction_policy must be 'lru' or 'adaptive', got {other:?}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Adaptive => "adaptive",
        }
    }
}

/// The adaptive target's unit: a sixteenth of a slot.
pub const TARGET_UNIT: u64 = 16;

#[derive(Clone, Copy, Debug)]
struct Node {
    key: Key,
    prev: u32,
    next: u32,
}

/// Keys recently evicted from one list, oldest first, at most `bound` of them: O(1) insert, remove and
/// membership. Nodes live in a slab reused through a free list, so the memory is that of the largest set held.
#[derive(Debug, Default)]
pub struct Ghosts {
    bound: usize,
    map: KeyMap<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl Ghosts {
    pub fn new(bound: usize) -> Self {
        Self { bound, head: NIL, tail: NIL, ..Self::default() }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    pub fn contains(&self, key: Key) -> bool {
        self.map.contains_key(&key)
    }

    /// Remembers `key` as the newest; the oldest is forgotten beyond the bound.
    pub fn insert(&mut self, key: Key) {
        if self.bound == 0 {
            return;
        }
        self.remove(key); // never expected (a resident key is no ghost); kept as the newest if it happens
        let node = Node { key, prev: self.tail, next: NIL };
        let at = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() as u32 - 1
            }
        };
        self.map.insert(key, at);
        if self.tail == NIL {
            self.head = at;
        } else {
            self.nodes[self.tail as usize].next = at;
        }
        self.tail = at;
        if self.map.len() > self.bound {
            let oldest = self.nodes[self.head as usize].key;
            self.remove(oldest);
        }
    }

    /// Forgets every key.
    pub fn clear(&mut self) {
        *self = Self::new(self.bound);
    }

    /// Forgets `key`; returns whether it was remembered.
    pub fn remove(&mut self, key: Key) -> bool {
        let Some(at) = self.map.remove(&key) else { return false };
        let Node { prev, next, .. } = self.nodes[at as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
        self.free.push(at);
        true
    }

    /// The keys remembered, oldest first.
    pub fn keys(&self) -> Vec<Key> {
        let mut out = Vec::with_capacity(self.map.len());
        let mut at = self.head;
        while at != NIL {
            out.push(self.nodes[at as usize].key);
            at = self.nodes[at as usize].next;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ghosts_forget_the_oldest_beyond_the_bound() {
        let mut g = Ghosts::new(3);
        for k in 1..=5 {
            g.insert(k);
        }
        assert_eq!(g.keys(), vec![3, 4, 5]);
        assert!(g.remove(4) && !g.remove(4));
        g.insert(6);
        g.insert(7);
        assert_eq!(g.keys(), vec![5, 6, 7]);
        assert!(g.nodes.len() <= 4, "nodes are reused");
        let mut off = Ghosts::new(0);
        off.insert(1);
        assert!(off.is_empty());
    }

    #[test]
    fn names_round_trip() {
        for name in Policy::NAMES {
            assert_eq!(Policy::parse(name).unwrap().name(), name);
        }
        assert!(Policy::parse("arc").unwrap_err().to_string().contains("\"arc\""));
    }
}
