//! The index: per-request chains, the page and state pools, lookup / load / store planning and completion.
//!
//! Nothing here copies bytes. A plan names host slots; the caller copies and then reports the ticket complete
//! (entries become ready, references drop) or aborted (new entries are discarded).
use std::collections::HashMap;

use crate::error::{invalid, Error, Result};
use crate::index::chain::{BlockHasher, Chain, Check, HashKind, Key, TokenIds};
use crate::index::events::{Event, EventLog, Medium};
use crate::index::policy::Policy;
use crate::index::pool::Pool;
use crate::index::stats::Stats;

pub mod chain;
mod engine_keys;
pub mod events;
pub mod policy;
pub mod pool;
pub mod stats;
pub use engine_keys::{KeyCompletion, KeyLookup, KeyState, KeyStorePlan, Name, MAX_ENGINE_KEY_BYTES};

#[derive(Clone, Debug)]
pub struct Config {
    pub page_slots: u32,
    pub state_slots: u32,
    pub block_size: usize,
    /// Prompt suffix the engine always recomputes (>= 1).
    pub keep_tokens: usize,
    /// Hits shorter than this are misses.
    pub min_hit_tokens: usize,
    /// States are stored at this many of the deepest block boundaries of a prompt.
    pub state_lookback_blocks: usize,
    /// A state at boundary b can be taken only while b >= seq_len - ring_slack.
    pub ring_slack: usize,
    pub hash_kind: HashKind,
    pub hash_key: Vec<u8>,
    /// How both pools pick what to evict.
    pub eviction_policy: Policy,
    /// KV events kept until taken (0: none recorded).
    pub event_buffer: usize,
}

impl Config {
    /// The defaults of `kvtier.IndexConfig` for a pool size and block size.
    pub fn new(page_slots: u32, state_slots: u32, block_size: usize) -> Self {
        Self {
            page_slots,
            state_slots,
            block_size,
            keep_tokens: 1,
            min_hit_tokens: 2 * block_size,
            state_lookback_blocks: 4,
            ring_slack: 0,
            hash_kind: HashKind::Blake3,
            hash_key: Vec::new(),
            eviction_policy: Policy::Lru,
            event_buffer: 0,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.page_slots == 0 {
            return Err(invalid("page_slots must be > 0, got 0"));
        }
        if self.block_size == 0 {
            return Err(invalid("block_size must be > 0, got 0"));
        }
        if self.keep_tokens == 0 {
            return Err(invalid("keep_tokens must be >= 1, got 0"));
        }
        Ok(())
    }
}

/// What the host holds for a prompt now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lookup {
    /// Tokens a resume would restore (0: miss).
    pub hit_tokens: usize,
    /// Longest run of ready pages within the keep_tokens cap, before snapping to a state boundary.
    pub ready_pages: usize,
    /// Full blocks of the prompt that a hit may cover (the keep_tokens cap).
    pub limit_pages: usize,
}

/// A load begun: the slots to copy host -> GPU, held (acquired) until the ticket completes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadPlan {
    pub ticket: u64,
    pub hit_tokens: usize,
    /// Host slot of page i, for i in 0..hit_tokens / block_size.
    pub page_slots: Vec<u32>,
    pub state_slot: Option<u32>,
}

/// A store planned: new slots to fill GPU -> host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StorePlan {
    pub ticket: u64,
    /// Prompt page indices to copy, and the host slot each goes to.
    pub page_indices: Vec<u32>,
    pub page_slots: Vec<u32>,
    /// Block boundaries (in tokens) whose state to copy, deepest first, and the state slot each goes to.
    pub state_boundaries: Vec<usize>,
    pub state_slots: Vec<u32>,
}

#[derive(Debug)]
enum TicketKind {
    Load {
        hit_tokens: usize,
    },
    /// `lead`: the ticket's first `lead` pages are the prompt's pages 0..lead (what an L3 put may name).
    Store {
        lead: usize,
    },
    /// Ready entries held while an L3 put reads them.
    Hold,
    /// Fresh entries being filled from L3.
    Fetch,
    /// Pages of engine keys copied GPU -> host (and ready ones held); `remaining` of the keys copied are not
    /// reported done yet (`complete_keys`), and `failed` says whether one was reported failed.
    KeyStore {
        remaining: usize,
        failed: bool,
    },
}

/// What a completed store made ready: the chain keys of the prompt's pages 0..n it covered (held or new) and
/// the boundaries, in pages, of the states it stored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ready {
    pub page_keys: Vec<Key>,
    pub state_pages: Vec<usize>,
}

/// The snap rule of a hit: the deepest boundary `p` in `1..=pages` (in pages) that has a state, 0 if none.
pub(crate) fn deepest_with_state(pages: usize, has_state: impl Fn(usize) -> bool) -> usize {
    (1..=pages).rev().find(|&p| has_state(p)).unwrap_or(0)
}

/// Entries held for an L3 put (`hold`) or reserved for an L3 get (`plan_fetch`): one slot per key given, None
/// where the key was skipped (not ready on the host for a hold; already present for a fetch).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotPlan {
    pub ticket: u64,
    pub page_slots: Vec<Option<u32>>,
    pub state_slots: Vec<Option<u32>>,
}

/// Entries a ticket holds (one reference each). `new_*` were reserved by a store (not ready until completion); the rest were ready and
/// are only held. Pages are in prompt order.
#[derive(Debug)]
struct Ticket {
    kind: TicketKind,
    pages: Vec<(u32, bool)>,
    states: Vec<(u32, bool)>,
    /// The model version the ticket was issued under (see `Index::set_model_version`).
    epoch: u64,
}

#[derive(Debug, Default)]
struct Request {
    chain: Chain,
    /// The lookup statistics already count this request.
    counted: bool,
    /// The model version the request was first seen under.
    epoch: u64,
    /// What its last lookup answered (an L3 fetch starts from it).
    looked: Lookup,
}

#[derive(Debug)]
pub struct Index {
    cfg: Config,
    hasher: BlockHasher,
    pages: Pool,
    states: Pool,
    requests: HashMap<String, Request>,
    tickets: HashMap<u64, Ticket>,
    next_ticket: u64,
    stats: Stats,
    /// The model version every key is derived under (empty: none named), and how many times it changed.
    model_version: Vec<u8>,
    epoch: u64,
    events: EventLog,
    /// The engine's bytes of engine-keyed pages, by slot and found by their bytes.
    names: engine_keys::Names,
    /// The `load_keys` tickets each engine key is owed a report for (`complete_load_keys`).
    key_loads: engine_keys::KeyLoads,
}

impl Index {
    /// An index whose pools can hand out `usable_pages` / `usable_states` slots now (grow later with `grow`).
    pub fn new(cfg: Config, usable_pages: u32, usable_states: u32) -> Result<Self> {
        cfg.validate()?;
        let hasher = BlockHasher::new(cfg.hash_kind, &cfg.hash_key);
        Ok(Self {
            hasher,
            pages: Pool::with_policy(cfg.page_slots, usable_pages, cfg.eviction_policy),
            states: Pool::with_policy(cfg.state_slots, usable_states, cfg.eviction_policy),
            requests: HashMap::new(),
            tickets: HashMap::new(),
            next_ticket: 1,
            stats: Stats::default(),
            model_version: Vec::new(),
            epoch: 0,
            events: EventLog::new(cfg.event_buffer),
            names: engine_keys::Names::default(),
            key_loads: engine_keys::KeyLoads::default(),
            cfg,
        })
    }

