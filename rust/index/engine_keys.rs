//! Pages keyed by the engine: byte strings the engine made (vLLM's block hashes with their group), for a half of
//! the engine that never sees tokens. (SGLang's page hashes name L3 objects only: `chain::engine_page_key`.) Each page stored gets a pool key of its own, so they
//! share the pools, references, ready flags, reservations, policy, statistics and events of token chains and never
//! meet a chain's key. The engine's bytes are kept by page slot, so what is evicted is reported in them, and a key
//! is found by its bytes (compared in full) under the current model version.
use std::collections::{HashMap, VecDeque};

use super::{Index, Ticket, TicketKind};
use crate::error::{invalid, Result};
use crate::index::chain::Key;
use crate::index::events::Medium;
use crate::index::SlotPlan;

/// The longest engine key taken.
pub const MAX_ENGINE_KEY_BYTES: usize = 64;

/// The pool keys of pages stored by engine key: this tag and a mixed count (a chain key, a keyed hash, is one of
/// these with a chance of 2^-64 or less).
const ENGINE_KEYS: Key = 0xe6 << 120;

/// An error unless `key` is 1 to `MAX_ENGINE_KEY_BYTES` bytes.
fn check_length(key: &[u8]) -> Result<()> {
    if key.is_empty() || key.len() > MAX_ENGINE_KEY_BYTES {
        return Err(invalid(format!(
            "an engine key must be 1 to {MAX_ENGINE_KEY_BYTES} bytes, got {} bytes",
            key.len()
        )));
    }
    Ok(())
}

/// An error naming the first key that is not 1 to `MAX_ENGINE_KEY_BYTES` bytes.
fn check_lengths<K: AsRef<[u8]>>(keys: &[K]) -> Result<()> {
    for (i, k) in keys.iter().enumerate() {
        check_length(k.as_ref()).map_err(|e| invalid(format!("keys[{i}]: {e}")))?;
    }
    Ok(())
}

/// What the host holds of a run of engine keys now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyLookup {
    /// Leading keys ready on the host.
    pub hits: usize,
    /// The key after them is being stored (present, not ready yet): asking again later may hit more.
    pub pending: bool,
}

/// A store of engine keys planned: the positions of the keys to copy GPU -> host and the slot each goes to, and
/// the engine keys evicted to make room.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyStorePlan {
    pub ticket: u64,
    pub indices: Vec<u32>,
    pub slots: Vec<u32>,
    pub evicted: Vec<Name>,
}

/// Where one engine key stands on the host (`Index::lookup_key`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyState {
    Absent = 0,
    /// Its page is being stored.
    Pending = 1,
    Ready = 2,
}

/// What `Index::complete_keys` found: how many of the keys belonged to a store in flight, and the stores all of
/// whose keys are now reported, oldest first, each with whether any of its keys was reported failed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyCompletion {
    pub matched: usize,
    pub due: Vec<(u64, bool)>,
}

/// The loads of engine keys in flight: for each key, the `load_keys` tickets it is owed a report for, oldest
/// first, and how many reports each ticket still awaits. A ticket settled another way (`complete`, `abort`) is
/// forgotten here, and its keys' later reports go to their next load.
#[derive(Debug, Default)]
pub(super) struct KeyLoads {
    by_key: HashMap<Vec<u8>, VecDeque<u64>>,
    remaining: HashMap<u64, usize>,
}

impl KeyLoads {
    pub(super) fn forget(&mut self, ticket: u64) {
        self.remaining.remove(&ticket);
    }

    /// The oldest live load `key` is owed a report for, dropping settled ones from its queue.
    fn oldest(&mut self, key: &[u8]) -> Option<u64> {
        let queue = self.by_key.get_mut(key)?;
        while let Some(&id) = queue.front() {
            if self.remaining.contains_key(&id) {
                return Some(id);
            }
            queue.pop_front();
        }
        self.by_key.remove(key);
        None
    }
}

/// An engine key's bytes, kept inline (a key is at most `MAX_ENGINE_KEY_BYTES`; a chain key's 16 bytes
/// big-endian where an eviction names a page stored by chain).
#[derive(Clone, Copy)]
pub struct Name {
    len: u8,
    bytes: [u8; MAX_ENGINE_KEY_BYTES],
}

impl Name {
    const EMPTY: Name = Name { len: 0, bytes: [0; MAX_ENGINE_KEY_BYTES] };

