//! A fixed set of host slots with LRU eviction, where only evictable entries sit in the eviction order.
//!
//! An entry leaves the LRU list when it is acquired (refs 0 -> 1) or while it is not ready, and re-enters at the
//! most-recent end when it is ready with refs back at 0 (released), so eviction pops the least-recent end in O(1)
//! and never walks past an entry in use. Entries live in a slab indexed by slot; the list links are slot indices.
//!
//! The bookkeeping grows with the slots handed out, not with the capacity: a pool of two billion slots costs
//! nothing until its slots are used (slots never used are a counter, not a list).
//!
//! Entries belong to the pool's epoch they were reserved in. `retire_all` (the model changed) starts a new epoch
//! and drops every evictable entry; an entry of an older epoch still in use can never become ready and is dropped
//! when its last reference goes.
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::chain::Key;
use crate::error::{Error, Result};

const NIL: u32 = u32::MAX;

/// Keys are uniform 128-bit hashes already: hash them by their low 64 bits.
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

pub type KeyMap<V> = HashMap<Key, V, BuildHasherDefault<KeyHasher>>;

#[derive(Clone, Debug)]
struct Slot {
    /// The entry in this slot, if any.
    entry: Option<Entry>,
    /// The pool's epoch when the entry was reserved.
    epoch: u32,
    prev: u32,
    next: u32,
}

/// What a used slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub key: Key,
    /// In-flight transfers or puts touching the entry; it cannot be evicted while > 0.
    pub refs: u32,
    /// The host copy is complete.
    pub ready: bool,
}

#[derive(Debug)]
pub struct Pool {
    /// Slots handed out at least once (slot i at index i); slots `slots.len()..usable` were never used.
    slots: Vec<Slot>,
    capacity: u32,
    /// Number of slots usable now (a lazily grown pool starts small); slots >= `usable` are not handed out.
    usable: u32,
    map: KeyMap<u32>,
    /// Slots freed after use (evicted to `evict_one`, discarded), taken again last-freed first before fresh ones.
    free: Vec<u32>,
    head: u32,
    tail: u32,
    evictable: usize,
    evicted: u64,
    epoch: u32,
    /// Entries dropped by `retire_all` (at once or at their last release).
    retired: u64,
}