    /// The model's version: every key is derived under it (a checkpoint revision the deployment vouches for,
    /// changed when weights are updated in place). A new version retires the old one's entries: evictable ones are
    /// dropped now, entries in use when their copies finish, and copies still in flight never make an entry ready.
    /// Requests seen before the change are served and stored nothing until forgotten (their prefill may have run
    /// under the old weights). Returns whether the version changed.
    pub fn set_model_version(&mut self, version: &[u8]) -> bool {
        if version == self.model_version.as_slice() {
            return false;
        }
        self.model_version = version.to_vec();
        self.names.new_version();
        self.epoch += 1;
        let dropped = self.pages.retire_all();
        self.record(true, Medium::Cpu, dropped);
        self.states.retire_all();
        self.stats.model_versions += 1;
        true
    }

    pub fn model_version(&self) -> &[u8] {
        &self.model_version
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }
    pub fn pages(&self) -> &Pool {
        &self.pages
    }
    pub fn states(&self) -> &Pool {
        &self.states
    }
    pub fn stats(&self) -> &Stats {
        &self.stats
    }
    /// Every counter and gauge of the index by its name in the statistics table (rust/index/stats.rs).
    pub fn stat_values(&self) -> Vec<(&'static str, u64)> {
        let s = &self.stats;
        let (p, st) = (&self.pages, &self.states);
        vec![
            ("lookups", s.lookups),
            ("hits", s.hits),
            ("hit_tokens", s.hit_tokens),
            ("lookup_tokens", s.lookup_tokens),
            ("deferred", s.deferred),
            ("stores", s.stores),
            ("store_skipped", s.store_skipped),
            ("store_skipped_pinning", s.store_skipped_pinning),
            ("stale_lookups", s.stale_lookups),
            ("pages_stored", s.pages_stored),
            ("pages_loaded", s.pages_loaded),
            ("pages_evicted", p.evicted()),
            ("states_stored", s.states_stored),
            ("states_loaded", s.states_loaded),
            ("states_evicted", st.evicted()),
            ("errors", s.errors),
            ("prompt_mismatches", s.prompt_mismatches),
            ("model_versions", s.model_versions),
            ("pages_retired", p.retired()),
            ("states_retired", st.retired()),
            ("stale_version_calls", s.stale_version_calls),
            ("page_slots", u64::from(p.capacity())),
            ("page_slots_usable", u64::from(p.usable())),
            ("pages_used", p.used() as u64),
            ("pages_evictable", p.evictable() as u64),
            ("state_slots", u64::from(st.capacity())),
            ("state_slots_usable", u64::from(st.usable())),
            ("states_used", st.used() as u64),
            ("states_evictable", st.evictable() as u64),
            ("in_flight", self.tickets.len() as u64),
            ("requests", self.requests.len() as u64),
            ("events_dropped", self.events_dropped()),
        ]
    }

    pub fn in_flight(&self) -> usize {
        self.tickets.len()
    }
    pub fn requests(&self) -> usize {
        self.requests.len()
    }

    fn has_states(&self) -> bool {
        self.cfg.state_slots > 0
    }

    /// Whether the host pools are still being pinned (some of their slots are not usable yet).
    pub fn pinning(&self) -> bool {
        self.pages.usable() < self.pages.capacity() || self.states.usable() < self.states.capacity()
    }

    /// More host slots became usable (a pin step of a lazily allocated pool).
    pub fn grow(&mut self, usable_pages: u32, usable_states: u32) {
        self.pages.grow(usable_pages);
        self.states.grow(usable_states);
    }

    /// Hashes `tokens` into the request's chain and returns the chain keys.
    ///
    /// A request's tokens only grow until `forget`: a call for a known request checks that the prompt extends
    /// what was hashed (`check`: every hashed token, or for a lookup that only answers the first and last hashed
    /// blocks) and hashes only the new full blocks. A prompt that does not extend the chain is
    /// `Error::PromptMismatch` (a request id reused without `forget`), counted in `prompt_mismatches`.
    pub fn chain<T: TokenIds + ?Sized>(
        &mut self,
        request_id: &str,
        namespace: &[u8],
        tokens: &T,
        check: Check,
    ) -> Result<&[Key]> {
        let bs = self.cfg.block_size;
        let fresh = !self.requests.contains_key(request_id);
        if fresh {
            self.requests.insert(request_id.to_owned(), Request { epoch: self.epoch, ..Request::default() });
        }
        let root = self.hasher.root(&self.model_version, namespace);
        let req = self.requests.get_mut(request_id).expect("inserted above");
        let outcome = match req.chain.mismatch(bs, namespace, tokens, check) {
            Ok(Some(reason)) => {
                self.stats.prompt_mismatches += 1;
                Err(Error::PromptMismatch { request: request_id.to_owned(), reason })
            }
            Ok(None) => req.chain.extend(&self.hasher, bs, namespace, root, tokens),
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            if fresh {
                self.requests.remove(request_id); // a refused call leaves no trace
            }
            return Err(e);
        }
        Ok(self.requests[request_id].chain.keys())
    }

    /// Tokens hashed so far for a request (0 for an unknown one): a caller reading tokens from a list for a check
    /// of the ends reads the first and last hashed blocks and what follows them, nothing else.
    pub fn hashed_tokens(&self, request_id: &str) -> usize {
        self.requests.get(request_id).map_or(0, |r| r.chain.hashed_tokens())
    }

    /// What the request's last lookup answered (None for an unknown request).
    pub fn last_lookup(&self, request_id: &str) -> Option<&Lookup> {
        self.requests.get(request_id).map(|r| &r.looked)
    }

    /// The chain keys of a request hashed so far.
    pub fn keys(&self, request_id: &str) -> Result<&[Key]> {
        self.request(request_id).map(|r| r.chain.keys())
    }

    fn request(&self, request_id: &str) -> Result<&Request> {
        self.requests.get(request_id).ok_or_else(|| Error::UnknownRequest(request_id.to_owned()))
    }

    /// Whether a known request was first seen under an earlier model version.
    fn stale_version(&self, request_id: &str) -> bool {
        self.requests.get(request_id).is_some_and(|r| r.epoch != self.epoch)
    }

    /// What a resume of this prompt would restore now. Counts the request in the lookup statistics once. The
    /// prompt is checked at its ends only (an answer serves nothing): `verify` it before a hit is loaded.
    pub fn lookup<T: TokenIds + ?Sized>(&mut self, request_id: &str, namespace: &[u8], tokens: &T) -> Result<Lookup> {
        self.chain(request_id, namespace, tokens, Check::Ends)?;
        let req = self.requests.get_mut(request_id).expect("chained above");
        if !req.counted {
            req.counted = true;
            self.stats.lookups += 1;
            self.stats.lookup_tokens += tokens.len() as u64;
        }
        let look = if self.stale_version(request_id) {
            self.stats.stale_version_calls += 1;
            Lookup::default()
        } else {
            self.probe(self.requests[request_id].chain.keys(), tokens.len())
        };
        self.requests.get_mut(request_id).expect("chained above").looked = look.clone();
        Ok(look)
    }