    fn new(b: &[u8]) -> Self {
        let mut name = Self::EMPTY;
        name.bytes[..b.len()].copy_from_slice(b);
        name.len = b.len() as u8;
        name
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Name {}

impl std::fmt::Debug for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:02x?}", self.as_bytes())
    }
}

/// The engine key that last named a page slot: its bytes, its pool key then (the slot holds that page while the
/// pool's entry there has this key), and the key store owed a report of it (0: none).
#[derive(Clone, Copy, Debug)]
struct SlotName {
    name: Name,
    /// `Names::hash` of the name.
    hash: u64,
    key: Key,
    store: u64,
    /// Found by its bytes in `Names::by_name` (named under the current model version, and the slot not named
    /// again since).
    listed: bool,
}

/// The engine's bytes of the pages stored by engine key, kept by page slot: what an eviction reports, the store
/// a report of a key belongs to, and a key's page found by its bytes.
#[derive(Debug)]
pub(super) struct Names {
    /// One a page slot up to the highest slot an engine key was stored in (none while only chains are stored). A
    /// slot keeps its name after its page leaves, until it is named again: an eviction is reported in the engine's
    /// bytes.
    slots: Vec<SlotName>,
    /// The listed slots, by xxh3 of their bytes under a seed drawn once a process (the keys come from the engine,
    /// so their spread is not trusted). At most one a name and one a slot.
    by_name: hashbrown::HashTable<u32>,
    seed: u64,
    /// Pool keys given to pages stored by engine key (`new_key`).
    stored: u64,
    /// Keys also being copied by a store of an earlier model version (the same bytes may name another page now),
    /// oldest first: a report of such a key goes to the oldest store owed it.
    older: Vec<(Name, u64)>,
}

impl Default for Names {
    fn default() -> Self {
        use std::hash::BuildHasher;
        Self {
            slots: Vec::new(),
            by_name: Default::default(),
            seed: std::collections::hash_map::RandomState::new().hash_one(0u64),
            stored: 0,
            older: Vec::new(),
        }
    }
}

impl Names {
    fn hash(&self, name: &[u8]) -> u64 {
        xxhash_rust::xxh3::xxh3_64_with_seed(name, self.seed)
    }

    /// The listed slot named `name` (whose `hash` is given).
    fn find(&self, hash: u64, name: &[u8]) -> Option<u32> {
        let slots = &self.slots;
        self.by_name.find(hash, |&s| slots[s as usize].name.as_bytes() == name).copied()
    }

    /// A pool key for a page stored by engine key: one never given before, its low 64 bits spread as a hash's
    /// are (the pool's maps hash keys by them).
    fn new_key(&mut self) -> Key {
        self.stored += 1;
        // SplitMix64's finalizer: a bijection, so distinct counts give distinct keys.
        let mut z = self.stored;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ENGINE_KEYS | Key::from(z ^ (z >> 31))
    }

