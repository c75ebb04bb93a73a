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

/// The engine's bytes of the pool keys it named (some may have left the pool since).
#[derive(Debug, Default)]
pub(super) struct Names {
    map: crate::pool::KeyMap<Box<[u8]>>,
}

impl Names {
    pub(super) fn get(&self, k: Key) -> Option<&[u8]> {
        self.map.get(&k).map(|b| &b[..])
    }

    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The bytes of `k` as an event or eviction names it: the engine's key, or the chain key (16 bytes
    /// big-endian).
    pub(super) fn bytes(&self, k: Key) -> Vec<u8> {
        self.get(k).map_or_else(|| k.to_be_bytes().to_vec(), <[u8]>::to_vec)
    }
}

impl Index {
    /// The pool key of an engine key (1 to 64 bytes) under the current model version.
    pub fn engine_key(&self, key: &[u8]) -> Result<Key> {
        if key.is_empty() || key.len() > MAX_ENGINE_KEY_BYTES {
            return Err(invalid(format!(
                "an engine key must be 1 to {MAX_ENGINE_KEY_BYTES} bytes, got {} bytes",
                key.len()
            )));
        }
        Ok(self.engine_keys.key(key))
    }

    fn engine_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Key>> {
        if let Some(i) = keys.iter().position(|k| !(1..=MAX_ENGINE_KEY_BYTES).contains(&k.as_ref().len())) {
            let e = self.engine_key(keys[i].as_ref()).expect_err("a key of a bad length");
            return Err(invalid(format!("keys[{i}]: {e}")));
        }
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
        for (&i, &k) in indices.iter().zip(&missing) {
            self.names.insert(k, keys[i as usize].as_ref());
        }
        let ticket = self.issue(Ticket {
            kind: TicketKind::KeyStore,
            pages: held.iter().map(|&s| (s, false)).chain(slots.iter().map(|&s| (s, true))).collect(),
            states: Vec::new(),
            epoch: 0,
        });
        Ok(Some(KeyStorePlan { ticket, indices, slots, evicted: evicted_names }))
    }
}

impl Names {
    fn insert(&mut self, k: Key, name: &[u8]) {
        self.map.insert(k, name.into());
    }

    /// `bytes(k)`, forgetting the name.
    fn take(&mut self, k: Key) -> Vec<u8> {
        self.map.remove(&k).map_or_else(|| k.to_be_bytes().to_vec(), <[u8]>::into_vec)
    }

    /// Forgets the names of keys that left the pool, once they are as many as the pool's slots (so the map
    /// stays within twice the pool, at O(1) a key).
    fn prune(&mut self, pool: &crate::pool::Pool) {
        if self.map.len() > 2 * pool.capacity() as usize {
            self.map.retain(|&k, _| pool.slot_of(k).is_some());
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