    /// Compares every token the request hashed with `tokens` (before a hit is loaded into the engine's blocks):
    /// `Error::PromptMismatch` when the prompt does not extend them.
    pub fn verify<T: TokenIds + ?Sized>(&mut self, request_id: &str, namespace: &[u8], tokens: &T) -> Result<()> {
        self.request(request_id)?;
        self.chain(request_id, namespace, tokens, Check::Full).map(drop)
    }

    /// What a lookup of this prompt would answer now, keeping nothing: no chain, no statistics.
    pub fn peek<T: TokenIds + ?Sized>(&self, namespace: &[u8], tokens: &T) -> Result<Lookup> {
        let mut chain = Chain::default();
        let root = self.hasher.root(&self.model_version, namespace);
        chain.extend(&self.hasher, self.cfg.block_size, namespace, root, tokens)?;
        Ok(self.probe(chain.keys(), tokens.len()))
    }

    /// The hit of a prompt of `n_tokens` tokens whose chain keys are `keys`.
    fn probe(&self, keys: &[Key], n_tokens: usize) -> Lookup {
        let bs = self.cfg.block_size;
        let limit_pages = n_tokens.saturating_sub(self.cfg.keep_tokens) / bs;
        let keys = &keys[..limit_pages];
        let ready_pages = keys.iter().take_while(|&&k| self.pages.ready_slot(k).is_some()).count();
        let mut hit_pages = ready_pages;
        if self.has_states() {
            hit_pages = deepest_with_state(ready_pages, |p| self.states.ready_slot(keys[p - 1]).is_some());
        }
        let mut hit_tokens = hit_pages * bs;
        if hit_tokens < self.cfg.min_hit_tokens.max(1) {
            hit_tokens = 0;
        }
        Lookup { hit_tokens, ready_pages, limit_pages }
    }

    /// The engine could not allocate GPU blocks for a hit now; nothing is touched.
    pub fn defer(&mut self, request_id: &str) -> Result<()> {
        self.request(request_id)?;
        self.stats.deferred += 1;
        Ok(())
    }

    /// Acquires the first `hit_tokens / block_size` pages (and the state at that boundary) for a host -> GPU copy.
    /// Fails with `Stale` if any of them is no longer ready on the host.
    pub fn begin_load(&mut self, request_id: &str, hit_tokens: usize) -> Result<LoadPlan> {
        let bs = self.cfg.block_size;
        let keys = self.request(request_id)?.chain.keys();
        if hit_tokens == 0 || !hit_tokens.is_multiple_of(bs) || hit_tokens / bs > keys.len() {
            return Err(invalid(format!(
                "hit_tokens must be a positive multiple of block_size {bs} within the {} hashed blocks, got {hit_tokens}",
                keys.len()
            )));
        }
        let n = hit_tokens / bs;
        let page_slots: Option<Vec<u32>> = keys[..n].iter().map(|&k| self.pages.ready_slot(k)).collect();
        let state_slot = if self.has_states() { self.states.ready_slot(keys[n - 1]).map(Some) } else { Some(None) };
        let (Some(page_slots), Some(state_slot), false) = (page_slots, state_slot, self.stale_version(request_id))
        else {
            self.stats.stale_lookups += 1;
            return Err(Error::Stale(request_id.to_owned()));
        };
        for &s in &page_slots {
            self.pages.acquire(s)?;
        }
        if let Some(s) = state_slot {
            self.states.acquire(s)?;
        }
        self.stats.hits += 1;
        self.stats.hit_tokens += hit_tokens as u64;
        let ticket = self.issue(Ticket {
            kind: TicketKind::Load { hit_tokens },
            pages: page_slots.iter().map(|&s| (s, false)).collect(),
            states: state_slot.map(|s| (s, false)).into_iter().collect(),
            epoch: 0,
        });
        Ok(LoadPlan { ticket, hit_tokens, page_slots, state_slot })
    }

    /// Plans the write-through store of a prompt's full blocks (the rules: docs/INDEX.md).
    ///
    /// - A prompt whose full blocks hold fewer than `min_hit_tokens` tokens stores nothing: it could never hit.
    /// - Pages already on the host are acquired first, so reserving the missing ones never evicts the prompt's own
    ///   prefix; they are touched (LRU) when the ticket completes. Missing pages get slots in prompt order.
    /// - States: at most `state_lookback_blocks` boundaries, the prompt's deepest ones, each at or above
    ///   `min_hit_tokens`, with all its pages on the host, and still in the engine's ring
    ///   (`b >= seq_len - ring_slack`). States already there are acquired first; missing ones get slots deepest
    ///   first, as many as fit.
    /// - When the page pool cannot take every missing page, a model without states stores the first pages that
    ///   fit; a model with states stores new pages only up to the deepest boundary whose state is stored (a run
    ///   that ends at no state can never hit), and none when there is no such boundary.
    pub fn plan_store<T: TokenIds + ?Sized>(
        &mut self,
        request_id: &str,
        namespace: &[u8],
        tokens: &T,
        seq_len: usize,
    ) -> Result<StorePlan> {
        if seq_len < tokens.len() {
            return Err(invalid(format!("seq_len must be >= the {} prompt tokens, got {seq_len}", tokens.len())));
        }
        let keys = self.chain(request_id, namespace, tokens, Check::Full)?.to_vec();
        let bs = self.cfg.block_size;
        let stale = self.stale_version(request_id);
        if stale {
            self.stats.stale_version_calls += 1;
        }
        if stale || keys.len() * bs < self.cfg.min_hit_tokens {
            let ticket = self.issue(Ticket {
                kind: TicketKind::Store { lead: 0 },
                pages: Vec::new(),
                states: Vec::new(),
                epoch: 0,
            });
            return Ok(StorePlan { ticket, ..StorePlan::default() });
        }

        // Pages: acquire the ready ones; find the missing ones and how many of them fit.
        let mut pages: Vec<(usize, u32, bool)> = Vec::with_capacity(keys.len());
        let mut missing = Vec::new();
        for (i, &k) in keys.iter().enumerate() {
            match self.pages.slot_of(k) {
                Some(s) if self.pages.entry(s).is_some_and(|e| e.ready) => {
                    self.pages.acquire(s)?;
                    pages.push((i, s, false));
                }
                Some(_) => {} // another store is filling it
                None => missing.push(i),
            }
        }
        let pages_wanted = !missing.is_empty();
        let fit = missing.len().min(self.pages.available());
        // Pages 0..run are on the host once the first `fit` missing pages are in.
        let run = missing.get(fit).copied().unwrap_or(keys.len());

        // States at the candidate boundaries (in blocks), deepest first: present ones acquired before any is
        // reserved, so a reservation never evicts a state of this prompt.
        let mut states = Vec::new();
        let mut state_boundaries = Vec::new();
        let mut state_slots = Vec::new();
        let mut states_wanted = false;
        let mut deepest_state = 0;
        if self.has_states() {
            let lowest = (keys.len() + 1).saturating_sub(self.cfg.state_lookback_blocks).max(1);
            let lowest = lowest.max(self.cfg.min_hit_tokens.div_ceil(bs));
            let candidates: Vec<usize> =
                (lowest..=run).rev().take_while(|&blocks| blocks * bs + self.cfg.ring_slack >= seq_len).collect();
            let mut absent = Vec::new();
            for &blocks in &candidates {
                match self.states.slot_of(keys[blocks - 1]) {
                    Some(s) => {
                        if self.states.entry(s).is_some_and(|e| e.ready) {
                            self.states.acquire(s)?;
                            states.push((s, false));
                        }
                        deepest_state = deepest_state.max(blocks);
                    }
                    None => absent.push(blocks),
                }
            }
            states_wanted = !absent.is_empty();
            for blocks in absent {
                if let Some((slots, _)) = self.states.reserve(&[keys[blocks - 1]]) {
                    states.push((slots[0], true));
                    state_boundaries.push(blocks * bs);
                    state_slots.push(slots[0]);
                    deepest_state = deepest_state.max(blocks);
                }
            }
        }

        let take = if fit < missing.len() && self.has_states() {
            missing[..fit].partition_point(|&i| i < deepest_state)
        } else {
            fit
        };
        missing.truncate(take);
        let missing_keys: Vec<Key> = missing.iter().map(|&i| keys[i]).collect();
        let (new_slots, evicted) = self.pages.reserve_evicting(&missing_keys).expect("bounded by available()");
        self.record(true, Medium::Cpu, evicted);
        pages.extend(missing.iter().zip(&new_slots).map(|(&i, &s)| (i, s, true)));
        pages.sort_unstable_by_key(|p| p.0);

        if !new_slots.is_empty() || !state_slots.is_empty() {
            self.stats.stores += 1;
        } else if pages_wanted || states_wanted {
            self.stats.store_skipped += 1;
            self.stats.store_skipped_pinning += u64::from(self.pinning());
        }
        let lead = pages.iter().enumerate().take_while(|&(j, p)| p.0 == j).count();
        let ticket = self.issue(Ticket {
            kind: TicketKind::Store { lead },
            pages: pages.iter().map(|&(_, s, new)| (s, new)).collect(),
            states,
            epoch: 0,
        });
        Ok(StorePlan {
            ticket,
            page_indices: missing.iter().map(|&i| i as u32).collect(),
            page_slots: new_slots,
            state_boundaries,
            state_slots,
        })
    }