    /// Whether no engine key was ever stored.
    pub(super) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The page of pool key `k` in `slot` (which it has, or had when it left the pool, unless the slot was named
    /// again since) as an event or eviction names it: the engine's key, or the chain key (16 bytes big-endian).
    pub(super) fn name(&self, slot: u32, k: Key) -> Name {
        match self.slots.get(slot as usize).filter(|n| n.key == k && n.name.len > 0) {
            Some(n) => n.name,
            None => Name::new(&k.to_be_bytes()),
        }
    }

    /// A new model version: no key finds a page of an earlier one, and the stores owed reports of keys are owed
    /// them as keys of an earlier version.
    pub(super) fn new_version(&mut self) {
        for &s in &self.by_name {
            let slot = &mut self.slots[s as usize];
            slot.listed = false;
            if slot.store != 0 {
                self.older.push((slot.name, std::mem::take(&mut slot.store)));
            }
        }
        self.by_name.clear();
    }

    /// A key store settled: its keys not yet reported have nothing left to report.
    pub(super) fn settle_store(&mut self, ticket: u64, slots: &[(u32, bool)]) {
        for &(s, new) in slots {
            if let Some(slot) = self.slots.get_mut(s as usize).filter(|slot| new && slot.store == ticket) {
                slot.store = 0;
            }
        }
        self.older.retain(|&(_, id)| id != ticket);
    }

    /// The store owed a report of `key`, which it no longer is: the oldest.
    fn take_store(&mut self, key: &[u8]) -> Option<u64> {
        if let Some(i) = self.older.iter().position(|(name, _)| name.as_bytes() == key) {
            return Some(self.older.remove(i).1);
        }
        let s = self.find(self.hash(key), key)?;
        let store = &mut self.slots[s as usize].store;
        (*store != 0).then(|| std::mem::take(store))
    }

    /// The slot holding the page of `key` by its bytes, as the pool has it now: None when no page of it was
    /// stored under this model version, or its page left the pool since.
    fn slot_of(&self, pool: &crate::index::pool::Pool, hash: u64, key: &[u8]) -> Option<u32> {
        let s = self.find(hash, key)?;
        pool.entry(s).is_some_and(|e| e.key == self.slots[s as usize].key).then_some(s)
    }

    /// Names the page of pool key `k` in `slot`, which `store` copies.
    fn insert(&mut self, capacity: u32, k: Key, slot: u32, name: &[u8], hash: u64, store: u64) {
        if slot as usize >= self.slots.len() {
            // Grown as slots are used (a pool hands out its lowest free slots first), to at most the pool's
            // capacity (a pool of 65536 slots or fewer at once).
            let len = (2 * self.slots.len()).max(1 << 16).min(capacity as usize).max(slot as usize + 1);
            let empty = SlotName { name: Name::EMPTY, hash: 0, key: 0, store: 0, listed: false };
            self.slots.resize(len, empty);
            // Room for a name a slot, so that naming slots again (a removal and an insert) never rehashes.
            let slots = &self.slots;
            self.by_name.reserve(slots.len() - self.by_name.len(), |&s| slots[s as usize].hash);
        }
        let old = &self.slots[slot as usize];
        if old.listed {
            if let Ok(e) = self.by_name.find_entry(old.hash, |&s| s == slot) {
                e.remove();
            }
        }
        let slots = &mut self.slots;
        match self.by_name.entry(hash, |&s| slots[s as usize].name.as_bytes() == name, |&s| slots[s as usize].hash) {
            // The page it named before has left the pool (else it would be present and not stored again).
            hashbrown::hash_table::Entry::Occupied(mut e) => {
                let before = std::mem::replace(e.get_mut(), slot);
                debug_assert_eq!(slots[before as usize].store, 0, "a page being stored left the pool");
                slots[before as usize].listed = false;
            }
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(slot);
            }
        }
        self.slots[slot as usize] = SlotName { name: Name::new(name), hash, key: k, store, listed: true };
    }
}

impl Index {
    /// The slot of the page stored by `key` under this model version, if it is still on the host.
    fn key_slot(&self, key: &[u8]) -> Option<u32> {
        self.names.slot_of(&self.pages, self.names.hash(key), key)
    }

    /// Where one engine key stands on the host (not counted as a lookup).
    pub fn key_state(&self, key: &[u8]) -> Result<KeyState> {
        check_length(key)?;
        Ok(match self.key_slot(key).and_then(|s| self.pages.entry(s)) {
            None => KeyState::Absent,
            Some(e) if e.ready => KeyState::Ready,
            Some(_) => KeyState::Pending,
        })
    }

    /// `key_state`, counted as a lookup of one block.
    pub fn lookup_key(&mut self, key: &[u8]) -> Result<KeyState> {
        let state = self.key_state(key)?;
        self.stats.lookups += 1;
        self.stats.lookup_tokens += self.cfg.block_size as u64;
        Ok(state)
    }

    /// Reports the copies of these keys done (`ok`) or failed. A key belongs to the `store_keys` call that
    /// planned its copy, until reported once; keys of no store in flight are ignored. Settling is the caller's:
    /// `complete` each due store that did not fail, `abort` each that did.
    pub fn complete_keys<K: AsRef<[u8]>>(&mut self, keys: &[K], ok: bool) -> Result<KeyCompletion> {
        check_lengths(keys)?;
        let mut out = KeyCompletion::default();
        // Keys reported a store, in runs (a store's keys tend to come together): each run settles at once.
        let mut runs: Vec<(u64, usize)> = Vec::new();
        for key in keys {
            let Some(id) = self.names.take_store(key.as_ref()) else { continue };
            out.matched += 1;
            match runs.last_mut() {
                Some((last, n)) if *last == id => *n += 1,
                _ => runs.push((id, 1)),
            }
        }
        for (id, n) in runs {
            if let Some(Ticket { kind: TicketKind::KeyStore { remaining, failed }, .. }) = self.tickets.get_mut(&id) {
                *remaining -= n;
                *failed |= !ok;
                if *remaining == 0 {
                    out.due.push((id, *failed));
                }
            }
        }
        out.due.sort_unstable();
        Ok(out)
    }

