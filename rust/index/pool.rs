//! A fixed set of host slots with an eviction policy (rust/index/policy.rs), where only evictable entries sit in the
//! eviction lists.
//!
//! An entry leaves its list when it is acquired (refs 0 -> 1) or while it is not ready, and re-enters at the
//! most-recent end of its list when it is ready with refs back at 0 (released), so eviction pops a list's
//! least-recent end in O(1) and never walks past an entry in use. Entries live in a slab indexed by slot; the list
//! links are slot indices. An acquisition is a *use* (a hit, a re-store); a hold (an L3 put reading the entry) is
//! not: under the adaptive policy a use moves a probation entry to protected when it is released.
//!
//! The bookkeeping grows with the slots handed out, not with the capacity: a pool of two billion slots costs
//! nothing until its slots are used (slots never used are a counter, not a list).
//!
//! Entries belong to the pool's epoch they were reserved in. `retire_all` (the model changed) starts a new epoch
//! and drops every evictable entry; an entry of an older epoch still in use can never become ready and is dropped
//! when its last reference goes.
use crate::error::{Error, Result};
use crate::index::chain::{Key, KeyMap};
use crate::index::policy::{Ghosts, Policy, TARGET_UNIT};

const NIL: u32 = u32::MAX;

/// The list of entries not used since they came in (the only list of `lru`).
const PROBATION: usize = 0;
/// The adaptive policy's list of entries used again.
const PROTECTED: usize = 1;

/// An entry evicted or dropped: the slot it had, and its key.
pub type Evicted = (u32, Key);

#[derive(Clone, Debug)]
struct Slot {
    /// The entry in this slot, if any.
    entry: Option<Entry>,
    prev: u32,
    next: u32,
    /// The list the entry belongs to (listed or not).
    list: usize,
    /// Acquired for a use since it was last listed.
    used: bool,
    /// When it was last listed (the pool's clock): the adaptive policy compares the two lists' heads by it.
    listed_at: u64,
    /// The pool's epoch when the entry was reserved.
    epoch: u32,
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

#[derive(Clone, Copy, Debug)]
struct List {
    head: u32,
    tail: u32,
    /// Entries of the list, listed or not (acquired, not ready).
    members: usize,
}

/// A pool's lists, ghosts and target as the policy keeps them (tests and `Index.page_policy()` read it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyState {
    /// Evictable keys of each list, least recent first.
    pub probation: Vec<Key>,
    pub protected: Vec<Key>,
    /// Ghost keys of each list, oldest first.
    pub probation_ghosts: Vec<Key>,
    pub protected_ghosts: Vec<Key>,
    /// Target size of probation, in sixteenths of a slot.
    pub target: u64,
}

#[derive(Debug)]
pub struct Pool {
    policy: Policy,
    /// Slots handed out at least once (slot i at index i); slots `slots.len()..usable` were never used.
    slots: Vec<Slot>,
    capacity: u32,
    /// Number of slots usable now (a lazily grown pool starts small); slots >= `usable` are not handed out.
    usable: u32,
    map: KeyMap<u32>,
    /// Slots freed after use (evicted to `evict_one`, discarded), taken again last-freed first before fresh ones.
    free: Vec<u32>,
    lists: [List; 2],
    ghosts: [Ghosts; 2],
    /// Probation's target size (adaptive), in sixteenths of a slot.
    target: u64,
    clock: u64,
    evictable: usize,
    evicted: u64,
    epoch: u32,
    /// Entries dropped by `retire_all` (at once or at their last release).
    retired: u64,
}

impl Pool {
    /// An LRU pool of `capacity` slots, of which the first `usable` can be handed out now.
    pub fn new(capacity: u32, usable: u32) -> Self {
        Self::with_policy(capacity, usable, Policy::Lru)
    }