    /// Holds (acquires) the ready entries of these keys (an L3 put reads them) until the ticket completes.
    pub fn hold(&mut self, page_keys: &[Key], state_keys: &[Key]) -> Result<SlotPlan> {
        fn acquire_ready(pool: &mut Pool, keys: &[Key], held: &mut Vec<(u32, bool)>) -> Result<Vec<Option<u32>>> {
            keys.iter()
                .map(|&k| match pool.ready_slot(k) {
                    Some(s) => pool.hold(s).map(|()| {
                        held.push((s, false));
                        Some(s)
                    }),
                    None => Ok(None),
                })
                .collect()
        }
        let (mut pages, mut states) = (Vec::new(), Vec::new());
        let page_slots = acquire_ready(&mut self.pages, page_keys, &mut pages)?;
        let state_slots = acquire_ready(&mut self.states, state_keys, &mut states)?;
        let ticket = self.issue(Ticket { kind: TicketKind::Hold, pages, states, epoch: 0 });
        Ok(SlotPlan { ticket, page_slots, state_slots })
    }

    /// Reserves fresh slots for pages and states fetched from L3 (keys already on the host are skipped): all of
    /// them or, when the pools cannot make room, none (None is returned and nothing is evicted). Complete the
    /// ticket once the bytes are in, abort it if the get failed.
    pub fn plan_fetch(&mut self, page_keys: &[Key], state_keys: &[Key]) -> Result<Option<SlotPlan>> {
        let missing = |pool: &Pool, keys: &[Key]| -> Vec<Key> {
            let mut seen = crate::index::chain::KeyMap::default();
            keys.iter().copied().filter(|k| pool.slot_of(*k).is_none() && seen.insert(*k, ()).is_none()).collect()
        };
        let new_pages = missing(&self.pages, page_keys);
        let new_states = missing(&self.states, state_keys);
        if new_pages.len() > self.pages.available() || new_states.len() > self.states.available() {
            return Ok(None);
        }
        let (page_new_slots, evicted) = self.pages.reserve_evicting(&new_pages).expect("checked available()");
        self.record(true, Medium::Cpu, evicted);
        let (state_new_slots, _) = self.states.reserve(&new_states).expect("checked available()");
        let pick = |pool: &Pool, keys: &[Key], fresh: &[Key]| -> Vec<Option<u32>> {
            keys.iter().map(|k| if fresh.contains(k) { pool.slot_of(*k) } else { None }).collect()
        };
        let page_slots = pick(&self.pages, page_keys, &new_pages);
        let state_slots = pick(&self.states, state_keys, &new_states);
        let ticket = self.issue(Ticket {
            kind: TicketKind::Fetch,
            pages: page_new_slots.iter().map(|&s| (s, true)).collect(),
            states: state_new_slots.iter().map(|&s| (s, true)).collect(),
            epoch: 0,
        });
        Ok(Some(SlotPlan { ticket, page_slots, state_slots }))
    }

    fn issue(&mut self, mut ticket: Ticket) -> u64 {
        ticket.epoch = self.epoch;
        let id = self.next_ticket;
        self.next_ticket += 1;
        self.tickets.insert(id, ticket);
        id
    }

    /// The copies of a ticket finished: stored entries become ready; every reference of the ticket is dropped,
    /// deepest page first, so that a prompt's first pages are the most recently used. Reports what a store made
    /// ready (None for other tickets, or a store that made nothing new ready): the chain keys of the prompt's
    /// pages 0.. that the ticket covered, and its new states' boundaries in pages. This is what the L3
    /// write-behind puts.
    pub fn complete(&mut self, ticket: u64) -> Result<Option<Ready>> {
        let t = self.take_ticket(ticket)?;
        if t.epoch != self.epoch {
            // Issued under an earlier model version: what it copied belongs to the old weights.
            if let TicketKind::Load { .. } = t.kind {
                self.stats.pages_loaded += t.pages.len() as u64;
                self.stats.states_loaded += t.states.len() as u64;
            }
            self.drop_ticket(&t)?;
            return Ok(None);
        }
        let stored = matches!(t.kind, TicketKind::Store { .. } | TicketKind::KeyStore { .. });
        let (mut resident, mut removed) = (Vec::new(), Vec::new());
        for &(s, new) in t.pages.iter().rev() {
            if new {
                self.pages.mark_ready(s)?;
                self.stats.pages_stored += u64::from(stored);
                resident.extend(self.pages.entry(s).map(|e| (s, e.key)));
            }
            // A retired entry met again (the version set back to an earlier one) is dropped at its last release.
            removed.extend(self.pages.release(s)?.map(|k| (s, k)));
        }
        resident.reverse();
        self.record(false, Medium::Cpu, resident);
        self.record(true, Medium::Cpu, removed);
        for &(s, new) in &t.states {
            if new {
                self.states.mark_ready(s)?;
                self.stats.states_stored += u64::from(stored);
            }
            self.states.release(s)?;
        }
        if let TicketKind::Load { .. } = t.kind {
            self.stats.pages_loaded += t.pages.len() as u64;
            self.stats.states_loaded += t.states.len() as u64;
        }
        let TicketKind::Store { lead } = t.kind else { return Ok(None) };
        if !t.pages.iter().chain(&t.states).any(|&(_, new)| new) {
            return Ok(None);
        }
        let key_of = |pool: &Pool, s: u32| pool.entry(s).map(|e| e.key);
        let page_keys: Vec<Key> = t.pages[..lead].iter().map_while(|&(s, _)| key_of(&self.pages, s)).collect();
        let state_pages = t
            .states
            .iter()
            .filter(|&&(_, new)| new)
            .filter_map(|&(s, _)| key_of(&self.states, s))
            .filter_map(|k| page_keys.iter().rposition(|&p| p == k).map(|i| i + 1))
            .collect();
        Ok(Some(Ready { page_keys, state_pages }))
    }