    /// Each key store in flight is owed as many reports as it has keys being copied, and each such key's page is
    /// reserved, not ready; the names found by their bytes are the listed slots.
    pub(super) fn check_key_stores(&self) -> Result<()> {
        let invariant = |m: String| Err(crate::error::Error::Invariant(m));
        let names = &self.names;
        if names.by_name.len() != names.slots.iter().filter(|n| n.listed).count()
            || names.by_name.iter().any(|&s| {
                let n = &names.slots[s as usize];
                !n.listed || n.hash != names.hash(n.name.as_bytes()) || names.find(n.hash, n.name.as_bytes()) != Some(s)
            })
        {
            return invariant("the names found by their bytes are not the listed slots".into());
        }
        if let Some(n) = names.slots.iter().find(|n| n.store != 0 && !n.listed) {
            return invariant(format!("key {:?} is owed to store {} but not listed", n.name, n.store));
        }
        let mut owed: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
        let current = names.slots.iter().filter(|n| n.store != 0).map(|n| (&n.name, n.store));
        for (name, id) in current.chain(names.older.iter().map(|(name, id)| (name, *id))) {
            *owed.entry(id).or_default() += 1;
            // A key named under an earlier model version names no page now.
            if self.tickets.get(&id).is_some_and(|t| t.epoch == self.epoch)
                && self.key_slot(name.as_bytes()).and_then(|s| self.pages.entry(s)).is_none_or(|e| e.ready)
            {
                return invariant(format!("key {name:?} of store {id} is not being stored"));
            }
        }
        for (&id, t) in &self.tickets {
            if let TicketKind::KeyStore { remaining, .. } = t.kind {
                if owed.remove(&id).unwrap_or(0) != remaining {
                    return invariant(format!("store {id} is owed {remaining} keys"));
                }
            }
        }
        match owed.into_keys().next() {
            Some(id) => invariant(format!("keys are owed to store {id}, not in flight")),
            None => Ok(()),
        }
    }

    /// How many of `keys` (a prompt's pages in order) are ready on the host from the first, and whether the next
    /// one is being stored. Counted as a lookup of `keys.len()` blocks; nothing is held.
    pub fn lookup_keys<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<KeyLookup> {
        check_lengths(keys)?;
        let entry = |k: &K| self.key_slot(k.as_ref()).and_then(|s| self.pages.entry(s));
        let hits = keys.iter().take_while(|k| entry(k).is_some_and(|e| e.ready)).count();
        let pending = keys.get(hits).is_some_and(|k| entry(k).is_some());
        self.stats.lookups += 1;
        self.stats.lookup_tokens += (keys.len() * self.cfg.block_size) as u64;
        Ok(KeyLookup { hits, pending })
    }