impl Pool {
    /// A pool of `capacity` slots, of which the first `usable` can be handed out now.
    pub fn new(capacity: u32, usable: u32) -> Self {
        let mut pool = Self {
            slots: Vec::new(),
            capacity,
            usable: 0,
            map: KeyMap::default(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            evictable: 0,
            evicted: 0,
            epoch: 0,
            retired: 0,
        };
        pool.grow(usable.min(capacity));
        pool
    }

    /// Makes slots up to `usable` available (a pin step of the host pool was pinned). Never shrinks.
    pub fn grow(&mut self, usable: u32) {
        let usable = usable.min(self.capacity());
        self.usable = self.usable.max(usable);
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }
    pub fn usable(&self) -> u32 {
        self.usable
    }
    pub fn used(&self) -> usize {
        self.map.len()
    }
    /// Slots handed out at least once (`0..n`; slots above were never used).
    pub fn slots_handed_out(&self) -> std::ops::Range<u32> {
        0..self.slots.len() as u32
    }

    /// Usable slots holding no entry.
    pub fn free(&self) -> usize {
        self.free.len() + self.fresh()
    }

    /// Usable slots never handed out.
    fn fresh(&self) -> usize {
        self.usable as usize - self.slots.len()
    }

    /// A slot holding no entry: the last freed, else the lowest never used (the pool fills from the bottom).
    fn take_free(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        if self.fresh() == 0 {
            return None;
        }
        self.slots.push(Slot { entry: None, epoch: 0, prev: NIL, next: NIL });
        Some(self.slots.len() as u32 - 1)
    }
    pub fn evictable(&self) -> usize {
        self.evictable
    }
    pub fn evicted(&self) -> u64 {
        self.evicted
    }
    pub fn retired(&self) -> u64 {
        self.retired
    }

    /// Starts a new epoch (the bytes behind every key changed meaning: the model was updated): every evictable
    /// entry is dropped now; an entry still in use keeps its slot until its last release, never becomes ready, and
    /// is dropped then. Returns the entries dropped now.
    pub fn retire_all(&mut self) -> usize {
        self.epoch = self.epoch.wrapping_add(1);
        let mut n = 0;
        while let Some((slot, _)) = self.pop_lru() {
            self.evicted -= 1; // not an eviction: counted as retired
            self.free.push(slot);
            n += 1;
        }
        self.retired += n as u64;
        n
    }

    /// Whether the entry in `slot` was reserved before the last `retire_all`.
    fn is_retired(&self, slot: u32) -> bool {
        self.slots.get(slot as usize).is_some_and(|s| s.epoch != self.epoch)
    }

    /// Empties a slot whose entry has no references, returning it to the free slots.
    fn drop_entry(&mut self, slot: u32) {
        let entry = self.slots[slot as usize].entry.take().expect("a used slot");
        self.map.remove(&entry.key);
        self.free.push(slot);
    }

    pub fn slot_of(&self, key: Key) -> Option<u32> {
        self.map.get(&key).copied()
    }

    pub fn entry(&self, slot: u32) -> Option<Entry> {
        self.slots.get(slot as usize).and_then(|s| s.entry)
    }

    /// The slot of `key` when its host copy is complete.
    pub fn ready_slot(&self, key: Key) -> Option<u32> {
        self.slot_of(key).filter(|&s| self.slots[s as usize].entry.is_some_and(|e| e.ready))
    }

    /// Slots that a reservation could get now: free ones plus evictable ones.
    pub fn available(&self) -> usize {
        self.free() + self.evictable
    }

    /// Takes one slot for each of `keys` (none may be present), evicting least-recent entries as needed: all of
    /// them or, when not enough slots are free or evictable, none (and nothing is evicted). New entries are acquired
    /// (refs 1) and not ready. Returns the slots and the keys evicted.
    pub fn reserve(&mut self, keys: &[Key]) -> Option<(Vec<u32>, Vec<Key>)> {
        if keys.len() > self.available() {
            return None;
        }
        debug_assert!(keys.iter().all(|k| !self.map.contains_key(k)), "reserve of a present key");
        let mut slots = Vec::with_capacity(keys.len());
        let mut evicted = Vec::new();
        for &key in keys {
            let slot = match self.take_free() {
                Some(s) => s,
                None => {
                    let (s, old) = self.pop_lru().expect("available() counted an evictable entry");
                    evicted.push(old);
                    s
                }
            };
            let s = &mut self.slots[slot as usize];
            s.entry = Some(Entry { key, refs: 1, ready: false });
            s.epoch = self.epoch;
            self.map.insert(key, slot);
            slots.push(slot);
        }
        Some((slots, evicted))
    }

    /// Evicts the least-recently-used evictable entry; its slot becomes free. Returns its key.
    pub fn evict_one(&mut self) -> Option<Key> {
        let (slot, key) = self.pop_lru()?;
        self.free.push(slot);
        Some(key)
    }

    /// Takes the least-recently-used evictable entry out, leaving its slot to the caller.
    fn pop_lru(&mut self) -> Option<(u32, Key)> {
        let slot = self.head;
        if slot == NIL {
            return None;
        }
        self.unlink(slot);
        let entry = self.slots[slot as usize].entry.take().expect("listed slot has an entry");
        self.map.remove(&entry.key);
        self.evicted += 1;
        Some((slot, entry.key))
    }

    /// Takes a reference: the entry leaves the eviction order.
    pub fn acquire(&mut self, slot: u32) -> Result<()> {
        let e = self.entry_mut(slot)?;
        e.refs += 1;
        let listed = e.refs == 1 && e.ready;
        if listed {
            self.unlink(slot);
        }
        Ok(())
    }

    /// Drops a reference; an entry that is ready with no references re-enters at the most-recent end (an entry of
    /// an earlier epoch is dropped instead).
    pub fn release(&mut self, slot: u32) -> Result<()> {
        let retired = self.is_retired(slot);
        let e = self.entry_mut(slot)?;
        if e.refs == 0 {
            return Err(Error::Invariant(format!("release of slot {slot} with no references")));
        }
        e.refs -= 1;
        let (free, ready) = (e.refs == 0, e.ready);
        if free && retired {
            self.drop_entry(slot);
            self.retired += 1;
        } else if free && ready {
            self.push_back(slot);
        }
        Ok(())
    }

    /// Marks an acquired entry's host copy complete (it stays acquired until released). An entry of an earlier
    /// epoch stays not ready: its bytes belong to what was retired.
    pub fn mark_ready(&mut self, slot: u32) -> Result<()> {
        let retired = self.is_retired(slot);
        let e = self.entry_mut(slot)?;
        if e.refs == 0 {
            return Err(Error::Invariant(format!("mark_ready of slot {slot} with no references")));
        }
        e.ready |= !retired;
        Ok(())
    }

    /// Removes an acquired, not-ready entry whose copy failed; its slot becomes free.
    pub fn discard(&mut self, slot: u32) -> Result<()> {
        let e = *self.entry_mut(slot)?;
        if e.ready || e.refs != 1 {
            return Err(Error::Invariant(format!("discard of slot {slot} that is ready or shared ({e:?})")));
        }
        self.drop_entry(slot);
        Ok(())
    }

    /// Moves an evictable entry to the most-recent end (a hit or a re-store).
    pub fn touch(&mut self, slot: u32) {
        if self.entry(slot).is_some_and(|e| e.refs == 0 && e.ready) {
            self.unlink(slot);
            self.push_back(slot);
        }
    }

    /// Keys in eviction order, least recent first.
    pub fn lru_keys(&self) -> Vec<Key> {
        let mut out = Vec::with_capacity(self.evictable);
        let mut s = self.head;
        while s != NIL {
            out.push(self.slots[s as usize].entry.expect("listed slot has an entry").key);
            s = self.slots[s as usize].next;
        }
        out
    }

    /// Every structural invariant; used by tests and by `Index::check`.
    pub fn check(&self) -> Result<()> {
        let fail = |m: String| Err(Error::Invariant(m));
        let used = self.slots.iter().filter(|s| s.entry.is_some()).count();
        if used != self.map.len() {
            return fail(format!("{used} used slots but {} keys", self.map.len()));
        }
        if used + self.free() != self.usable as usize || self.slots.len() > self.usable as usize {
            return fail(format!(
                "used {used} + free {} != usable {} (handed out {})",
                self.free(),
                self.usable,
                self.slots.len()
            ));
        }
        for (&key, &slot) in &self.map {
            if self.slots[slot as usize].entry.map(|e| e.key) != Some(key) {
                return fail(format!("key {key:032x} maps to slot {slot} holding another key"));
            }
        }
        let mut seen = vec![false; self.slots.len()];
        for &s in &self.free {
            if s as usize >= self.slots.len()
                || self.slots[s as usize].entry.is_some()
                || std::mem::replace(&mut seen[s as usize], true)
            {
                return fail(format!("free slot {s} is unusable, used or listed twice"));
            }
        }
        let listed = self.lru_keys();
        let should = self.slots.iter().filter(|s| s.entry.is_some_and(|e| e.refs == 0 && e.ready)).count();
        if listed.len() != should || listed.len() != self.evictable {
            return fail(format!(
                "LRU lists {} entries, {} are evictable, counter {}",
                listed.len(),
                should,
                self.evictable
            ));
        }
        Ok(())
    }

    fn entry_mut(&mut self, slot: u32) -> Result<&mut Entry> {
        self.slots
            .get_mut(slot as usize)
            .and_then(|s| s.entry.as_mut())
            .ok_or_else(|| Error::Invariant(format!("slot {slot} holds no entry")))
    }

    fn unlink(&mut self, slot: u32) {
        let (prev, next) = {
            let s = &self.slots[slot as usize];
            (s.prev, s.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        let s = &mut self.slots[slot as usize];
        s.prev = NIL;
        s.next = NIL;
        self.evictable -= 1;
    }

    fn push_back(&mut self, slot: u32) {
        let tail = self.tail;
        {
            let s = &mut self.slots[slot as usize];
            s.prev = tail;
            s.next = NIL;
        }
        if tail == NIL {
            self.head = slot;
        } else {
            self.slots[tail as usize].next = slot;
        }
        self.tail = slot;
        self.evictable += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ready(pool: &mut Pool, keys: &[Key]) -> Vec<u32> {
        let (slots, _) = pool.reserve(keys).unwrap();
        for &s in &slots {
            pool.mark_ready(s).unwrap();
            pool.release(s).unwrap();
        }
        slots
    }

    #[test]
    fn reservation_is_all_or_nothing() {
        let mut p = Pool::new(4, 4);
        ready(&mut p, &[1, 2, 3]);
        let held = p.slot_of(1).unwrap();
        p.acquire(held).unwrap();
        assert!(p.reserve(&[10, 11, 12, 13]).is_none());
        assert_eq!(p.used(), 3, "a failed reservation evicts nothing");
        let (slots, evicted) = p.reserve(&[10, 11, 12]).unwrap();
        assert_eq!(slots.len(), 3);
        assert_eq!(evicted, vec![2, 3]);
        assert!(p.slot_of(1).is_some(), "an acquired entry survives");
        p.check().unwrap();
    }

    #[test]
    fn lru_order_follows_touch_and_release() {
        let mut p = Pool::new(8, 8);
        ready(&mut p, &[1, 2, 3]);
        p.touch(p.slot_of(1).unwrap());
        assert_eq!(p.lru_keys(), vec![2, 3, 1]);
        let s2 = p.slot_of(2).unwrap();
        p.acquire(s2).unwrap();
        assert_eq!(p.lru_keys(), vec![3, 1]);
        p.release(s2).unwrap();
        assert_eq!(p.lru_keys(), vec![3, 1, 2]);
        assert_eq!(p.evict_one(), Some(3));
        p.check().unwrap();
    }

    #[test]
    fn grow_adds_usable_slots() {
        let mut p = Pool::new(8, 2);
        assert!(p.reserve(&[1, 2, 3]).is_none());
        p.grow(5);
        assert_eq!(p.reserve(&[1, 2, 3]).unwrap().0, vec![0, 1, 2]);
        p.check().unwrap();
    }

    #[test]
    fn a_huge_pool_allocates_only_the_slots_it_hands_out() {
        let mut p = Pool::new(2_000_000_000, 2_000_000_000);
        assert_eq!(p.free(), 2_000_000_000);
        assert_eq!(p.reserve(&[1, 2]).unwrap().0, vec![0, 1]);
        assert!(p.slots.capacity() < 1024, "bookkeeping of {} slots", p.slots.capacity());
        p.check().unwrap();
    }

    #[test]
    fn freed_slots_are_taken_again_before_fresh_ones() {
        let mut p = Pool::new(8, 2);
        ready(&mut p, &[1, 2]);
        assert_eq!(p.evict_one(), Some(1));
        p.grow(4);
        assert_eq!(p.reserve(&[3, 4, 5]).unwrap().0, vec![0, 2, 3]);
        p.check().unwrap();
    }

    #[test]
    fn misuse_is_an_error_not_a_panic() {
        let mut p = Pool::new(2, 2);
        assert!(p.release(0).is_err());
        let s = ready(&mut p, &[7])[0];
        assert!(p.release(s).is_err());
        assert!(p.discard(s).is_err());
        assert!(p.mark_ready(s).is_err());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Reserve(Vec<u8>),
        Complete(u8),
        Fail(u8),
        Acquire(u8),
        Release(u8),
        Touch(u8),
        Evict,
        Retire,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..6).prop_map(Op::Reserve),
            any::<u8>().prop_map(Op::Complete),
            any::<u8>().prop_map(Op::Fail),
            any::<u8>().prop_map(Op::Acquire),
            any::<u8>().prop_map(Op::Release),
            any::<u8>().prop_map(Op::Touch),
            Just(Op::Evict),
            Just(Op::Retire),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn random_operations_keep_every_invariant(ops in prop::collection::vec(op(), 1..200), cap in 1u32..12) {
            let mut p = Pool::new(cap, cap);
            // Slots whose entry is held by a pending copy (not ready).
            let mut pending: Vec<u32> = Vec::new();
            // Extra references we took on ready entries.
            let mut held: Vec<u32> = Vec::new();
            // Pending entries of an epoch that was retired.
            let mut retired: Vec<u32> = Vec::new();
            for op in ops {
                match op {
                    Op::Reserve(raw) => {
                        let mut keys: Vec<Key> = raw.iter().map(|&k| Key::from(k) + 1).collect();
                        keys.sort_unstable();
                        keys.dedup();
                        keys.retain(|k| p.slot_of(*k).is_none());
                        let before: Vec<Entry> = (0..cap).filter_map(|s| p.entry(s)).collect();
                        match p.reserve(&keys) {
                            Some((slots, evicted)) => {
                                prop_assert_eq!(slots.len(), keys.len());
                                for k in &evicted {
                                    let e = before.iter().find(|e| e.key == *k).unwrap();
                                    prop_assert!(e.refs == 0 && e.ready, "evicted an acquired or pending entry");
                                }
                                pending.extend(slots);
                            }
                            None => {
                                let after: Vec<Entry> = (0..cap).filter_map(|s| p.entry(s)).collect();
                                prop_assert_eq!(before, after, "failed reservation changed the pool");
                            }
                        }
                    }
                    Op::Complete(i) if !retired.is_empty() && i % 2 == 0 => {
                        let s = retired.swap_remove(i as usize % retired.len());
                        p.mark_ready(s).unwrap();
                        prop_assert!(!p.entry(s).unwrap().ready, "a retired entry never becomes ready");
                        p.release(s).unwrap();
                        prop_assert!(p.entry(s).is_none(), "a retired entry is dropped at its last release");
                    }
                    Op::Complete(i) if !pending.is_empty() => {
                        let s = pending.swap_remove(i as usize % pending.len());
                        p.mark_ready(s).unwrap();
                        p.release(s).unwrap();
                    }
                    Op::Fail(i) if !pending.is_empty() => {
                        let s = pending.swap_remove(i as usize % pending.len());
                        p.discard(s).unwrap();
                    }
                    Op::Acquire(i) => {
                        let ready: Vec<u32> = (0..cap).filter(|&s| p.entry(s).is_some_and(|e| e.ready)).collect();
                        if !ready.is_empty() {
                            let s = ready[i as usize % ready.len()];
                            p.acquire(s).unwrap();
                            held.push(s);
                        }
                    }
                    Op::Release(i) if !held.is_empty() => {
                        let s = held.swap_remove(i as usize % held.len());
                        p.release(s).unwrap();
                    }
                    Op::Touch(i) => p.touch(u32::from(i) % cap),
                    Op::Evict => {
                        if let Some(k) = p.evict_one() {
                            prop_assert!(p.slot_of(k).is_none());
                            prop_assert!(pending.iter().chain(&held).all(|&s| p.entry(s).is_some()));
                        }
                    }
                    Op::Retire => {
                        let in_use: Vec<u32> = pending.iter().chain(&held).copied().collect();
                        p.retire_all();
                        prop_assert_eq!(p.evictable(), 0, "every evictable entry is dropped at once");
                        prop_assert!(in_use.iter().all(|&s| p.entry(s).is_some()), "entries in use keep their slots");
                        // Whatever was in use before can never become ready: track it apart from new work.
                        retired.append(&mut pending);
                    }
                    _ => {}
                }
                p.check().map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
    }
}