    /// The copies of a ticket failed: stored or fetched entries are discarded (their slots freed), held ones
    /// released, a load's hit uncounted. The caller counts the failure (`count_error`).
    pub fn abort(&mut self, ticket: u64) -> Result<()> {
        let t = self.take_ticket(ticket)?;
        self.drop_ticket(&t)?;
        if let TicketKind::Load { hit_tokens } = t.kind {
            self.stats.hits -= 1;
            self.stats.hit_tokens -= hit_tokens as u64;
        }
        Ok(())
    }

    /// Removes a ticket to settle it; a key store's keys not reported yet are forgotten with it.
    fn take_ticket(&mut self, ticket: u64) -> Result<Ticket> {
        let t = self.tickets.remove(&ticket).ok_or(Error::UnknownTicket(ticket))?;
        self.key_loads.forget(ticket);
        if let TicketKind::KeyStore { remaining, .. } = t.kind {
            if remaining > 0 {
                self.names.settle_store(ticket, &t.pages);
            }
        }
        Ok(t)
    }

    /// Discards a ticket's new entries and releases the entries it held; a retired page dropped at its last
    /// release is announced removed (states are not announced: a state key is no block hash).
    fn drop_ticket(&mut self, t: &Ticket) -> Result<()> {
        let removed = Self::drop_entries(&mut self.pages, &t.pages)?;
        self.record(true, Medium::Cpu, removed);
        Self::drop_entries(&mut self.states, &t.states)?;
        Ok(())
    }

    fn drop_entries(pool: &mut Pool, entries: &[(u32, bool)]) -> Result<Vec<(u32, Key)>> {
        let mut removed = Vec::new();
        for &(s, new) in entries {
            if new {
                pool.discard(s)?;
            } else {
                removed.extend(pool.release(s)?.map(|k| (s, k)));
            }
        }
        Ok(removed)
    }

    /// The request is gone: drop its chain. Returns whether it was known.
    pub fn forget(&mut self, request_id: &str) -> bool {
        self.requests.remove(request_id).is_some()
    }

    /// The KV events recorded since the last take, oldest first: host pages made ready (stores and L3 fetches)
    /// and evicted, and what the L3 tier reported (`record_storage`).
    pub fn take_events(&mut self) -> Vec<Event> {
        self.events.take()
    }

    /// Events dropped from a full log because nobody took them.
    pub fn events_dropped(&self) -> u64 {
        self.events.dropped()
    }

    /// The L3 tier stored (or found gone, `removed`) the objects holding these pages.
    pub fn record_storage(&mut self, removed: bool, keys: Vec<Key>) {
        let pages = keys.into_iter().map(|k| (self.pages.slot_of(k).unwrap_or(u32::MAX), k)).collect();
        self.record(removed, Medium::Storage, pages);
    }

    /// Records an event of pages, each with the slot it has or had (`u32::MAX`: none), naming those stored by
    /// engine key by the engine's bytes.
    fn record(&mut self, removed: bool, medium: Medium, pages: Vec<(u32, Key)>) {
        if !self.events.enabled() || pages.is_empty() {
            return;
        }
        let names = if self.names.is_empty() {
            Vec::new()
        } else {
            pages.iter().map(|&(s, k)| self.names.name(s, k).as_bytes().to_vec()).collect()
        };
        self.events.record(removed, medium, pages.into_iter().map(|(_, k)| k).collect(), names);
    }

    /// Counts an error the caller handled (a failed copy launch, a callback that raised).
    pub fn count_error(&mut self) {
        self.stats.errors += 1;
    }

    /// Every invariant of both pools, plus: references held by tickets account for every reference.
    pub fn check(&self) -> Result<()> {
        self.pages.check()?;
        self.states.check()?;
        let pages_of = |t: &Ticket| t.pages.clone();
        let states_of = |t: &Ticket| t.states.clone();
        for (pool, name, held) in
            [(&self.pages, "page", &pages_of as &dyn Fn(&Ticket) -> _), (&self.states, "state", &states_of)]
        {
            let mut expected: HashMap<u32, u32> = HashMap::new();
            for (s, _) in self.tickets.values().flat_map(held) {
                *expected.entry(s).or_default() += 1;
            }
            for slot in pool.slots_handed_out() {
                let have = pool.entry(slot).map_or(0, |e| e.refs);
                let want = expected.remove(&slot).unwrap_or(0);
                if have != want {
                    return Err(Error::Invariant(format!("{name} slot {slot} has {have} refs, tickets hold {want}")));
                }
            }
            if let Some((slot, want)) = expected.into_iter().next() {
                return Err(Error::Invariant(format!("{name} slot {slot} was never used, tickets hold {want}")));
            }
        }
        self.check_key_stores()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pages: u32, states: u32, block_size: usize) -> Config {
        Config { min_hit_tokens: 0, ring_slack: 100, ..Config::new(pages, states, block_size) }
    }

    fn index(pages: u32, states: u32) -> Index {
        Index::new(config(pages, states, 4), pages, states).unwrap()
    }

    fn with(cfg: Config) -> Index {
        let (p, s) = (cfg.page_slots, cfg.state_slots);
        Index::new(cfg, p, s).unwrap()
    }

    fn ids(range: std::ops::Range<i32>) -> Vec<i32> {
        range.collect()
    }

    fn stored(ix: &mut Index, rid: &str, t: &[i32]) -> StorePlan {
        let p = ix.plan_store(rid, b"", t, t.len()).unwrap();
        ix.complete(p.ticket).unwrap();
        ix.check().unwrap();
        p
    }

    /// Bug 1: a store of 8 tokens with min_hit 8 (bs 4) planned states at [8, 4].
    #[test]
    fn no_state_below_min_hit_tokens() {
        let mut ix = with(Config { min_hit_tokens: 8, ..config(8, 4, 4) });
        assert_eq!(stored(&mut ix, "a", &ids(0..8)).state_boundaries, vec![8]);
    }