    /// Acquires the pages of `keys` for a host -> GPU copy (all of them ready, else an error naming the first that
    /// is not, and nothing is held) until the ticket completes. Counted as a hit of `keys.len()` pages.
    pub fn load_keys<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<SlotPlan> {
        check_lengths(keys)?;
        if keys.is_empty() {
            return Err(invalid("load_keys needs at least one key"));
        }
        let slots = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                self.key_slot(k.as_ref())
                    .filter(|&s| self.pages.entry(s).is_some_and(|e| e.ready))
                    .ok_or_else(|| invalid(format!("keys[{i}] is not ready on the host")))
            })
            .collect::<Result<Vec<u32>>>()?;
        let mut seen = std::collections::HashSet::with_capacity(slots.len());
        if let Some(i) = slots.iter().position(|&s| !seen.insert(s)) {
            return Err(invalid(format!("keys[{i}] repeats an earlier key")));
        }
        for &s in &slots {
            self.pages.acquire(s)?;
        }
        let hit_tokens = slots.len() * self.cfg.block_size;
        self.stats.hits += 1;
        self.stats.hit_tokens += hit_tokens as u64;
        let ticket = self.issue(Ticket {
            kind: TicketKind::Load { hit_tokens },
            pages: slots.iter().map(|&s| (s, false)).collect(),
            states: Vec::new(),
            epoch: 0,
        });
        for k in keys {
            self.key_loads.by_key.entry(k.as_ref().to_vec()).or_default().push_back(ticket);
        }
        self.key_loads.remaining.insert(ticket, keys.len());
        Ok(SlotPlan { ticket, page_slots: slots.into_iter().map(Some).collect(), state_slots: Vec::new() })
    }

    /// Reports the host -> GPU copies of these keys done, each to the oldest `load_keys` ticket in flight that
    /// named it; a ticket completes once each of its keys is reported. Returns how many tickets completed. A key
    /// reported more often than loads of it are in flight is an error naming it, and nothing is reported.
    pub fn complete_load_keys<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<usize> {
        check_lengths(keys)?;
        let mut owed: HashMap<&[u8], usize> = HashMap::new();
        for (i, k) in keys.iter().enumerate() {
            let k = k.as_ref();
            let n = owed.entry(k).or_insert(0);
            *n += 1;
            let live = self.key_loads.oldest(k).map_or(0, |_| {
                self.key_loads.by_key[k].iter().filter(|id| self.key_loads.remaining.contains_key(id)).count()
            });
            if *n > live {
                return Err(invalid(format!("keys[{i}] has no load in flight")));
            }
        }
        let mut due = Vec::new();
        for k in keys {
            let id = self.key_loads.oldest(k.as_ref()).expect("checked above");
            self.key_loads.by_key.get_mut(k.as_ref()).expect("checked above").pop_front();
            let left = self.key_loads.remaining.get_mut(&id).expect("a live load");
            *left -= 1;
            if *left == 0 {
                due.push(id);
            }
        }
        for &id in &due {
            self.complete(id)?;
        }
        Ok(due.len())
    }

    /// Plans a GPU -> host store of the pages of `keys`: those already on the host are skipped (a ready one is
    /// held until the ticket completes, a use to the policy), the others get slots in order, evicting as the
    /// policy says: all of them, or None when the pool cannot make room (nothing is evicted, nothing held). A key
    /// given twice is stored once. Each page stored gets a pool key of its own, never given before.
    pub fn store_keys<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Option<KeyStorePlan>> {
        check_lengths(keys)?;
        let hashes: Vec<u64> = keys.iter().map(|k| self.names.hash(k.as_ref())).collect();
        // The keys not on the host, each once: positions into `keys`, found by their bytes.
        let mut new: hashbrown::HashTable<u32> = hashbrown::HashTable::with_capacity(keys.len());
        let mut indices = Vec::with_capacity(keys.len());
        // Ready pages of the call are held, so making room never evicts them: they are no room.
        let mut held = Vec::new();
        let mut held_set = std::collections::HashSet::new();
        for (i, k) in keys.iter().enumerate() {
            let (k, h) = (k.as_ref(), hashes[i]);
            match self.names.slot_of(&self.pages, h, k) {
                Some(s) => {
                    if self.pages.entry(s).is_some_and(|e| e.ready) && held_set.insert(s) {
                        held.push(s);
                    }
                }
                None => {
                    if let hashbrown::hash_table::Entry::Vacant(e) =
                        new.entry(h, |&j| keys[j as usize].as_ref() == k, |&j| hashes[j as usize])
                    {
                        e.insert(i as u32);
                        indices.push(i as u32);
                    }
                }
            }
        }
        let idle = held.iter().filter(|&&s| self.pages.entry(s).is_some_and(|e| e.refs == 0)).count();
        if indices.len() > self.pages.available() - idle {
            return Ok(None);
        }
        for &s in &held {
            self.pages.acquire(s)?;
        }
        let missing: Vec<Key> = indices.iter().map(|_| self.names.new_key()).collect();
        let (slots, victims) = self.pages.reserve_evicting(&missing).expect("checked available()");
        // The names of the keys evicted here, before their slots are named again.
        let evicted: Vec<Name> = victims.iter().map(|&(s, k)| self.names.name(s, k)).collect();
        self.record(true, Medium::Cpu, victims);
        let ticket = self.issue(Ticket {
            kind: TicketKind::KeyStore { remaining: missing.len(), failed: false },
            pages: held.iter().map(|&s| (s, false)).chain(slots.iter().map(|&s| (s, true))).collect(),
            states: Vec::new(),
            epoch: 0,
        });
        let capacity = self.pages.capacity();
        for ((&i, &k), &s) in indices.iter().zip(&missing).zip(&slots) {
            let i = i as usize;
            self.names.insert(capacity, k, s, keys[i].as_ref(), hashes[i], ticket);
        }
        Ok(Some(KeyStorePlan { ticket, indices, slots, evicted }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Config;

    fn index(pages: u32) -> Index {
        let cfg = Config { event_buffer: 64, ..Config::new(pages, 0, 4) };
        Index::new(cfg, pages, 0).unwrap()
    }

    fn k(i: u8) -> Vec<u8> {
        vec![i; 36]
    }

    #[test]
    fn stored_keys_hit_from_the_first_and_evictions_name_the_engine_keys() {
        let mut ix = index(3);
        let p = ix.store_keys(&[k(1), k(2), k(3)]).unwrap().unwrap();
        assert_eq!((p.indices.as_slice(), p.evicted.len()), ([0, 1, 2].as_slice(), 0));
        assert_eq!(ix.lookup_keys(&[k(1), k(2)]).unwrap(), KeyLookup { hits: 0, pending: true });
        assert!(ix.complete(p.ticket).unwrap().is_none());
        assert_eq!(ix.lookup_keys(&[k(1), k(2), k(9), k(3)]).unwrap(), KeyLookup { hits: 2, pending: false });
        // Pages are released deepest first: k(3) is the least recently used and leaves first.
        let p = ix.store_keys(&[k(1), k(4)]).unwrap().unwrap();
        assert_eq!((p.indices, p.evicted), (vec![1], vec![Name::new(&k(3))]));
        ix.complete(p.ticket).unwrap();
        let events = ix.take_events();
        let names: Vec<(bool, Vec<Vec<u8>>)> = events.into_iter().map(|e| (e.removed, e.names)).collect();
        assert_eq!(names, [(false, vec![k(1), k(2), k(3)]), (true, vec![k(3)]), (false, vec![k(4)])]);
        assert_eq!(ix.stats().pages_stored, 4);
        ix.check().unwrap();
    }

    #[test]
    fn keys_are_looked_up_one_at_a_time_and_stores_settle_when_every_key_is_reported() {
        let mut ix = index(4);
        assert_eq!(ix.lookup_key(&k(1)).unwrap(), KeyState::Absent);
        let a = ix.store_keys(&[k(1), k(2)]).unwrap().unwrap();
        let b = ix.store_keys(&[k(3)]).unwrap().unwrap();
        assert_eq!(ix.lookup_key(&k(1)).unwrap(), KeyState::Pending);
        ix.check().unwrap();
        // Keys of no store in flight are ignored; a store is due once each of its keys is reported.
        assert_eq!(ix.complete_keys(&[k(1), k(9)], true).unwrap(), KeyCompletion { matched: 1, due: vec![] });
        assert_eq!(ix.complete_keys(&[k(1)], true).unwrap().matched, 0, "a key is reported once");
        ix.check().unwrap();
        let c = ix.complete_keys(&[k(3), k(2)], false).unwrap();
        assert_eq!(c, KeyCompletion { matched: 2, due: vec![(a.ticket, true), (b.ticket, true)] }, "oldest first");
        ix.abort(a.ticket).unwrap();
        ix.complete(b.ticket).unwrap();
        assert_eq!(ix.lookup_key(&k(1)).unwrap(), KeyState::Absent);
        assert_eq!(ix.lookup_key(&k(3)).unwrap(), KeyState::Ready);
        assert_eq!((ix.stats().lookups, ix.stats().lookup_tokens), (4, 16));
        ix.check().unwrap();
    }

    #[test]
    fn loads_complete_when_each_of_their_keys_is_reported_to_the_oldest_load_of_it() {
        let mut ix = index(4);
        let p = ix.store_keys(&[k(1), k(2), k(3)]).unwrap().unwrap();
        ix.complete(p.ticket).unwrap();
        let a = ix.load_keys(&[k(1), k(2)]).unwrap().ticket;
        let b = ix.load_keys(&[k(2), k(3)]).unwrap().ticket;
        // More reports of a key than loads of it in flight: an error naming it, and nothing reported.
        let err = ix.complete_load_keys(&[k(2), k(2), k(2)]).unwrap_err().to_string();
        assert!(err.contains("keys[2] has no load in flight"), "{err}");
        assert!(ix.complete_load_keys(&[k(4)]).is_err(), "a key never loaded");
        // k(2)'s first report goes to a, the oldest load of it; a completes with k(1), b with k(3) and k(2) again.
        assert_eq!(ix.complete_load_keys(&[k(2), k(3)]).unwrap(), 0);
        assert_eq!(ix.complete_load_keys(&[k(1)]).unwrap(), 1);
        assert!(ix.complete(a).is_err(), "a completed");
        assert_eq!(ix.complete_load_keys(&[k(2)]).unwrap(), 1);
        assert!(ix.complete(b).is_err(), "b completed");
        assert_eq!(ix.stats().pages_loaded, 4);
        // Every page is released: a store of three new keys evicts all three.
        assert_eq!(ix.store_keys(&[k(5), k(6), k(7), k(8)]).unwrap().unwrap().evicted.len(), 3);
        ix.check().unwrap();
    }

    #[test]
    fn a_load_settled_another_way_is_owed_nothing() {
        let mut ix = index(2);
        let p = ix.store_keys(&[k(1)]).unwrap().unwrap();
        ix.complete(p.ticket).unwrap();
        let a = ix.load_keys(&[k(1)]).unwrap().ticket;
        ix.abort(a).unwrap();
        assert!(ix.complete_load_keys(&[k(1)]).is_err(), "the aborted load is no longer in flight");
        let b = ix.load_keys(&[k(1)]).unwrap().ticket;
        assert_eq!(ix.complete_load_keys(&[k(1)]).unwrap(), 1);
        assert!(ix.complete(b).is_err());
        ix.check().unwrap();
    }

    #[test]
    fn a_store_settled_early_owes_nothing_and_its_keys_may_be_stored_again() {
        let mut ix = index(4);
        let a = ix.store_keys(&[k(1), k(2)]).unwrap().unwrap();
        ix.complete_keys(&[k(1)], true).unwrap();
        ix.abort(a.ticket).unwrap();
        ix.check().unwrap();
        let b = ix.store_keys(&[k(2)]).unwrap().unwrap();
        assert_eq!(ix.complete_keys(&[k(2)], true).unwrap().due, vec![(b.ticket, false)]);
        ix.complete(b.ticket).unwrap();
        // Under a new version the same bytes name another page: nothing is ready, and the old name is not reused.
        assert!(ix.set_model_version(b"v2"));
        assert_eq!(ix.lookup_key(&k(2)).unwrap(), KeyState::Absent);
        let c = ix.store_keys(&[k(2)]).unwrap().unwrap();
        assert_eq!(ix.lookup_key(&k(2)).unwrap(), KeyState::Pending);
        assert_eq!(ix.complete_keys(&[k(2)], true).unwrap().due, vec![(c.ticket, false)]);
        ix.complete(c.ticket).unwrap();
        assert_eq!(ix.lookup_key(&k(2)).unwrap(), KeyState::Ready);
        assert!(ix.lookup_key(&[0u8; 65]).is_err());
        let e = ix.complete_keys(&[k(2), Vec::new()], true).unwrap_err().to_string();
        assert_eq!(e, "keys[1]: an engine key must be 1 to 64 bytes, got 0 bytes");
        ix.check().unwrap();
    }

    #[test]
    fn a_store_that_cannot_make_room_changes_nothing() {
        let mut ix = index(2);
        let load = {
            let p = ix.store_keys(&[k(1), k(2)]).unwrap().unwrap();
            ix.complete(p.ticket).unwrap();
            ix.load_keys(&[k(1)]).unwrap()
        };
        // k(1) is held by the load: only k(2) can leave.
        assert_eq!(ix.store_keys(&[k(3), k(4)]).unwrap(), None);
        assert_eq!(ix.lookup_keys(&[k(1), k(2)]).unwrap().hits, 2);
        ix.complete(load.ticket).unwrap();
        assert_eq!(ix.pages().evictable(), 2);
        ix.check().unwrap();
    }

    #[test]
    fn loads_hold_every_page_or_none() {
        let mut ix = index(4);
        let p = ix.store_keys(&[k(1), k(2)]).unwrap().unwrap();
        ix.complete(p.ticket).unwrap();
        let err = ix.load_keys(&[k(1), k(5)]).unwrap_err().to_string();
        assert_eq!(err, "keys[1] is not ready on the host");
        assert_eq!(ix.load_keys(&[k(2), k(2)]).unwrap_err().to_string(), "keys[1] repeats an earlier key");
        assert_eq!(ix.pages().evictable(), 2, "a refused load holds nothing");
        let l = ix.load_keys(&[k(1), k(2)]).unwrap();
        assert_eq!(l.page_slots.len(), 2);
        assert_eq!((ix.stats().hits, ix.stats().hit_tokens), (1, 8));
        ix.abort(l.ticket).unwrap();
        assert_eq!((ix.stats().hits, ix.pages().evictable()), (0, 2));
    }

    #[test]
    fn a_key_given_twice_is_stored_once() {
        let mut ix = index(4);
        let p = ix.store_keys(&[k(1), k(2), k(1)]).unwrap().unwrap();
        assert_eq!((p.indices, p.slots.len()), (vec![0, 1], 2));
        ix.complete(p.ticket).unwrap();
        let p = ix.store_keys(&[k(2), k(2), k(3)]).unwrap().unwrap();
        assert_eq!(p.indices, vec![2]);
        ix.complete(p.ticket).unwrap();
        assert_eq!((ix.pages().used(), ix.pages().evictable()), (3, 3));
        ix.check().unwrap();
    }

    #[test]
    fn bad_keys_are_named() {
        let mut ix = index(4);
        let long = vec![0u8; 65];
        let e = ix.store_keys(&[k(1), long]).unwrap_err().to_string();
        assert_eq!(e, "keys[1]: an engine key must be 1 to 64 bytes, got 65 bytes");
        assert!(ix.lookup_keys(&[Vec::new()]).is_err());
        assert!(ix.load_keys::<Vec<u8>>(&[]).is_err());
        assert_eq!(ix.pages().used(), 0, "nothing was reserved");
    }

    #[test]
    fn a_new_model_version_retires_engine_keys_and_misses_them() {
        let mut ix = index(4);
        let p = ix.store_keys(&[k(1)]).unwrap().unwrap();
        ix.complete(p.ticket).unwrap();
        assert!(ix.set_model_version(b"v2"));
        assert_eq!(ix.lookup_keys(&[k(1)]).unwrap().hits, 0);
        let removed: Vec<_> = ix.take_events().into_iter().filter(|e| e.removed).flat_map(|e| e.names).collect();
        assert_eq!(removed, [k(1)]);
    }

    #[test]
    fn a_store_in_flight_across_a_model_version_is_owed_its_reports_and_the_key_is_stored_again() {
        let mut ix = index(4);
        let old = ix.store_keys(&[k(1)]).unwrap().unwrap();
        assert!(ix.set_model_version(b"v2"));
        assert_eq!(ix.key_state(&k(1)).unwrap(), KeyState::Absent, "the old version's page is no hit");
        let new = ix.store_keys(&[k(1)]).unwrap().unwrap();
        assert_eq!(new.indices, vec![0]);
        let key = |s: u32| ix.pages().entry(s).unwrap().key;
        assert_ne!(key(new.slots[0]), key(old.slots[0]), "a page stored by engine key has a pool key of its own");
        // A report goes to the oldest store owed the key.
        assert_eq!(ix.complete_keys(&[k(1)], true).unwrap().due, vec![(old.ticket, false)]);
        assert_eq!(ix.complete_keys(&[k(1)], true).unwrap().due, vec![(new.ticket, false)]);
        ix.check().unwrap();
        ix.complete(old.ticket).unwrap();
        ix.complete(new.ticket).unwrap();
        assert_eq!(ix.key_state(&k(1)).unwrap(), KeyState::Ready);
        assert_eq!(ix.pages().used(), 1, "the old version's page was dropped");
        ix.check().unwrap();
    }

    #[test]
    fn chain_keys_and_engine_keys_share_the_pool() {
        let mut ix = index(2);
        let tokens: Vec<i32> = (0..9).collect();
        let p = ix.plan_store("r", b"", &tokens, 9).unwrap();
        ix.complete(p.ticket).unwrap();
        let p = ix.store_keys(&[k(7)]).unwrap().unwrap();
        // The chain's deeper page leaves, named by its chain key's bytes.
        assert_eq!(p.evicted.len(), 1);
        assert_eq!(p.evicted[0].as_bytes().len(), 16);
        ix.complete(p.ticket).unwrap();
        assert_eq!(ix.lookup("s", b"", &tokens).unwrap().ready_pages, 1);
    }
}
