//! Pages keyed by the engine: byte strings the engine made (vLLM's block hashes with their group, SGLang's page
//! hashes), for a half of the engine that never sees tokens. Each maps to a pool key by a keyed hash under the
//! model version, so they share the pools, references, ready flags, reservations, policy, statistics and events
//! of token chains and never meet a chain's key. The engine's bytes are kept beside the pool, so what is evicted
//! is reported in them.
use super::{Index, Ticket, TicketKind};
use crate::chain::Key;
use crate::error::{invalid, Result};
use crate::events::Medium;
use crate::index::SlotPlan;

/// The longest engine key taken.
pub const MAX_ENGINE_KEY_BYTES: usize = 64;

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
    pub evicted: Vec<Vec<u8>>,
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

/// An engine key's bytes, kept inline (a key is at most `MAX_ENGINE_KEY_BYTES`).
#[derive(Clone, Copy)]
pub(super) struct Name {
    len: u8,
    bytes: [u8; MAX_ENGINE_KEY_BYTES],
}

impl Name {
    fn new(b: &[u8]) -> Self {
        let mut bytes = [0u8; MAX_ENGINE_KEY_BYTES];
        bytes[..b.len()].copy_from_slice(b);
        Self { len: b.len() as u8, bytes }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl std::borrow::Borrow<[u8]> for Name {
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl std::hash::Hash for Name {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.as_bytes().hash(h);
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

/// Hashes engine keys' bytes for the maps keyed by them: xxh3 under a seed drawn once a process (the keys come
/// from the engine, so their spread is not trusted).
#[derive(Clone, Copy, Debug)]
pub(super) struct NameHasher(u64);

impl Default for NameHasher {
    fn default() -> Self {
        use std::hash::BuildHasher;
        Self(std::collections::hash_map::RandomState::new().hash_one(0u64))
    }
}

impl std::hash::BuildHasher for NameHasher {
    type Hasher = NameState;
    fn build_hasher(&self) -> NameState {
        NameState(self.0)
    }
}

pub(super) struct NameState(u64);

impl std::hash::Hasher for NameState {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }
    fn write_usize(&mut self, n: usize) {
        self.0 ^= n as u64;
    }
}

/// What the index knows of one engine key's bytes: its pool key under the current model version (None after the
/// version changed), and the key store copying its page (0: none).
#[derive(Clone, Copy, Debug)]
struct Named {
    key: Option<Key>,
    store: u64,
}

/// The engine's bytes of the pool keys it named (some may have left the pool since), and for each name stored
/// its pool key (so a key asked about alone is not hashed again) and the store copying its page.
#[derive(Debug, Default)]
pub(super) struct Names {
    map: crate::pool::KeyMap<Name>,
    by_name: std::collections::HashMap<Name, Named, NameHasher>,
    /// Keys also being copied by a store of an earlier model version (the same bytes name another page now),
    /// oldest first: a report of such a key goes to the oldest store owed it.
    older: Vec<(Name, u64)>,
}

impl Names {
    pub(super) fn get(&self, k: Key) -> Option<&[u8]> {
        self.map.get(&k).map(Name::as_bytes)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The bytes of `k` as an event or eviction names it: the engine's key, or the chain key (16 bytes
    /// big-endian).
    pub(super) fn bytes(&self, k: Key) -> Vec<u8> {
        self.get(k).map_or_else(|| k.to_be_bytes().to_vec(), <[u8]>::to_vec)
    }

    /// A new model version: names map to other pool keys.
    pub(super) fn new_version(&mut self) {
        self.by_name.retain(|_, n| {
            n.key = None;
            n.store != 0
        });
    }

    /// A key store settled: its keys not yet reported have nothing left to report.
    pub(super) fn settle_store(&mut self, ticket: u64, pages: &crate::pool::Pool, slots: &[(u32, bool)]) {
        for &(s, new) in slots {
            let Some(name) = pages.entry(s).filter(|_| new).and_then(|e| self.map.get(&e.key)) else { continue };
            if let Some(n) = self.by_name.get_mut(name.as_bytes()).filter(|n| n.store == ticket) {
                n.store = 0;
            }
        }
        self.older.retain(|&(_, id)| id != ticket);
    }

    /// The store owed a report of `key`, which it no longer is: the oldest.
    fn take_store(&mut self, key: &[u8]) -> Option<u64> {
        if let Some(i) = self.older.iter().position(|(name, _)| name.as_bytes() == key) {
            return Some(self.older.remove(i).1);
        }
        let n = self.by_name.get_mut(key).filter(|n| n.store != 0)?;
        Some(std::mem::take(&mut n.store))
    }
}

impl Index {
    /// The pool key of an engine key (1 to 64 bytes) under the current model version.
    pub fn engine_key(&self, key: &[u8]) -> Result<Key> {
        check_length(key)?;
        Ok(self.engine_keys.key(key))
    }

    /// Where one engine key stands on the host (not counted as a lookup).
    pub fn key_state(&self, key: &[u8]) -> Result<KeyState> {
        let k = match self.names.by_name.get(key).and_then(|n| n.key) {
            Some(k) => k,
            None => self.engine_key(key)?,
        };
        Ok(match self.pages.slot_of(k).and_then(|s| self.pages.entry(s)) {
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
        for key in keys {
            let Some(id) = self.names.take_store(key.as_ref()) else { continue };
            out.matched += 1;
            if let Some(Ticket { kind: TicketKind::KeyStore { remaining, failed }, .. }) = self.tickets.get_mut(&id) {
                *remaining -= 1;
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
    /// reserved, not ready.
    pub(super) fn check_key_stores(&self) -> Result<()> {
        let invariant = |m: String| Err(crate::error::Error::Invariant(m));
        let mut owed: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
        let current = self.names.by_name.iter().filter(|(_, n)| n.store != 0).map(|(name, n)| (name, n.store));
        for (name, id) in current.chain(self.names.older.iter().map(|(name, id)| (name, *id))) {
            *owed.entry(id).or_default() += 1;
            // A key named under an earlier model version maps to another pool key now.
            if self.tickets.get(&id).is_some_and(|t| t.epoch == self.epoch) {
                let k = self.engine_key(name.as_bytes())?;
                if self.pages.slot_of(k).and_then(|s| self.pages.entry(s)).is_none_or(|e| e.ready) {
                    return invariant(format!("key {name:?} of store {id} is not being stored"));
                }
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

    fn engine_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Key>> {
        check_lengths(keys)?;
        Ok(self.engine_keys.keys(keys))
    }

    /// How many of `keys` (a prompt's pages in order) are ready on the host from the first, and whether the next
    /// one is being stored. Counted as a lookup of `keys.len()` blocks; nothing is held.
    pub fn lookup_keys<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<KeyLookup> {
        let keys = self.engine_keys(keys)?;
        let hits = keys.iter().take_while(|&&k| self.pages.ready_slot(k).is_some()).count();
        let pending = keys.get(hits).is_some_and(|&k| self.pages.slot_of(k).is_some());
        self.stats.lookups += 1;
        self.stats.lookup_tokens += (keys.len() * self.cfg.block_size) as u64;
        Ok(KeyLookup { hits, pending })
    }

    /// Acquires the pages of `keys` for a host -> GPU copy (all of them ready, else an error naming the first that
    /// is not, and nothing is held) until the ticket completes. Counted as a hit of `keys.len()` pages.
    pub fn load_keys<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<SlotPlan> {
        let pool_keys = self.engine_keys(keys)?;
        if pool_keys.is_empty() {
            return Err(invalid("load_keys needs at least one key"));
        }
        let slots = pool_keys
            .iter()
            .enumerate()
            .map(|(i, &k)| {
                self.pages.ready_slot(k).ok_or_else(|| invalid(format!("keys[{i}] is not ready on the host")))
            })
            .collect::<Result<Vec<u32>>>()?;
        let mut seen = crate::pool::KeyMap::default();
        if let Some(i) = pool_keys.iter().position(|&k| seen.insert(k, ()).is_some()) {
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
        Ok(SlotPlan { ticket, page_slots: slots.into_iter().map(Some).collect(), state_slots: Vec::new() })
    }

    /// Plans a GPU -> host store of the pages of `keys`: those already on the host are skipped (a ready one is
    /// held until the ticket completes, a use to the policy), the others get slots in order, evicting as the
    /// policy says: all of them, or None when the pool cannot make room (nothing is evicted, nothing held). A key
    /// given twice is stored once.
    pub fn store_keys<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Option<KeyStorePlan>> {
        let pool_keys = self.engine_keys(keys)?;
        let mut seen = crate::pool::KeyMap::with_capacity_and_hasher(pool_keys.len(), Default::default());
        let mut indices = Vec::with_capacity(pool_keys.len());
        let mut missing = Vec::with_capacity(pool_keys.len());
        for (i, &k) in pool_keys.iter().enumerate() {
            if self.pages.slot_of(k).is_none() && seen.insert(k, ()).is_none() {
                indices.push(i as u32);
                missing.push(k);
            }
        }
        // Ready pages of the call are held first, so making room never evicts them: they are no room.
        let mut held = Vec::new();
        for &k in &pool_keys {
            if let Some(s) = self.pages.ready_slot(k).filter(|_| seen.insert(k, ()).is_none()) {
                held.push(s);
            }
        }
        let idle = held.iter().filter(|&&s| self.pages.entry(s).is_some_and(|e| e.refs == 0)).count();
        if missing.len() > self.pages.available() - idle {
            return Ok(None);
        }
        self.names.prune(&self.pages);
        for &s in &held {
            self.pages.acquire(s)?;
        }
        let (slots, evicted) = self.pages.reserve(&missing).expect("checked available()");
        // The names of the keys evicted here go with them (others leave by `prune`).
        let evicted_names: Vec<Vec<u8>> = evicted.iter().map(|&k| self.names.take(k)).collect();
        if self.events.enabled() && !evicted.is_empty() {
            self.events.record(true, Medium::Cpu, evicted, evicted_names.clone());
        }
        let ticket = self.issue(Ticket {
            kind: TicketKind::KeyStore { remaining: missing.len(), failed: false },
            pages: held.iter().map(|&s| (s, false)).chain(slots.iter().map(|&s| (s, true))).collect(),
            states: Vec::new(),
            epoch: 0,
        });
        for (&i, &k) in indices.iter().zip(&missing) {
            self.names.insert(k, keys[i as usize].as_ref(), ticket);
        }
        Ok(Some(KeyStorePlan { ticket, indices, slots, evicted: evicted_names }))
    }
}

impl Names {
    /// Names pool key `k`, whose page `store` copies.
    fn insert(&mut self, k: Key, name: &[u8], store: u64) {
        let name = Name::new(name);
        self.map.insert(k, name);
        if let Some(old) = self.by_name.insert(name, Named { key: Some(k), store }) {
            if old.store != 0 {
                self.older.push((name, old.store));
            }
        }
    }

    /// `bytes(k)`, forgetting the name.
    fn take(&mut self, k: Key) -> Vec<u8> {
        let Some(name) = self.map.remove(&k) else { return k.to_be_bytes().to_vec() };
        if let Some(n) = self.by_name.get_mut(name.as_bytes()).filter(|n| n.key == Some(k)) {
            if n.store == 0 {
                self.by_name.remove(name.as_bytes());
            } else {
                n.key = None;
            }
        }
        name.as_bytes().to_vec()
    }

    /// Forgets the names of keys that left the pool, once they are as many as the pool's slots (so the maps
    /// stay within twice the pool, at O(1) a key).
    fn prune(&mut self, pool: &crate::pool::Pool) {
        if self.map.len() > 2 * pool.capacity() as usize {
            self.map.retain(|&k, _| pool.slot_of(k).is_some());
            self.by_name.retain(|_, n| n.store != 0 || n.key.is_some_and(|k| pool.slot_of(k).is_some()));
        }
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
        assert_eq!((p.indices, p.evicted), (vec![1], vec![k(3)]));
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
    fn engine_keys_under_xxh3_hit_and_miss_by_model_version_as_under_blake3() {
        let cfg = Config { hash_kind: crate::chain::HashKind::Xxh3, ..Config::new(4, 0, 4) };
        let mut ix = Index::new(cfg, 4, 0).unwrap();
        let p = ix.store_keys(&[k(1), k(2)]).unwrap().unwrap();
        ix.complete(p.ticket).unwrap();
        assert_eq!(ix.lookup_keys(&[k(1), k(2), k(3)]).unwrap().hits, 2);
        assert_ne!(ix.engine_key(&k(1)).unwrap(), index(4).engine_key(&k(1)).unwrap(), "each kind its own keys");
        let before = ix.engine_key(&k(1)).unwrap();
        assert!(ix.set_model_version(b"v2"));
        assert_ne!(ix.engine_key(&k(1)).unwrap(), before);
        assert_eq!(ix.lookup_keys(&[k(1)]).unwrap().hits, 0);
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
        assert_eq!(p.evicted[0].len(), 16);
        ix.complete(p.ticket).unwrap();
        assert_eq!(ix.lookup("s", b"", &tokens).unwrap().ready_pages, 1);
    }
}