    /// Bug 2: with lookback 1 a 24-token store planned states [24, 20]; lookback 0 still stored one.
    #[test]
    fn lookback_k_means_k_boundaries() {
        for (k, want) in [(0, vec![]), (1, vec![24]), (2, vec![24, 20])] {
            let mut ix = with(Config { state_lookback_blocks: k, ..config(8, 4, 4) });
            assert_eq!(stored(&mut ix, "a", &ids(0..24)).state_boundaries, want, "lookback {k}");
        }
    }

    /// Bug 3: bs 16, 2 state slots, lookback 2: a store of 64 tokens, then the same 64 + 16. Both end with states
    /// {80, 64}; the second store must keep 64 (present) and evict 48, storing 3 states in all, not 4.
    #[test]
    fn a_store_never_evicts_its_own_present_state() {
        let mut ix = with(Config { state_lookback_blocks: 2, min_hit_tokens: 32, ..config(16, 2, 16) });
        let t = ids(0..80);
        assert_eq!(stored(&mut ix, "a", &t[..64]).state_boundaries, vec![64, 48]);
        let second = stored(&mut ix, "a", &t);
        assert_eq!(second.state_boundaries, vec![80]);
        assert_eq!(ix.stats().states_stored, 3);
        let keys = ix.keys("a").unwrap().to_vec();
        assert!(ix.states().ready_slot(keys[4]).is_some() && ix.states().ready_slot(keys[3]).is_some());
    }

    /// Behaviour 4: a 5-token prompt (bs 4, min_hit 8) stored page 0; below min_hit nothing is stored.
    #[test]
    fn a_prompt_below_min_hit_stores_nothing() {
        let mut ix = with(Config { min_hit_tokens: 8, ..config(8, 0, 4) });
        let p = stored(&mut ix, "a", &ids(0..5));
        assert!(p.page_indices.is_empty() && p.state_boundaries.is_empty());
        assert_eq!((ix.pages().used(), ix.stats().stores, ix.stats().store_skipped), (0, 0, 0));
    }