    /// A pool of `capacity` slots evicting by `policy`, of which the first `usable` can be handed out now.
    pub fn with_policy(capacity: u32, usable: u32, policy: Policy) -> Self {
        let list = List { head: NIL, tail: NIL, members: 0 };
        let ghost_bound = if policy == Policy::Adaptive { capacity as usize } else { 0 };
        let mut pool = Self {
            policy,
            slots: Vec::new(),
            capacity,
            usable: 0,
            map: KeyMap::default(),
            free: Vec::new(),
            lists: [list; 2],
            ghosts: [Ghosts::new(ghost_bound), Ghosts::new(ghost_bound)],
            target: u64::from(capacity) * TARGET_UNIT / 2,
            clock: 0,
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

    pub fn policy(&self) -> Policy {
        self.policy
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
        self.slots.push(Slot {
            entry: None,
            prev: NIL,
            next: NIL,
            list: PROBATION,
            used: false,
            listed_at: 0,
            epoch: self.epoch,
        });
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
    /// entry is dropped now, and the ghosts with them; an entry still in use keeps its slot until its last release,
    /// never becomes ready, and is dropped then. Returns the entries dropped now.
    pub fn retire_all(&mut self) -> Vec<Evicted> {
        self.epoch = self.epoch.wrapping_add(1);
        let mut dropped = Vec::new();
        while let Some(list) = self.victim_list() {
            let slot = self.lists[list].head;
            self.unlink(slot);
            dropped.extend(self.drop_entry(slot).map(|k| (slot, k)));
        }
        self.ghosts.iter_mut().for_each(Ghosts::clear);
        self.retired += dropped.len() as u64;
        dropped
    }

    /// Whether the entry in `slot` was reserved before the last `retire_all`.
    fn is_retired(&self, slot: u32) -> bool {
        self.slots.get(slot as usize).is_some_and(|s| s.epoch != self.epoch)
    }

    /// Empties a slot whose entry is in no list, returning it to the free slots; the key of an entry that was
    /// ready (whose removal a KV event announces).
    fn drop_entry(&mut self, slot: u32) -> Option<Key> {
        let s = &mut self.slots[slot as usize];
        let entry = s.entry.take().expect("a used slot");
        self.lists[s.list].members -= 1;
        self.map.remove(&entry.key);
        self.free.push(slot);
        entry.ready.then_some(entry.key)
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

    /// Takes one slot for each of `keys` (none may be present), evicting entries as the policy says: all of
    /// them or, when not enough slots are free or evictable, none (and nothing is evicted, nothing adapts). New
    /// entries are acquired (refs 1) and not ready. Returns the slots and the keys evicted.
    pub fn reserve(&mut self, keys: &[Key]) -> Option<(Vec<u32>, Vec<Key>)> {
        self.reserve_evicting(keys).map(|(slots, evicted)| (slots, evicted.into_iter().map(|(_, k)| k).collect()))
    }

    /// `reserve`, with the slot each evicted entry had.
    pub fn reserve_evicting(&mut self, keys: &[Key]) -> Option<(Vec<u32>, Vec<Evicted>)> {
        if keys.len() > self.available() {
            return None;
        }
        debug_assert!(keys.iter().all(|k| !self.map.contains_key(k)), "reserve of a present key");
        let mut slots = Vec::with_capacity(keys.len());
        let mut lists = Vec::with_capacity(keys.len());
        let mut evicted = Vec::new();
        for &key in keys {
            let list = self.admit(key);
            let slot = match self.take_free() {
                Some(s) => s,
                None => {
                    let (s, old) = self.pop_victim().expect("available() counted an evictable entry");
                    evicted.push((s, old));
                    s
                }
            };
            self.lists[list].members += 1;
            slots.push(slot);
            lists.push(list);
        }
        // The keys get the slots in ascending order: a run of keys (a prompt's pages) lands in runs of consecutive
        // slots, which a copy moves in fewer pieces. Which slot a new entry has is nothing to the policy.
        slots.sort_unstable();
        for ((&key, &slot), list) in keys.iter().zip(&slots).zip(lists) {
            let s = &mut self.slots[slot as usize];
            s.entry = Some(Entry { key, refs: 1, ready: false });
            s.list = list;
            s.used = false;
            s.epoch = self.epoch;
            self.map.insert(key, slot);
        }
        Some((slots, evicted))
    }

    /// The list a new entry of `key` joins; a key back from a ghost list moves the adaptive target (ARC's step,
    /// `max(1, other ghosts / these ghosts)`, in sixteenths of a slot) and joins protected.
    fn admit(&mut self, key: Key) -> usize {
        if self.policy == Policy::Lru {
            return PROBATION;
        }
        let top = u64::from(self.capacity) * TARGET_UNIT;
        for (list, other) in [(PROBATION, PROTECTED), (PROTECTED, PROBATION)] {
            if self.ghosts[list].contains(key) {
                let step = (self.ghosts[other].len() / self.ghosts[list].len()).max(1) as u64;
                self.target =
                    if list == PROBATION { (self.target + step).min(top) } else { self.target.saturating_sub(step) };
                self.ghosts[list].remove(key);
                return PROTECTED;
            }
        }
        PROBATION
    }

    /// Evicts the entry the policy picks; its slot becomes free. Returns its key.
    pub fn evict_one(&mut self) -> Option<Key> {
        let (slot, key) = self.pop_victim()?;
        self.free.push(slot);
        Some(key)
    }

    /// The list to evict from: probation while it is over its target, else the less recently listed head.
    fn victim_list(&self) -> Option<usize> {
        let (a, b) = (self.lists[PROBATION].head, self.lists[PROTECTED].head);
        match (a != NIL, b != NIL) {
            (false, false) => None,
            (true, false) => Some(PROBATION),
            (false, true) => Some(PROTECTED),
            (true, true) => {
                let over = self.lists[PROBATION].members as u64 * TARGET_UNIT > self.target;
                let older = self.slots[a as usize].listed_at < self.slots[b as usize].listed_at;
                Some(if over || older { PROBATION } else { PROTECTED })
            }
        }
    }

    /// Takes the evictable entry the policy picks out, leaving its slot to the caller; its key becomes a ghost
    /// of its list (adaptive).
    fn pop_victim(&mut self) -> Option<(u32, Key)> {
        let list = self.victim_list()?;
        let slot = self.lists[list].head;
        self.unlink(slot);
        let entry = self.slots[slot as usize].entry.take().expect("listed slot has an entry");
        self.lists[list].members -= 1;
        self.map.remove(&entry.key);
        self.ghosts[list].insert(entry.key);
        self.evicted += 1;
        Some((slot, entry.key))
    }

    /// Takes a reference for a use (a hit, a re-store): the entry leaves the eviction order.
    pub fn acquire(&mut self, slot: u32) -> Result<()> {
        self.take_ref(slot)?;
        self.slots[slot as usize].used = true;
        Ok(())
    }

    /// Takes a reference that is no use of the entry (an L3 put reads it): the entry leaves the eviction order.
    pub fn hold(&mut self, slot: u32) -> Result<()> {
        self.take_ref(slot)
    }

    fn take_ref(&mut self, slot: u32) -> Result<()> {
        let e = self.entry_mut(slot)?;
        e.refs += 1;
        let listed = e.refs == 1 && e.ready;
        if listed {
            self.unlink(slot);
        }
        Ok(())
    }

    /// Drops a reference; an entry that is ready with no references re-enters its list at the most-recent end (an
    /// entry of an earlier epoch is dropped instead: its key is returned when it was ready).
    pub fn release(&mut self, slot: u32) -> Result<Option<Key>> {
        let retired = self.is_retired(slot);
        let e = self.entry_mut(slot)?;
        if e.refs == 0 {
            return Err(Error::Invariant(format!("release of slot {slot} with no references")));
        }
        e.refs -= 1;
        let (free, ready) = (e.refs == 0, e.ready);
        if free && retired {
            self.retired += 1;
            return Ok(self.drop_entry(slot));
        }
        if free && ready {
            self.relist(slot);
        }
        Ok(None)
    }

    /// Lists an evictable entry at the most-recent end of its list; a used probation entry moves to protected.
    fn relist(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if std::mem::take(&mut s.used) && s.list == PROBATION && self.policy == Policy::Adaptive {
            s.list = PROTECTED;
            self.lists[PROBATION].members -= 1;
            self.lists[PROTECTED].members += 1;
        }
        self.push_back(slot);
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

    /// Removes an acquired, not-ready entry whose copy failed; its slot becomes free (no ghost: it never held
    /// anything).
    pub fn discard(&mut self, slot: u32) -> Result<()> {
        let e = *self.entry_mut(slot)?;
        if e.ready || e.refs != 1 {
            return Err(Error::Invariant(format!("discard of slot {slot} that is ready or shared ({e:?})")));
        }
        self.drop_entry(slot);
        Ok(())
    }

    /// A use of an evictable entry without a reference: it moves to the most-recent end (to protected, adaptive).
    pub fn touch(&mut self, slot: u32) {
        if self.entry(slot).is_some_and(|e| e.refs == 0 && e.ready) {
            self.unlink(slot);
            self.slots[slot as usize].used = true;
            self.relist(slot);
        }
    }

    fn list_keys(&self, list: usize) -> Vec<Key> {
        let mut out = Vec::new();
        let mut s = self.lists[list].head;
        while s != NIL {
            out.push(self.slots[s as usize].entry.expect("listed slot has an entry").key);
            s = self.slots[s as usize].next;
        }
        out
    }

    /// Evictable keys, least recently listed first (both lists merged).
    pub fn lru_keys(&self) -> Vec<Key> {
        let mut out: Vec<(u64, Key)> = Vec::with_capacity(self.evictable);
        for list in [PROBATION, PROTECTED] {
            let mut s = self.lists[list].head;
            while s != NIL {
                let slot = &self.slots[s as usize];
                out.push((slot.listed_at, slot.entry.expect("listed slot has an entry").key));
                s = slot.next;
            }
        }
        out.sort_unstable_by_key(|&(at, _)| at);
        out.into_iter().map(|(_, k)| k).collect()
    }

    /// The lists, ghosts and target of the policy (for tests and `Index.policy_state`).
    pub fn policy_state(&self) -> PolicyState {
        PolicyState {
            probation: self.list_keys(PROBATION),
            protected: self.list_keys(PROTECTED),
            probation_ghosts: self.ghosts[PROBATION].keys(),
            protected_ghosts: self.ghosts[PROTECTED].keys(),
            target: self.target,
        }
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
            if self.ghosts.iter().any(|g| g.contains(key)) {
                return fail(format!("resident key {key:032x} is also a ghost"));
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
        let mut listed = 0;
        for list in [PROBATION, PROTECTED] {
            let members = self.slots.iter().filter(|s| s.entry.is_some() && s.list == list).count();
            if members != self.lists[list].members {
                return fail(format!("list {list} counts {} members, has {members}", self.lists[list].members));
            }
            let (mut s, mut last) = (self.lists[list].head, 0);
            while s != NIL {
                let slot = &self.slots[s as usize];
                if slot.list != list || slot.listed_at < last || !slot.entry.is_some_and(|e| e.refs == 0 && e.ready) {
                    return fail(format!("slot {s} is out of place in list {list}"));
                }
                (last, s, listed) = (slot.listed_at, slot.next, listed + 1);
            }
        }
        let should = self.slots.iter().filter(|s| s.entry.is_some_and(|e| e.refs == 0 && e.ready)).count();
        if listed != should || listed != self.evictable {
            return fail(format!("lists hold {listed} entries, {should} are evictable, counter {}", self.evictable));
        }
        let bound = if self.policy == Policy::Adaptive { self.capacity as usize } else { 0 };
        if self.ghosts.iter().any(|g| g.len() > bound)
            || self.ghosts[PROBATION].keys().iter().any(|&k| self.ghosts[PROTECTED].contains(k))
            || (self.policy == Policy::Lru && self.lists[PROTECTED].members > 0)
            || self.target > u64::from(self.capacity) * TARGET_UNIT
        {
            return fail("ghost lists over their bound or shared, or the target out of range".to_owned());
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
        let (prev, next, list) = {
            let s = &self.slots[slot as usize];
            (s.prev, s.next, s.list)
        };
        if prev == NIL {
            self.lists[list].head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.lists[list].tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        let s = &mut self.slots[slot as usize];
        s.prev = NIL;
        s.next = NIL;
        self.evictable -= 1;
    }

    fn push_back(&mut self, slot: u32) {
        let clock = self.clock;
        self.clock += 1;
        let s = &mut self.slots[slot as usize];
        let list = s.list;
        let tail = self.lists[list].tail;
        s.prev = tail;
        s.next = NIL;
        s.listed_at = clock;
        if tail == NIL {
            self.lists[list].head = slot;
        } else {
            self.slots[tail as usize].next = slot;
        }
        self.lists[list].tail = slot;
        self.evictable += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

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

    #[test]
    fn adaptive_protects_what_was_used_twice_from_a_scan() {
        // Probation (6 entries) is over its target (4): a scan evicts from probation only.
        let mut p = Pool::with_policy(8, 8, Policy::Adaptive);
        ready(&mut p, &[1, 2, 3, 4, 5, 6, 7, 8]);
        for k in [1, 2] {
            let s = p.slot_of(k).unwrap();
            p.acquire(s).unwrap();
            p.release(s).unwrap();
        }
        for scan in 10..30 {
            ready(&mut p, &[scan]);
        }
        let st = p.policy_state();
        assert_eq!(st.protected, vec![1, 2], "a scan flushed the reused entries");
        assert_eq!(st.probation, (24..30).collect::<Vec<Key>>());
        assert_eq!(st.probation_ghosts.len(), 8, "ghosts are bounded by the capacity");
        p.check().unwrap();

        let mut lru = Pool::new(8, 8);
        ready(&mut lru, &[1, 2, 3, 4, 5, 6, 7, 8]);
        for scan in 10..30 {
            ready(&mut lru, &[scan]);
        }
        assert!(lru.slot_of(1).is_none(), "LRU keeps the scan");
    }

    #[test]
    fn adaptive_with_a_full_target_is_lru() {
        let mut p = Pool::with_policy(3, 3, Policy::Adaptive);
        ready(&mut p, &[1, 2, 3]);
        for k in [1, 2] {
            p.touch(p.slot_of(k).unwrap());
        }
        // Probation {3} is under its target (1.5 slots): the least recent head of the two lists goes.
        assert_eq!(p.evict_one(), Some(3));
        assert_eq!(p.evict_one(), Some(1));
        p.check().unwrap();
    }

    #[test]
    fn a_key_back_from_a_ghost_list_moves_the_target_and_is_protected() {
        let mut p = Pool::with_policy(2, 2, Policy::Adaptive);
        ready(&mut p, &[1, 2]);
        assert_eq!(p.evict_one(), Some(1));
        let before = p.policy_state().target;
        ready(&mut p, &[1]);
        let st = p.policy_state();
        assert_eq!(st.target, before + 1, "one sixteenth of a slot");
        assert_eq!(st.protected, vec![1]);
        assert!(st.probation_ghosts.is_empty());
        p.check().unwrap();
    }

    #[test]
    fn a_hold_is_no_use() {
        let mut p = Pool::with_policy(2, 2, Policy::Adaptive);
        let s = ready(&mut p, &[1])[0];
        p.hold(s).unwrap();
        p.release(s).unwrap();
        assert_eq!(p.policy_state().probation, vec![1]);
        p.acquire(s).unwrap();
        p.release(s).unwrap();
        assert_eq!(p.policy_state().protected, vec![1]);
    }

    /// The adaptive policy written plainly (vectors, linear scans): what `Pool` must do, step for step.
    #[derive(Debug, Default)]
    struct Model {
        capacity: usize,
        /// key -> (refs, ready, list, used)
        entries: HashMap<Key, (u32, bool, usize, bool)>,
        lists: [Vec<Key>; 2],
        ghosts: [Vec<Key>; 2],
        target: u64,
        /// Keys in the order they were last listed, oldest first.
        order: Vec<Key>,
    }

    impl Model {
        fn new(capacity: usize) -> Self {
            Self { capacity, target: capacity as u64 * 8, ..Self::default() }
        }
        fn members(&self, list: usize) -> usize {
            self.entries.values().filter(|e| e.2 == list).count()
        }
        fn evictable(&self) -> usize {
            self.lists[0].len() + self.lists[1].len()
        }
        fn reserve(&mut self, keys: &[Key]) -> Option<Vec<Key>> {
            if keys.len() > self.capacity - self.entries.len() + self.evictable() {
                return None;
            }
            let mut evicted = Vec::new();
            for &k in keys {
                let mut list = 0;
                for (g, other) in [(0, 1), (1, 0)] {
                    if let Some(i) = self.ghosts[g].iter().position(|&x| x == k) {
                        let step = (self.ghosts[other].len() / self.ghosts[g].len()).max(1) as u64;
                        self.target = if g == 0 {
                            (self.target + step).min(self.capacity as u64 * 16)
                        } else {
                            self.target.saturating_sub(step)
                        };
                        self.ghosts[g].remove(i);
                        list = 1;
                        break;
                    }
                }
                if self.entries.len() == self.capacity {
                    evicted.push(self.evict().unwrap());
                }
                self.entries.insert(k, (1, false, list, false));
            }
            Some(evicted)
        }
        fn evict(&mut self) -> Option<Key> {
            let from = match (self.lists[0].first(), self.lists[1].first()) {
                (None, None) => return None,
                (Some(_), None) => 0,
                (None, Some(_)) => 1,
                (Some(_), Some(_)) => {
                    let over = self.members(0) as u64 * 16 > self.target;
                    // The lists are in listing order: compare when each head was listed.
                    let older = self.order.iter().position(|&k| k == self.lists[0][0])
                        < self.order.iter().position(|&k| k == self.lists[1][0]);
                    usize::from(!(over || older))
                }
            };
            let k = self.lists[from].remove(0);
            self.entries.remove(&k);
            self.ghosts[from].push(k);
            if self.ghosts[from].len() > self.capacity {
                self.ghosts[from].remove(0);
            }
            Some(k)
        }
    }

    impl Model {
        fn list(&mut self, k: Key) {
            let e = self.entries.get_mut(&k).unwrap();
            if std::mem::take(&mut e.3) && e.2 == 0 {
                e.2 = 1;
            }
            let list = e.2;
            self.lists[list].push(k);
            self.order.retain(|&x| x != k);
            self.order.push(k);
        }
        fn unlist(&mut self, k: Key) {
            for l in &mut self.lists {
                l.retain(|&x| x != k);
            }
        }
        fn acquire(&mut self, k: Key, used: bool) {
            let e = self.entries.get_mut(&k).unwrap();
            e.0 += 1;
            e.3 |= used;
            if e.0 == 1 && e.1 {
                self.unlist(k);
            }
        }
        fn release(&mut self, k: Key) {
            let e = self.entries.get_mut(&k).unwrap();
            e.0 -= 1;
            if e.0 == 0 && e.1 {
                self.list(k);
            }
        }
    }

    #[derive(Clone, Debug)]
    enum AdaptiveOp {
        Reserve(Vec<u8>),
        Complete(u8),
        Fail(u8),
        Use(u8),
        Hold(u8),
        Release(u8),
        Evict,
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn adaptive_pool_equals_its_plain_model(
            ops in prop::collection::vec(prop_oneof![
                prop::collection::vec(0u8..24, 0..5).prop_map(AdaptiveOp::Reserve),
                any::<u8>().prop_map(AdaptiveOp::Complete),
                any::<u8>().prop_map(AdaptiveOp::Fail),
                any::<u8>().prop_map(AdaptiveOp::Use),
                any::<u8>().prop_map(AdaptiveOp::Hold),
                any::<u8>().prop_map(AdaptiveOp::Release),
                Just(AdaptiveOp::Evict),
            ], 1..300),
            cap in 1u32..8,
        ) {
            let mut p = Pool::with_policy(cap, cap, Policy::Adaptive);
            let mut m = Model::new(cap as usize);
            let (mut pending, mut held): (Vec<Key>, Vec<Key>) = (Vec::new(), Vec::new());
            for op in ops {
                match op {
                    AdaptiveOp::Reserve(raw) => {
                        let mut keys: Vec<Key> = raw.iter().map(|&k| Key::from(k) + 1).collect();
                        keys.dedup();
                        keys.retain(|k| p.slot_of(*k).is_none());
                        let mut uniq = Vec::new();
                        for k in keys {
                            if !uniq.contains(&k) {
                                uniq.push(k);
                            }
                        }
                        let got = p.reserve(&uniq).map(|(_, ev)| ev);
                        prop_assert_eq!(&got, &m.reserve(&uniq));
                        if got.is_some() {
                            pending.extend(uniq);
                        }
                    }
                    AdaptiveOp::Complete(i) if !pending.is_empty() => {
                        let k = pending.swap_remove(i as usize % pending.len());
                        let s = p.slot_of(k).unwrap();
                        p.mark_ready(s).unwrap();
                        p.release(s).unwrap();
                        m.entries.get_mut(&k).unwrap().1 = true;
                        m.release(k);
                    }
                    AdaptiveOp::Fail(i) if !pending.is_empty() => {
                        let k = pending.swap_remove(i as usize % pending.len());
                        p.discard(p.slot_of(k).unwrap()).unwrap();
                        m.entries.remove(&k);
                    }
                    AdaptiveOp::Use(i) | AdaptiveOp::Hold(i) => {
                        let mut ready: Vec<Key> = m.entries.iter().filter(|e| e.1 .1).map(|e| *e.0).collect();
                        ready.sort_unstable();
                        if !ready.is_empty() {
                            let k = ready[i as usize % ready.len()];
                            let s = p.slot_of(k).unwrap();
                            let used = matches!(op, AdaptiveOp::Use(_));
                            if used { p.acquire(s).unwrap() } else { p.hold(s).unwrap() }
                            m.acquire(k, used);
                            held.push(k);
                        }
                    }
                    AdaptiveOp::Release(i) if !held.is_empty() => {
                        let k = held.swap_remove(i as usize % held.len());
                        p.release(p.slot_of(k).unwrap()).unwrap();
                        m.release(k);
                    }
                    AdaptiveOp::Evict => prop_assert_eq!(p.evict_one(), m.evict()),
                    _ => {}
                }
                p.check().map_err(|e| TestCaseError::fail(e.to_string()))?;
                let st = p.policy_state();
                prop_assert_eq!(&st.probation, &m.lists[0]);
                prop_assert_eq!(&st.protected, &m.lists[1]);
                prop_assert_eq!(&st.probation_ghosts, &m.ghosts[0]);
                prop_assert_eq!(&st.protected_ghosts, &m.ghosts[1]);
                prop_assert_eq!(st.target, m.target);
                for (k, e) in &m.entries {
                    prop_assert_eq!(p.entry(p.slot_of(*k).unwrap()).map(|x| (x.refs, x.ready)), Some((e.0, e.1)));
                }
                prop_assert_eq!(p.used(), m.entries.len());
            }
        }
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
        fn random_operations_keep_every_invariant(
            ops in prop::collection::vec(op(), 1..200),
            cap in 1u32..12,
            policy in prop_oneof![Just(Policy::Lru), Just(Policy::Adaptive)],
        ) {
            let mut p = Pool::with_policy(cap, cap, policy);
            // Pending entries of an epoch that was retired.
            let mut retired: Vec<u32> = Vec::new();
            // Slots whose entry is held by a pending copy (not ready).
            let mut pending: Vec<u32> = Vec::new();
            // Extra references we took on ready entries.
            let mut held: Vec<u32> = Vec::new();
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
                        retired.append(&mut pending);
                    }
                    _ => {}
                }
                p.check().map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
    }
}