    /// Behaviour 5: a 40-token prompt that the pool cannot take flushed a 12-token prompt's pages for a run that
    /// ends at no state, turning the short prompt's next turn from a 12-token hit into a miss.
    #[test]
    fn a_partial_run_is_stored_only_up_to_a_stored_state() {
        let cfg = Config { state_lookback_blocks: 2, min_hit_tokens: 4, ..config(4, 2, 4) };
        let mut ix = with(cfg.clone());
        stored(&mut ix, "short", &ids(0..12));
        let long = stored(&mut ix, "long", &ids(100..140));
        assert!(long.page_indices.is_empty() && long.state_boundaries.is_empty(), "{long:?}");
        assert_eq!(ix.stats().store_skipped, 1);
        assert_eq!(ix.lookup("short", b"", &ids(0..16)).unwrap().hit_tokens, 12);

        // A partial run that does end at a stored state is kept up to that state: 5 free pages for 6 missing.
        let mut ix = with(Config { page_slots: 5, state_lookback_blocks: 6, ..cfg.clone() });
        let p = stored(&mut ix, "a", &ids(0..24));
        assert_eq!(p.page_indices, vec![0, 1, 2, 3, 4]);
        assert_eq!(p.state_boundaries, vec![20, 16]);

        // Without states the first pages that fit are stored.
        let mut ix = with(Config { page_slots: 5, state_slots: 0, ..cfg });
        assert_eq!(stored(&mut ix, "a", &ids(0..24)).page_indices, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_reused_request_id_is_an_error_until_forgotten() {
        let mut ix = index(8, 0);
        ix.lookup("a", b"", &ids(0..16)).unwrap();
        let err = ix.lookup("a", b"", &ids(50..70)).unwrap_err();
        assert!(matches!(err, Error::PromptMismatch { .. }), "{err}");
        assert!(
            err.to_string().contains("\"a\"") && err.to_string().contains("token 0 (in its block at tokens 0..4)"),
            "{err}"
        );
        assert_eq!(ix.lookup("a", b"", &ids(0..20)).unwrap().limit_pages, 4, "a grown prompt is fine");
        assert!(ix.forget("a"));
        assert_eq!(ix.lookup("a", b"", &ids(50..70)).unwrap().limit_pages, 4);
    }

    /// A request id reused for a prompt that differs only inside the hashed run (not in its first or last block):
    /// an answering lookup may not notice, but nothing is loaded or stored under the old keys.
    #[test]
    fn a_change_inside_the_hashed_run_is_never_served_or_stored() {
        let mut ix = index(16, 0);
        let p1 = ids(0..24);
        stored(&mut ix, "innocent", &p1);
        ix.lookup("r", b"", &p1).unwrap();
        let mut p2 = p1.clone();
        p2[9] += 100; // block 2 of 6
        assert_eq!(ix.lookup("r", b"", &p2).unwrap().hit_tokens, 20, "only answers");
        let err = ix.verify("r", b"", &p2).unwrap_err();
        assert!(err.to_string().contains("token 9 (in its block at tokens 8..12)"), "{err}");
        let used = ix.pages().used();
        assert!(matches!(ix.plan_store("r", b"", &p2, 24), Err(Error::PromptMismatch { .. })));
        assert_eq!((ix.pages().used(), ix.in_flight(), ix.stats().prompt_mismatches), (used, 0, 2));
        ix.verify("r", b"", &p1).unwrap();
        assert_eq!(ix.lookup("r", b"", &p1).unwrap().hit_tokens, 20, "the request is as it was");
        ix.check().unwrap();
    }

    /// Weights updated in place: nothing of the old version is served again, and copies in flight for it make
    /// nothing ready.
    #[test]
    fn a_new_model_version_retires_everything_of_the_old_one() {
        let mut ix = index(16, 2);
        let t = ids(0..17);
        stored(&mut ix, "done", &t);
        ix.lookup("loading", b"", &t).unwrap();
        let load = ix.begin_load("loading", 16).unwrap();
        let store = ix.plan_store("storing", b"", &ids(100..117), 17).unwrap();
        assert!(!store.page_slots.is_empty());
        ix.lookup("seen", b"", &ids(200..217)).unwrap();
        assert!(ix.set_model_version(b"v2"));
        assert!(!ix.set_model_version(b"v2"), "the same version changes nothing");
        assert_eq!(ix.pages().evictable(), 0, "evictable entries are dropped at once");
        ix.complete(load.ticket).unwrap();
        ix.complete(store.ticket).unwrap();
        ix.check().unwrap();
        assert_eq!((ix.pages().used(), ix.states().used()), (0, 0), "entries in use are dropped when released");
        assert_eq!(ix.lookup("fresh", b"", &t).unwrap().hit_tokens, 0);
        // A request seen before the change serves and stores nothing: its prefill may have run on the old weights.
        assert_eq!(ix.lookup("seen", b"", &ids(200..217)).unwrap(), Lookup::default());
        let p = ix.plan_store("seen", b"", &ids(200..217), 17).unwrap();
        assert!(p.page_slots.is_empty() && p.state_slots.is_empty());
        ix.complete(p.ticket).unwrap();
        // Requests of the new version store and hit as before, under other keys.
        let old_keys = ix.keys("done").unwrap().to_vec();
        stored(&mut ix, "new", &t);
        assert_ne!(ix.keys("new").unwrap(), &old_keys[..]);
        assert_eq!(ix.lookup("again", b"", &t).unwrap().hit_tokens, 16);
        let s = ix.stats();
        assert_eq!((s.model_versions, s.stale_version_calls), (1, 2));
        assert_eq!(ix.pages().retired(), 4, "the 4 ready pages, dropped when the load holding them finished");
        ix.check().unwrap();
    }

    #[test]
    fn every_index_statistic_is_in_the_table() {
        let names: Vec<&str> = crate::index::stats::TABLE.iter().map(|s| s.name).collect();
        for (name, _) in index(4, 1).stat_values() {
            assert!(names.contains(&name), "{name} is not in rust/index/stats.rs TABLE");
        }
    }

    #[test]
    fn huge_pools_cost_nothing_until_used() {
        let mut ix = with(config(2_000_000_000, 2_000_000_000, 4));
        stored(&mut ix, "a", &ids(0..16));
        assert_eq!(ix.pages().used(), 4);
    }

    #[test]
    fn hold_acquires_only_ready_entries_until_complete() {
        let mut ix = index(8, 2);
        let t: Vec<i32> = (0..16).collect();
        let plan = ix.plan_store("a", b"", &t, 16).unwrap();
        assert_eq!(plan.state_boundaries, vec![16, 12]);
        let keys = ix.keys("a").unwrap().to_vec();
        let early = ix.hold(&keys, &[]).unwrap();
        assert!(early.page_slots.iter().all(Option::is_none), "not ready yet");
        ix.complete(plan.ticket).unwrap();
        let h = ix.hold(&keys[..2], &[keys[3]]).unwrap();
        assert!(h.page_slots.iter().all(Option::is_some) && h.state_slots[0].is_some());
        assert_eq!(ix.pages().evictable(), 2);
        ix.check().unwrap();
        ix.complete(h.ticket).unwrap();
        ix.complete(early.ticket).unwrap();
        assert_eq!(ix.pages().evictable(), 4);
        ix.check().unwrap();
    }

    #[test]
    fn peek_answers_as_lookup_and_keeps_nothing() {
        let mut ix = index(8, 2);
        let t: Vec<i32> = (0..17).collect();
        let plan = ix.plan_store("a", b"", &t, 17).unwrap();
        ix.complete(plan.ticket).unwrap();
        let (requests, lookups) = (ix.requests(), ix.stats().lookups);
        let peeked = ix.peek(b"", &t).unwrap();
        assert_eq!((ix.requests(), ix.stats().lookups), (requests, lookups), "peek keeps nothing");
        assert_eq!(peeked, ix.lookup("b", b"", &t).unwrap());
        assert_eq!(peeked.hit_tokens, 16);
        assert!(ix.peek(b"", &[1, -1][..]).is_err());
    }

    #[test]
    fn fetch_reserves_all_or_nothing_and_aborts_cleanly() {
        let mut ix = index(4, 1);
        let f = ix.plan_fetch(&[1, 2, 2, 3], &[3]).unwrap().unwrap();
        assert_eq!(f.page_slots[1], f.page_slots[2], "a duplicate key gets the same slot");
        assert_eq!(ix.pages().used(), 3, "duplicates reserved once");
        assert!(ix.lookup("x", b"", &[0; 8][..]).unwrap().hit_tokens == 0);
        assert!(ix.plan_fetch(&[7, 8], &[]).unwrap().is_none(), "one free slot for two pages");
        ix.abort(f.ticket).unwrap();
        assert_eq!(ix.pages().used(), 0);
        let f = ix.plan_fetch(&[5], &[5]).unwrap().unwrap();
        ix.complete(f.ticket).unwrap();
        assert!(ix.pages().ready_slot(5).is_some() && ix.states().ready_slot(5).is_some());
        assert_eq!(ix.stats().pages_stored, 0, "fetches are counted by the L3 tier");
        ix.check().unwrap();
    }
}

/// Random operation sequences over the whole index: no panic, every invariant after every step. The case count
/// scales with `PROPTEST_CASES` (CI runs more).
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Lookup {
            rid: u8,
            prompt: (u8, u8),
            load: bool,
        },
        Store {
            rid: u8,
            prompt: (u8, u8),
            extra: u8,
        },
        Finish {
            pick: u8,
            ok: bool,
        },
        Hold {
            prompt: (u8, u8),
        },
        Fetch {
            keys: Vec<u8>,
        },
        Forget {
            rid: u8,
        },
        Grow {
            pages: u8,
        },
        /// A request id used for an unrelated prompt without forget(): an error, or (when the prompt happens to
        /// extend the chain's first and last blocks) accepted.
        Reuse {
            rid: u8,
            prompt: (u8, u8),
        },
        /// The model's weights were updated in place.
        Version {
            v: u8,
        },
        /// Engine keys (from a small alphabet): a lookup, a load of the hit and a store.
        Keys {
            keys: Vec<u8>,
            load: bool,
        },
        /// Engine keys' copies reported done or failed; the stores due are settled.
        Report {
            keys: Vec<u8>,
            ok: bool,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let prompt = (0u8..3, 0u8..60);
        prop_oneof![
            (0u8..6, prompt.clone(), any::<bool>()).prop_map(|(rid, prompt, load)| Op::Lookup { rid, prompt, load }),
            (0u8..6, prompt.clone(), 0u8..12).prop_map(|(rid, prompt, extra)| Op::Store { rid, prompt, extra }),
            (any::<u8>(), any::<bool>()).prop_map(|(pick, ok)| Op::Finish { pick, ok }),
            prompt.clone().prop_map(|prompt| Op::Hold { prompt }),
            prop::collection::vec(any::<u8>(), 0..6).prop_map(|keys| Op::Fetch { keys }),
            (0u8..6).prop_map(|rid| Op::Forget { rid }),
            (0u8..32).prop_map(|pages| Op::Grow { pages }),
            (0u8..6, prompt.clone()).prop_map(|(rid, prompt)| Op::Reuse { rid, prompt }),
            (0u8..3).prop_map(|v| Op::Version { v }),
            (prop::collection::vec(0u8..12, 0..8), any::<bool>()).prop_map(|(keys, load)| Op::Keys { keys, load }),
            (prop::collection::vec(0u8..12, 0..8), any::<bool>()).prop_map(|(keys, ok)| Op::Report { keys, ok }),
        ]
    }

    fn tokens(base: u8, len: u8) -> Vec<i32> {
        (0..i32::from(len))
            .map(|i| (i * 31 + i32::from(base) * 7) % 97 + i32::from(base) * 1000 * i32::from(i > 20))
            .collect()
    }

    /// The engine contract: a request's prompt only grows until it is forgotten.
    fn grown(prompts: &mut HashMap<String, Vec<i32>>, rid: &str, (base, len): (u8, u8)) -> Vec<i32> {
        let t = match prompts.get(rid) {
            Some(old) => old.iter().copied().chain(tokens(base, len % 9)).collect(),
            None => tokens(base, len),
        };
        prompts.insert(rid.to_owned(), t.clone());
        t
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn any_operation_sequence_keeps_the_index_consistent(
            ops in prop::collection::vec(op(), 1..120),
            pages in 1u32..24,
            states in 0u32..6,
            keep in 1usize..6,
            slack in 0usize..24,
            kind in prop_oneof![Just(HashKind::Blake3), Just(HashKind::Xxh3)],
            policy in prop_oneof![Just(Policy::Lru), Just(Policy::Adaptive)],
        ) {
            let cfg = Config {
                page_slots: pages, state_slots: states, block_size: 4, keep_tokens: keep, min_hit_tokens: 4,
                state_lookback_blocks: 3, ring_slack: slack, hash_kind: kind, hash_key: b"k".to_vec(),
                eviction_policy: policy, event_buffer: 1 << 16,
            };
            let mut ix = Index::new(cfg, pages / 2, states).unwrap();
            let mut tickets: Vec<u64> = Vec::new();
            let mut prompts = HashMap::new();
            // The host pages as the events tell them, and the next sequence number expected.
            let mut resident = std::collections::HashSet::new();
            let mut seq = 0;
            for op in ops {
                match op {
                    Op::Lookup { rid, prompt, load } => {
                        let rid = format!("r{rid}");
                        let t = grown(&mut prompts, &rid, prompt);
                        let l = ix.lookup(&rid, b"", &t).unwrap();
                        prop_assert!(l.hit_tokens <= l.limit_pages * 4 && l.hit_tokens.is_multiple_of(4));
                        if l.hit_tokens > 0 {
                            if load {
                                ix.verify(&rid, b"", &t).unwrap();
                                let p = ix.begin_load(&rid, l.hit_tokens).unwrap();
                                prop_assert_eq!(p.page_slots.len(), l.hit_tokens / 4);
                                tickets.push(p.ticket);
                            } else {
                                ix.defer(&rid).unwrap();
                            }
                        }
                    }
                    Op::Store { rid, prompt, extra } => {
                        let rid = format!("r{rid}");
                        let t = grown(&mut prompts, &rid, prompt);
                        let p = ix.plan_store(&rid, b"", &t, t.len() + usize::from(extra)).unwrap();
                        tickets.push(p.ticket);
                    }
                    Op::Finish { pick, ok } if !tickets.is_empty() => {
                        let t = tickets.swap_remove(usize::from(pick) % tickets.len());
                        if ok { ix.complete(t).map(drop).unwrap() } else { ix.abort(t).unwrap() }
                        prop_assert!(ix.complete(t).is_err(), "a ticket finishes once");
                    }
                    Op::Hold { prompt } => {
                        let mut c = Chain::default();
                        c.extend(ix.hasher(), 4, b"", 0, &tokens(prompt.0, prompt.1)).unwrap();
                        let keys = c.keys().to_vec();
                        tickets.push(ix.hold(&keys, &keys).unwrap().ticket);
                    }
                    Op::Fetch { keys } => {
                        let keys: Vec<Key> = keys.into_iter().map(|k| Key::from(k) << 64 | 1).collect();
                        if let Some(p) = ix.plan_fetch(&keys, &keys[..keys.len().min(1)]).unwrap() {
                            tickets.push(p.ticket);
                        }
                    }
                    Op::Forget { rid } => {
                        let rid = format!("r{rid}");
                        prop_assert_eq!(ix.forget(&rid), prompts.remove(&rid).is_some());
                    }
                    Op::Reuse { rid, prompt } => {
                        let rid = format!("r{rid}");
                        let t = tokens(prompt.0, prompt.1);
                        let before = ix.keys(&rid).map(<[Key]>::to_vec).ok();
                        // lookup checks the first and last blocks; verify (before a load) and store check all.
                        match ix.lookup(&rid, b"", &t) {
                            Ok(_) => {
                                if ix.verify(&rid, b"", &t).is_ok() {
                                    prompts.insert(rid, t);
                                } else {
                                    // Refused by the full check: the engine forgets the id.
                                    prop_assert!(ix.forget(&rid));
                                    prompts.remove(&rid);
                                }
                            }
                            Err(Error::PromptMismatch { .. }) => {
                                prop_assert_eq!(ix.keys(&rid).map(<[Key]>::to_vec).ok(), before, "a refused call changes nothing");
                            }
                            Err(e) => return Err(TestCaseError::fail(e.to_string())),
                        }
                    }
                    Op::Grow { pages } => ix.grow(u32::from(pages), states),
                    Op::Version { v } => {
                        if ix.set_model_version(&[v]) {
                            prop_assert_eq!(ix.pages().evictable() + ix.states().evictable(), 0);
                        }
                    }
                    Op::Keys { keys, load } => {
                        let mut keys: Vec<[u8; 2]> = keys.into_iter().map(|k| [k, 7]).collect();
                        let mut seen = std::collections::HashSet::new();
                        keys.retain(|k| seen.insert(*k));
                        let l = ix.lookup_keys(&keys).unwrap();
                        for (i, k) in keys.iter().enumerate() {
                            let one = ix.lookup_keys(&[k]).unwrap();
                            let state = if one.hits == 1 {
                                KeyState::Ready
                            } else if one.pending {
                                KeyState::Pending
                            } else {
                                KeyState::Absent
                            };
                            prop_assert_eq!(ix.lookup_key(k).unwrap(), state, "key {}", i);
                        }
                        if load && l.hits > 0 {
                            tickets.push(ix.load_keys(&keys[..l.hits.min(3)]).unwrap().ticket);
                        } else if let Some(p) = ix.store_keys(&keys).unwrap() {
                            prop_assert_eq!(p.indices.len(), p.slots.len());
                            tickets.push(p.ticket);
                        }
                    }
                    Op::Report { keys, ok } => {
                        let keys: Vec<[u8; 2]> = keys.into_iter().map(|k| [k, 7]).collect();
                        let done = ix.complete_keys(&keys, ok).unwrap();
                        prop_assert!(done.matched <= keys.len());
                        for (t, failed) in done.due {
                            prop_assert!(failed || ok);
                            let Some(i) = tickets.iter().position(|&x| x == t) else {
                                return Err(TestCaseError::fail(format!("store {t} due twice")));
                            };
                            tickets.swap_remove(i);
                            if failed { ix.abort(t).unwrap() } else { ix.complete(t).map(drop).unwrap() }
                        }
                    }
                    Op::Finish { .. } => {}
                }
                ix.check().map_err(|e| TestCaseError::fail(e.to_string()))?;
                for e in ix.take_events() {
                    prop_assert_eq!((e.seq, e.medium), (seq, Medium::Cpu));
                    seq += 1;
                    for k in e.keys {
                        prop_assert!(if e.removed { resident.remove(&k) } else { resident.insert(k) }, "event {} of {:x}", e.seq, k);
                    }
                }
                let ready: std::collections::HashSet<Key> = ix.pages().slots_handed_out()
                    .filter_map(|s| ix.pages().entry(s)).filter(|e| e.ready).map(|e| e.key).collect();
                prop_assert_eq!(&resident, &ready, "the events give the ready pages");
            }
            for t in tickets {
                ix.complete(t).unwrap();
            }
            ix.check().map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(ix.pages().evictable(), ix.pages().used());
        }
    }
}
