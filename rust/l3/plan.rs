//! L3 planning: which objects a put sends and a fetch gets, their key strings and host pieces, and the jobs
//! that run them through the one object path (rust/l3/path.rs) against a `Store`. The L3 tier's threads only call
//! `put` and `fetch` and count what they report.
//!
//! A put names the whole groups of `group_pages` pages of what a store made ready, and its states at group
//! ends, skips what the seen-set knows, and holds the host entries it reads. A fetch probes the groups beyond
//! the host's ready run, takes the longest run in the Store, snaps it to the deepest group end with a state (on
//! the host or in the Store; the lookup's rule) and reserves fresh slots; its objects are admitted only when
//! every header and digest checks. A plan keeps the fingerprint and format it was made under: a model-version
//! change while it runs makes it check its objects as what they are (the old version's), never reject them.
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::error::{invalid, Error, Result};
use crate::executor::hostmem::HostPool;
use crate::index::chain::Key;
use crate::index::{deepest_with_state, Index, Ready};
use crate::l3::path::{Buffer, Failure, GetOutcome, Object, ObjectPath, PutOutcome, Store};
use crate::l3::{group_key_string, state_key_string, ObjectFormat, ObjectKind, Reject, SeenSet, HEADER_BYTES};

/// Seen-set ids of state objects differ from those of groups named by the same chain key.
const STATE_ID: Key = 0x5354_4154_4500_0000_0000_0000_0000_0001;

/// Whether an L3 fetch of groups of `group_pages` could add whole groups between the host's ready run and the
/// lookup's cap (pages).
pub fn wants_fetch(group_pages: usize, ready_pages: usize, limit_pages: usize) -> bool {
    limit_pages / group_pages > ready_pages / group_pages
}

/// The host pools a planner's objects move from and into. The planner holds them, so their memory lives as long
/// as it does, and every slot a plan names is checked against the slots the pool has backed: no address the
/// planner hands the Store lies outside them. (A pool closed while a job runs is the owner's to prevent: the L3
/// tier is closed before the pools.)
#[derive(Clone)]
pub struct HostPools {
    pub pages: Arc<HostPool>,
    pub states: Option<Arc<HostPool>>,
}

impl HostPools {
    fn page_bytes(&self) -> usize {
        self.pages.slot_bytes() as usize
    }
    fn state_bytes(&self) -> usize {
        self.states.as_ref().map_or(0, |s| s.slot_bytes() as usize)
    }

    /// Every slot given is one its pool has backed.
    fn check(&self, page_slots: &[Option<u32>], state_slots: &[Option<u32>]) -> Result<()> {
        let pools = [(Some(&self.pages), page_slots, "page"), (self.states.as_ref(), state_slots, "state")];
        for (pool, slots, what) in pools {
            let usable = pool.map_or(0, |p| p.usable_slots());
            if let Some(s) = slots.iter().flatten().find(|&&s| s >= usable) {
                return Err(Error::Invariant(format!(
                    "{what} slot {s} is not below the host pool's {usable} usable slots"
                )));
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for HostPools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostPools(pages: {} x {} bytes, states: {} x {} bytes)",
            self.pages.slots(),
            self.page_bytes(),
            self.states.as_ref().map_or(0, |s| s.slots()),
            self.state_bytes()
        )
    }
}

fn seen_id(o: &Object) -> Key {
    match o.kind {
        ObjectKind::Group => o.chain_key,
        ObjectKind::State => o.chain_key ^ STATE_ID,
    }
}

/// The fingerprint a plan's objects are named under and the format that seals and checks them.
#[derive(Clone, Debug)]
struct Named {
    fingerprint: Arc<str>,
    format: Arc<ObjectFormat>,
}

/// A put: objects to send, and the hold ticket that keeps their host entries until the put returned.
#[derive(Clone, Debug)]
pub struct PutPlan {
    pub ticket: u64,
    pub objects: Vec<Object>,
    named: Named,
}

/// What a fetch asks the Store first: the group keys g0..g1 and the end states the host lacks.
#[derive(Clone, Debug)]
pub struct Probe {
    keys: Vec<Key>,
    g0: usize,
    state_on_host: Vec<bool>,
    /// Indices (into the candidate groups) of the end states asked for, after the group keys.
    asked: Vec<usize>,
    pub exists_keys: Vec<String>,
    named: Named,
}

/// A fetch: objects to get into fresh slots (and the scratch buffer), under a fetch ticket.
#[derive(Clone, Debug)]
pub struct FetchPlan {
    pub ticket: u64,
    pub objects: Vec<Object>,
    /// New host pages and states the ticket fills.
    pub pages: usize,
    pub states: usize,
    named: Named,
}

/// The L3 planner of one cache; see the module docs.
#[derive(Debug)]
pub struct Planner {
    named: Named,
    hash_key: Vec<u8>,
    group_pages: usize,
    host: HostPools,
    seen: SeenSet,
    seen_keys: usize,
    scratch: Buffer,
    scratch_pages: usize,
}

impl Planner {
    /// `scratch_pages` bounds the pages a fetch reads that the host holds already (a plan is cut before a group
    /// that needs more); None: two groups.
    pub fn new(
        fingerprint: &str,
        hash_key: &[u8],
        group_pages: usize,
        host: HostPools,
        seen_keys: usize,
        scratch_pages: Option<usize>,
    ) -> Result<Self> {
        if group_pages == 0 {
            return Err(invalid(format!("need group_pages >= 1, got {group_pages}")));
        }
        let scratch_pages = scratch_pages.unwrap_or(2 * group_pages);
        let scratch = Buffer::new(scratch_pages * host.page_bytes());
        Ok(Self {
            named: Named {
                fingerprint: fingerprint.into(),
                format: Arc::new(ObjectFormat::new(fingerprint, hash_key)),
            },
            hash_key: hash_key.to_vec(),
            group_pages,
            host,
            seen: SeenSet::new(seen_keys)?,
            seen_keys,
            scratch,
            scratch_pages,
        })
    }

    /// A new fingerprint (the model version changed): later plans name objects under it and check against it,
    /// and nothing is remembered as seen any more. Plans made before keep theirs.
    pub fn set_fingerprint(&mut self, fingerprint: &str) -> Result<()> {
        self.named =
            Named { fingerprint: fingerprint.into(), format: Arc::new(ObjectFormat::new(fingerprint, &self.hash_key)) };
        self.seen = SeenSet::new(self.seen_keys)?;
        Ok(())
    }

    pub fn fingerprint(&self) -> &str {
        &self.named.fingerprint
    }
    pub fn group_pages(&self) -> usize {
        self.group_pages
    }
    /// `(address, bytes)` of the scratch pages a fetch reads pages the host holds into: zero-copy the Store must
    /// have it registered.
    pub fn scratch(&self) -> (usize, usize) {
        (self.scratch.addr(), self.scratch.bytes())
    }

    pub fn group_key(&self, last_page_key: Key) -> String {
        group_key_string(&self.named.fingerprint, self.group_pages as u32, last_page_key)
    }
    pub fn state_key(&self, page_key: Key) -> String {
        state_key_string(&self.named.fingerprint, page_key)
    }

    /// The object path of this planner's jobs: staged through two buffers of `staging` bytes each, which must
    /// hold the largest object (a group or a state, and its header), or zero-copy (None).
    pub fn object_path(&self, staging: Option<usize>) -> Result<ObjectPath> {
        let (g, page_bytes) = (self.group_pages, self.host.page_bytes());
        let largest = HEADER_BYTES + (g * page_bytes).max(self.host.state_bytes());
        if let Some(bytes) = staging.filter(|&b| b < largest) {
            return Err(invalid(format!(
                "l3_staging_bytes must hold the largest L3 object ({largest} bytes: {g} pages of {page_bytes} bytes \
                 and a header), got {bytes}"
            )));
        }
        ObjectPath::new(staging)
    }

    /// `(address, bytes)` of the memory the Store must have registered for this planner's jobs on `path`: the
    /// staging buffers, or zero-copy the host pools, the header slots and the scratch pages.
    pub fn registered(&self, path: &ObjectPath) -> Vec<(usize, usize)> {
        if !path.zero_copy() {
            return path.buffers();
        }
        let pools = std::iter::once(&self.host.pages).chain(self.host.states.as_ref());
        let mut out: Vec<(usize, usize)> =
            pools.map(|p| (p.base_ptr() as usize, p.slots() as usize * p.slot_bytes() as usize)).collect();
        out.extend(path.buffers());
        out.push(self.scratch());
        out
    }

    // Addresses of slots checked by `HostPools::check` (below the pool's backed slots).
    fn page_ptr(&self, slot: u32) -> usize {
        self.host.pages.base_ptr() as usize + slot as usize * self.host.page_bytes()
    }
    fn state_ptr(&self, slot: u32) -> usize {
        let states = self.host.states.as_ref().expect("checked: a state slot has a state pool");
        states.base_ptr() as usize + slot as usize * self.host.state_bytes()
    }

    /// Plans the put of what a store made ready: new whole groups and group-end states, held on the host.
    /// None when there is nothing new to put.
    pub fn plan_put(&mut self, ix: &mut Index, ready: &Ready) -> Result<Option<PutPlan>> {
        let g = self.group_pages;
        let keys = &ready.page_keys;
        let groups: Vec<usize> = (0..keys.len() / g).filter(|&j| self.seen.insert(keys[(j + 1) * g - 1])).collect();
        let has_states = ix.config().state_slots > 0 && self.host.state_bytes() > 0;
        let states: Vec<usize> = ready
            .state_pages
            .iter()
            .copied()
            .filter(|&p| has_states && p > 0 && p <= keys.len() && p % g == 0)
            .filter(|&p| self.seen.insert(keys[p - 1] ^ STATE_ID))
            .collect();
        if groups.is_empty() && states.is_empty() {
            return Ok(None);
        }
        let page_keys: Vec<Key> = groups.iter().flat_map(|&j| keys[j * g..(j + 1) * g].iter().copied()).collect();
        let state_keys: Vec<Key> = states.iter().map(|&p| keys[p - 1]).collect();
        let held = ix.hold(&page_keys, &state_keys)?;
        if let Err(e) = self.host.check(&held.page_slots, &held.state_slots) {
            ix.complete(held.ticket)?;
            return Err(e);
        }
        let mut objects = Vec::new();
        for (j, slots) in groups.iter().zip(held.page_slots.chunks(g)) {
            let chain_key = keys[(j + 1) * g - 1];
            match slots.iter().copied().collect::<Option<Vec<u32>>>() {
                Some(slots) => objects.push(Object {
                    key: self.group_key(chain_key),
                    chain_key,
                    kind: ObjectKind::Group,
                    pieces: slots.iter().map(|&s| (self.page_ptr(s), self.host.page_bytes())).collect(),
                    pages: keys[j * g..(j + 1) * g].to_vec(),
                }),
                None => {
                    self.seen.remove(chain_key); // a page left the host: a later store may put the group
                }
            }
        }
        for (&k, slot) in state_keys.iter().zip(&held.state_slots) {
            match slot {
                Some(s) => objects.push(Object {
                    key: self.state_key(k),
                    chain_key: k,
                    kind: ObjectKind::State,
                    pieces: vec![(self.state_ptr(*s), self.host.state_bytes())],
                    pages: Vec::new(),
                }),
                None => {
                    self.seen.remove(k ^ STATE_ID);
                }
            }
        }
        Ok(Some(PutPlan { ticket: held.ticket, objects, named: self.named.clone() }))
    }

    /// Forget that these objects were sent or seen (not stored, present but unchecked, or failed a get: a later
    /// store may put them again).
    pub fn unsee<'a>(&mut self, objects: impl IntoIterator<Item = &'a Object>) {
        for o in objects {
            self.seen.remove(seen_id(o));
        }
    }

    /// The first step of a fetch: the keys to ask the Store about, beyond the ready run and within the cap of the
    /// request's last lookup. None when there is nothing to ask (the request is unknown, e.g. forgotten
    /// meanwhile, or no whole group lies beyond the host's ready run).
    pub fn probe(&self, ix: &Index, request_id: &str) -> Option<Probe> {
        let g = self.group_pages;
        let chain = ix.keys(request_id).ok()?;
        let look = ix.last_lookup(request_id)?;
        let (ready_pages, limit_pages) = (look.ready_pages, look.limit_pages);
        let (g0, g1) = (ready_pages / g, limit_pages.min(chain.len()) / g);
        if g1 <= g0 {
            return None;
        }
        let keys = chain[..g1 * g].to_vec();
        let has_states = ix.config().state_slots > 0;
        let ends: Vec<Key> = (g0..g1).map(|j| keys[(j + 1) * g - 1]).collect();
        let state_on_host: Vec<bool> =
            ends.iter().map(|&k| has_states && ix.states().ready_slot(k).is_some()).collect();
        let asked: Vec<usize> = (0..ends.len()).filter(|&i| has_states && !state_on_host[i]).collect();
        let mut exists_keys: Vec<String> = ends.iter().map(|&k| self.group_key(k)).collect();
        exists_keys.extend(asked.iter().map(|&i| self.state_key(ends[i])));
        Some(Probe { keys, g0, state_on_host, asked, exists_keys, named: self.named.clone() })
    }

    /// The second step: from the Store's exists() answers, the run to get, named under the probe's fingerprint;
    /// reserves its slots. None for a miss (nothing usable in the Store, or the host pools cannot make room now).
    pub fn plan_fetch(&mut self, ix: &mut Index, probe: &Probe, codes: &[i64]) -> Result<Option<FetchPlan>> {
        let g = self.group_pages;
        let n_groups = probe.state_on_host.len();
        if codes.len() != probe.exists_keys.len() {
            return Err(invalid(format!("need {} exists codes, got {}", probe.exists_keys.len(), codes.len())));
        }
        let end = |i: usize| probe.keys[(probe.g0 + i + 1) * g - 1];
        // A group this tier put that the Store says it no longer has (evicted, or removed by another reader) is
        // gone: a "STORAGE" removed event, and a later store may put it again. (A put still in flight reads as
        // gone too; its "stored" event follows when it lands.)
        let mut gone = Vec::new();
        for (i, _) in codes[..n_groups].iter().enumerate().filter(|(_, &c)| c == 0) {
            if self.seen.remove(end(i)) {
                let first = (probe.g0 + i) * g;
                gone.extend_from_slice(&probe.keys[first..first + g]);
            }
        }
        ix.record_storage(true, gone);
        let mut run = codes[..n_groups].iter().take_while(|&&c| c == 1).count();
        // Groups the host partly holds are read whole (the digest covers every page) into the scratch buffer;
        // cut the run where scratch runs out.
        let mut scratch_used = 0;
        for i in 0..run {
            let first = (probe.g0 + i) * g;
            let present = probe.keys[first..first + g].iter().filter(|&&k| ix.pages().slot_of(k).is_some()).count();
            let need = if present == g { 0 } else { present };
            if scratch_used + need > self.scratch_pages {
                run = i;
                break;
            }
            scratch_used += need;
        }
        let mut state_in_store = vec![false; n_groups];
        for (&i, &c) in probe.asked.iter().zip(&codes[n_groups..]) {
            state_in_store[i] = c == 1;
        }
        let has_states = ix.config().state_slots > 0;
        let mut n = run;
        let mut state_at = None;
        if has_states {
            n = deepest_with_state(run, |p| probe.state_on_host[p - 1] || state_in_store[p - 1]);
            state_at = (n > 0 && !probe.state_on_host[n - 1]).then(|| end(n - 1));
        }
        let cfg = ix.config();
        if n == 0 || (probe.g0 + n) * g * cfg.block_size < cfg.min_hit_tokens.max(1) {
            return Ok(None);
        }
        let page_keys = &probe.keys[probe.g0 * g..(probe.g0 + n) * g];
        let state_keys: Vec<Key> = state_at.into_iter().collect();
        let Some(slots) = ix.plan_fetch(page_keys, &state_keys)? else { return Ok(None) };
        if let Err(e) = self.host.check(&slots.page_slots, &slots.state_slots) {
            ix.abort(slots.ticket)?;
            return Err(e);
        }
        let fp = &probe.named.fingerprint;
        let mut objects = Vec::new();
        let mut scratch_next = 0;
        for (i, group) in slots.page_slots.chunks(g).enumerate() {
            if group.iter().all(Option::is_none) {
                continue; // the host holds this whole group already
            }
            let mut pieces = Vec::with_capacity(g);
            for s in group {
                let at = match s {
                    Some(s) => self.page_ptr(*s),
                    None => {
                        scratch_next += 1;
                        self.scratch.addr() + (scratch_next - 1) * self.host.page_bytes()
                    }
                };
                pieces.push((at, self.host.page_bytes()));
            }
            let first = (probe.g0 + i) * g;
            objects.push(Object {
                key: group_key_string(fp, g as u32, end(i)),
                chain_key: end(i),
                kind: ObjectKind::Group,
                pieces,
                pages: probe.keys[first..first + g].to_vec(),
            });
        }
        if let (Some(k), Some(Some(s))) = (state_at, slots.state_slots.first()) {
            objects.push(Object {
                key: state_key_string(fp, k),
                chain_key: k,
                kind: ObjectKind::State,
                pieces: vec![(self.state_ptr(*s), self.host.state_bytes())],
                pages: Vec::new(),
            });
        }
        for o in &objects {
            self.seen.insert(seen_id(o)); // unseen again unless the object checks
        }
        Ok(Some(FetchPlan {
            ticket: slots.ticket,
            objects,
            pages: slots.page_slots.iter().flatten().count(),
            states: slots.state_slots.iter().flatten().count(),
            named: probe.named.clone(),
        }))
    }
}

/// The planner and the index it plans for, each behind its own lock (never both held across a Store call).
pub struct Tier<'a> {
    pub planner: &'a Mutex<Planner>,
    pub index: &'a Mutex<Index>,
    pub path: &'a ObjectPath,
}

/// What a write-behind put did: objects planned, those the Store had, and those not stored (key, code).
#[derive(Clone, Debug, Default)]
pub struct PutReport {
    pub objects: usize,
    pub present: usize,
    pub failed: Vec<(String, i64)>,
}

/// How a fetch ended.
#[derive(Clone, Debug)]
pub enum Fetched {
    /// Nothing to fetch: nothing usable in the Store, no room on the host, or nothing to ask.
    Miss,
    /// The exists() call failed.
    Failed(Failure),
    /// Every object checked: the slots are ready.
    Admitted { pages: usize, states: usize, bytes: usize },
    /// Some object was not read (`lost`: the code), missing, or wrong (`rejected`: why, and whether it was
    /// removed): none of the fetch is served.
    Refused { missing: Vec<String>, lost: Vec<(String, i64)>, rejected: Vec<(String, Reject, bool)> },
}

/// What a fetch reports: how it ended and the seconds its exists() and get calls took.
#[derive(Clone, Debug)]
pub struct FetchReport {
    pub fetched: Fetched,
    pub exists_s: f64,
    pub get_s: f64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Tier<'_> {
    /// The write-behind of what a store made ready: plans, puts through the object path, records the groups
    /// stored as "STORAGE" events, forgets what was not stored (or was present, unchecked), releases the hold.
    /// None when there was nothing new to put.
    pub fn put(&self, store: &dyn Store, ready: &Ready) -> Result<Option<PutReport>> {
        let plan = {
            let mut planner = lock(self.planner);
            match planner.plan_put(&mut lock(self.index), ready)? {
                Some(plan) => plan,
                None => return Ok(None),
            }
        };
        let outcomes = self.path.put(store, &plan.named.format, &plan.objects);
        let failed_call = outcomes.as_ref().err().cloned();
        let outcomes = outcomes.unwrap_or_else(|_| vec![PutOutcome::Failed(0); plan.objects.len()]);
        let (stored, not): (Vec<_>, Vec<_>) =
            plan.objects.iter().zip(&outcomes).partition(|(_, o)| **o == PutOutcome::Stored);
        lock(self.planner).unsee(not.iter().map(|(o, _)| *o));
        let mut ix = lock(self.index);
        ix.record_storage(false, stored.iter().flat_map(|(o, _)| o.pages.iter().copied()).collect());
        ix.complete(plan.ticket)?;
        drop(ix);
        if let Some(e) = failed_call {
            return Err(e);
        }
        let present = not.iter().filter(|(_, o)| **o == PutOutcome::Present).count();
        let failed = not
            .iter()
            .filter_map(|(o, out)| match out {
                PutOutcome::Failed(code) => Some((o.key.clone(), *code)),
                _ => None,
            })
            .collect();
        Ok(Some(PutReport { objects: plan.objects.len(), present, failed }))
    }

    /// The request's fetch: probes from its last lookup, asks the Store which objects exist, plans and reserves,
    /// gets and checks through the object path; the slots become ready only when every object checked, else they
    /// are freed, what was not loaded is forgotten, and what is known gone becomes "STORAGE" removed events.
    pub fn fetch(&self, store: &dyn Store, request_id: &str) -> Result<FetchReport> {
        let report = |fetched, exists_s, get_s| Ok(FetchReport { fetched, exists_s, get_s });
        let Some(probe) = lock(self.planner).probe(&lock(self.index), request_id) else {
            return report(Fetched::Miss, 0.0, 0.0);
        };
        let t0 = Instant::now();
        let codes = store.exists(&probe.exists_keys);
        let exists_s = t0.elapsed().as_secs_f64();
        let codes = match codes {
            Ok(c) => c,
            Err(f) => return report(Fetched::Failed(f), exists_s, 0.0),
        };
        let plan = {
            let mut planner = lock(self.planner);
            match planner.plan_fetch(&mut lock(self.index), &probe, &codes)? {
                Some(plan) => plan,
                None => return report(Fetched::Miss, exists_s, 0.0),
            }
        };
        let t1 = Instant::now();
        let outcomes = self.path.get(store, &plan.named.format, &plan.objects);
        let get_s = t1.elapsed().as_secs_f64();
        let outcomes = match outcomes {
            Ok(out) => out,
            Err(e) => {
                lock(self.planner).unsee(&plan.objects);
                lock(self.index).abort(plan.ticket)?;
                return Err(e);
            }
        };
        if outcomes.iter().all(|o| *o == GetOutcome::Loaded) {
            lock(self.index).complete(plan.ticket)?;
            let bytes = plan.objects.iter().map(Object::bytes).sum();
            return report(Fetched::Admitted { pages: plan.pages, states: plan.states, bytes }, exists_s, get_s);
        }
        let (mut missing, mut lost, mut rejected, mut gone) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (o, out) in plan.objects.iter().zip(&outcomes) {
            match out {
                GetOutcome::Loaded => {}
                GetOutcome::Missing => {
                    missing.push(o.key.clone());
                    gone.extend(o.pages.iter().copied());
                }
                GetOutcome::Lost(code) => lost.push((o.key.clone(), *code)),
                GetOutcome::Rejected { why, removed } => {
                    rejected.push((o.key.clone(), why.clone(), *removed));
                    if *removed {
                        gone.extend(o.pages.iter().copied());
                    }
                }
            }
        }
        lock(self.planner)
            .unsee(plan.objects.iter().zip(&outcomes).filter(|(_, o)| **o != GetOutcome::Loaded).map(|(o, _)| o));
        let mut ix = lock(self.index);
        ix.record_storage(true, gone);
        ix.abort(plan.ticket)?;
        report(Fetched::Refused { missing, lost, rejected }, exists_s, get_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::hostmem::PinMethod;
    use crate::index::chain::HashKind;
    use crate::index::events::Medium;
    use crate::index::Config;
    use crate::l3::path::test_store::MapStore;
    use crate::l3::path::{Answer, WRONG_LENGTH};

    struct Cache {
        ix: Mutex<Index>,
        host: HostPools,
        planner: Mutex<Planner>,
        path: ObjectPath,
    }

    impl Cache {
        fn tier(&self) -> Tier<'_> {
            Tier { planner: &self.planner, index: &self.ix, path: &self.path }
        }
        fn ix(&self) -> MutexGuard<'_, Index> {
            lock(&self.ix)
        }
    }

    fn setup(g: usize, page_slots: u32, state_slots: u32, staging: Option<usize>) -> Cache {
        let cfg = Config {
            event_buffer: 1024,
            min_hit_tokens: 0,
            state_lookback_blocks: 8,
            ring_slack: 1000,
            hash_kind: HashKind::Xxh3,
            ..Config::new(page_slots, state_slots, 4)
        };
        let ix = Index::new(cfg, page_slots, state_slots).unwrap();
        let pool = |slots: u32, bytes: u64| {
            let p = HostPool::new(slots.max(1), bytes, 1 << 16, Some(false), PinMethod::Auto).unwrap();
            p.grow_to(slots).unwrap();
            Arc::new(p)
        };
        let host = HostPools { pages: pool(page_slots, 32), states: Some(pool(state_slots, 16)) };
        let planner = Planner::new("fp", b"", g, host.clone(), 1024, Some(4)).unwrap();
        Cache { ix: Mutex::new(ix), host, planner: Mutex::new(planner), path: ObjectPath::new(staging).unwrap() }
    }

    /// Stores a prompt's pages (page i filled with i + 1) and puts what became ready.
    fn store_and_put(c: &mut Cache, store: &MapStore, rid: &str, tokens: &[i32]) -> (Ready, Option<PutReport>) {
        let plan = c.ix().plan_store(rid, b"", tokens, tokens.len()).unwrap();
        for (i, &s) in plan.page_slots.iter().enumerate() {
            c.host.pages.write(s, &[i as u8 + 1; 32]).unwrap();
        }
        for &s in &plan.state_slots {
            c.host.states.as_ref().unwrap().write(s, &[0xee; 16]).unwrap();
        }
        let ready = c.ix().complete(plan.ticket).unwrap().unwrap();
        let put = c.tier().put(store, &ready).unwrap();
        (ready, put)
    }

    fn fetch(c: &Cache, store: &MapStore, rid: &str, tokens: &[i32]) -> Fetched {
        c.ix().lookup(rid, b"", tokens).unwrap();
        c.tier().fetch(store, rid).unwrap().fetched
    }

    /// Zero-copy and staged (a staging buffer of two objects, so that a plan takes several Store calls).
    #[test]
    fn put_then_fetch_round_trips_and_rejects_tampering() {
        for staging in [None, Some(2 * (crate::l3::HEADER_BYTES + 2 * 32))] {
            let store = MapStore::default();
            let mut a = setup(2, 16, 4, staging);
            let tokens: Vec<i32> = (0..33).collect();
            let (ready, put) = store_and_put(&mut a, &store, "a", &tokens);
            let put = put.unwrap();
            assert_eq!((put.objects, put.present, put.failed.len()), (4 + 2, 0, 0), "4 groups, states at 8 and 6");
            assert!(a.tier().put(&store, &ready).unwrap().is_none(), "seen");
            a.ix().check().unwrap();
            let ix = a.ix();
            assert_eq!(ix.pages().used(), ix.pages().evictable(), "no hold is left");
            drop(ix);

            let b = setup(2, 16, 4, staging);
            let Fetched::Admitted { pages, states, .. } = fetch(&b, &store, "b", &tokens) else { panic!() };
            assert_eq!((pages, states), (8, 1));
            assert_eq!(b.ix().lookup("b", b"", &tokens).unwrap().hit_tokens, 32);
            assert_eq!(b.host.pages.read(0).unwrap(), [1u8; 32], "page 0's bytes arrived");

            // One bit flipped, a short value: both rejected and removed, nothing admitted.
            let c = setup(2, 16, 4, staging);
            let keys: Vec<String> = {
                let p = lock(&c.planner);
                let chain = a.ix().keys("a").unwrap().to_vec();
                vec![p.group_key(chain[1]), p.group_key(chain[7])]
            };
            store.values.borrow_mut().get_mut(&keys[0]).unwrap()[crate::l3::HEADER_BYTES + 3] ^= 1;
            store.values.borrow_mut().get_mut(&keys[1]).unwrap().pop();
            let Fetched::Refused { rejected, .. } = fetch(&c, &store, "c", &tokens) else { panic!() };
            assert_eq!(rejected.len(), 2, "{rejected:?}");
            assert_eq!((rejected[0].1.clone(), rejected[0].2), (Reject::Digest, true));
            assert_eq!(rejected[1].1, Reject::Length(WRONG_LENGTH));
            assert_eq!(c.ix().pages().used(), 0);
            c.ix().check().unwrap();
        }
    }

    #[test]
    fn a_plan_never_names_a_slot_its_host_pool_has_not_backed() {
        let store = MapStore::default();
        let mut a = setup(2, 16, 0, None);
        let unbacked = Arc::new(HostPool::new(16, 32, 1 << 16, Some(false), PinMethod::Auto).unwrap());
        let host = HostPools { pages: unbacked, states: None };
        a.planner = Mutex::new(Planner::new("fp", b"", 2, host, 1024, Some(4)).unwrap());
        let tokens: Vec<i32> = (0..33).collect();
        let plan = a.ix().plan_store("a", b"", &tokens, tokens.len()).unwrap();
        let ready = a.ix().complete(plan.ticket).unwrap().unwrap();
        let err = a.tier().put(&store, &ready).unwrap_err();
        assert!(matches!(err, Error::Invariant(_)), "{err}");
        assert!(err.to_string().contains("page slot 0 is not below the host pool's 0 usable slots"), "{err}");
        assert!(store.values.borrow().is_empty(), "nothing was put");
        let ix = a.ix();
        assert_eq!(ix.pages().used(), ix.pages().evictable(), "the hold was released");
        ix.check().unwrap();
    }

    /// Transient codes never remove an object, and the fetch is simply not served.
    #[test]
    fn a_transient_code_removes_nothing() {
        let store = MapStore::default();
        let mut a = setup(2, 16, 0, None);
        let tokens: Vec<i32> = (0..17).collect();
        store_and_put(&mut a, &store, "a", &tokens);
        let n = store.values.borrow().len();
        for code in [-800, -707, -900, crate::l3::path::RPC_TIMEOUT] {
            for k in store.values.borrow().keys() {
                store.answer.borrow_mut().insert(k.clone(), code);
            }
            let b = setup(2, 16, 0, None);
            let Fetched::Refused { lost, rejected, .. } = fetch(&b, &store, "b", &tokens) else { panic!() };
            assert!(rejected.is_empty() && lost.iter().all(|l| l.1 == code), "{lost:?}");
            assert!(store.removed.borrow().is_empty() && store.values.borrow().len() == n);
            b.ix().check().unwrap();
        }
    }

    /// A model-version change at any point of a fetch: the fetch checks its objects under the version it was
    /// planned for, so no genuine object of either version is rejected or removed.
    #[test]
    fn a_version_change_during_a_fetch_removes_no_genuine_object() {
        let tokens: Vec<i32> = (0..17).collect();
        for when in ["before_exists", "before_get"] {
            let store = MapStore::default();
            let mut a = setup(2, 16, 0, None);
            let (ready, _) = store_and_put(&mut a, &store, "a", &tokens);
            lock(&a.planner).set_fingerprint("fp2").unwrap();
            a.tier().put(&store, &ready).unwrap(); // the new version's objects too
            assert_eq!(store.values.borrow().len(), 4);

            struct Changing<'a> {
                inner: &'a MapStore,
                planner: &'a Mutex<Planner>,
                when: &'a str,
            }
            impl Store for Changing<'_> {
                fn exists(&self, keys: &[String]) -> Answer {
                    if self.when == "before_exists" {
                        lock(self.planner).set_fingerprint("fp2").unwrap();
                    }
                    self.inner.exists(keys)
                }
                fn put(&self, keys: &[String], pieces: &[Vec<(usize, usize)>]) -> Answer {
                    self.inner.put(keys, pieces)
                }
                fn get(&self, keys: &[String], pieces: &[Vec<(usize, usize)>]) -> Answer {
                    if self.when == "before_get" {
                        lock(self.planner).set_fingerprint("fp2").unwrap();
                    }
                    self.inner.get(keys, pieces)
                }
                fn remove(&self, key: &str) -> std::result::Result<i64, Failure> {
                    self.inner.remove(key)
                }
            }
            let b = setup(2, 16, 0, None);
            b.ix().lookup("b", b"", &tokens).unwrap();
            let changing = Changing { inner: &store, planner: &b.planner, when };
            let got = b.tier().fetch(&changing, "b").unwrap().fetched;
            assert!(matches!(got, Fetched::Admitted { .. }), "{when}: {got:?}");
            assert!(store.removed.borrow().is_empty(), "{when}");
            assert_eq!(store.values.borrow().len(), 4);
        }
    }

    /// An object the Store holds already is not remembered as seen: it may be a forgery, and once a reader
    /// rejects and removes it the next store of it puts the right bytes.
    #[test]
    fn present_objects_are_put_again_once_removed() {
        let store = MapStore::default();
        let mut a = setup(2, 16, 0, None);
        let tokens: Vec<i32> = (0..17).collect();
        store_and_put(&mut a, &store, "a", &tokens);
        let mut b = setup(2, 16, 0, None);
        let put = store_and_put(&mut b, &store, "b", &tokens).1.unwrap();
        assert_eq!((put.objects, put.present), (2, 2));
        let key = store.values.borrow().keys().next().unwrap().clone();
        store.values.borrow_mut().get_mut(&key).unwrap().push(0);
        let mut c = setup(2, 16, 0, None);
        assert!(matches!(fetch(&c, &store, "c", &tokens), Fetched::Refused { .. }));
        assert!(!store.values.borrow().contains_key(&key), "removed");
        // The object that checked is remembered; the removed one is put again.
        let again = store_and_put(&mut c, &store, "c2", &tokens).1.unwrap();
        assert_eq!((again.objects, again.present, again.failed.len()), (1, 0, 0));
        assert!(matches!(fetch(&setup(2, 16, 0, None), &store, "d", &tokens), Fetched::Admitted { .. }));
    }

    /// A group this tier put that the Store no longer has (evicted there) is a "STORAGE" removed event when a
    /// probe finds it gone, and is put again by the next store of it.
    #[test]
    fn a_put_group_the_store_lost_is_a_removed_event_and_is_put_again() {
        let store = MapStore::default();
        let mut a = setup(2, 4, 0, None);
        let tokens: Vec<i32> = (0..17).collect();
        assert_eq!(store_and_put(&mut a, &store, "a", &tokens).1.unwrap().objects, 2);
        store.values.borrow_mut().clear(); // the Store evicted both groups
        let other: Vec<i32> = (100..117).collect();
        store_and_put(&mut a, &store, "b", &other); // a's pages leave the 4-slot host pool
        let keys = a.ix().keys("a").unwrap()[..4].to_vec();
        a.ix().take_events();
        assert!(matches!(fetch(&a, &store, "a", &tokens), Fetched::Miss | Fetched::Refused { .. }));
        let events = a.ix().take_events();
        let removed: Vec<_> =
            events.iter().filter(|e| e.removed && e.medium == Medium::Storage).flat_map(|e| e.keys.clone()).collect();
        assert_eq!(removed, keys);
        let again = store_and_put(&mut a, &store, "a2", &tokens).1.unwrap();
        assert_eq!((again.objects, again.present), (2, 0), "both groups put again");
        assert!(a.ix().take_events().iter().all(|e| !(e.removed && e.medium == Medium::Storage)), "not twice");
    }

    #[test]
    fn ready_names_only_the_run_from_page_zero_that_the_store_covered() {
        let c = setup(2, 16, 0, None);
        let mut ix = c.ix();
        let tokens: Vec<i32> = (0..25).collect();
        let first = ix.plan_store("a", b"", &tokens[..13], 13).unwrap();
        // Pages 0..3 are being filled by the first store: the second one holds none of them, so it names none.
        let second = ix.plan_store("b", b"", &tokens, 25).unwrap();
        assert_eq!(second.page_indices, vec![3, 4, 5]);
        assert_eq!(ix.complete(second.ticket).unwrap(), Some(Ready { page_keys: vec![], state_pages: vec![] }));
        let ready = ix.complete(first.ticket).unwrap().unwrap();
        assert_eq!(ready.page_keys, ix.keys("a").unwrap()[..3].to_vec());
        let again = ix.plan_store("c", b"", &tokens[..13], 13).unwrap();
        assert_eq!(ix.complete(again.ticket).unwrap(), None, "nothing new became ready");
        ix.check().unwrap();
    }

    #[test]
    fn fetch_snaps_to_the_deepest_group_end_with_a_state_and_reads_present_pages_into_scratch() {
        let c = setup(2, 16, 4, None);
        let mut ix = c.ix();
        let mut p = lock(&c.planner);
        let tokens: Vec<i32> = (0..33).collect();
        ix.lookup("a", b"", &tokens).unwrap();
        // Page 0 on the host already: group 0 is read whole, page 0 into scratch.
        let keys = ix.keys("a").unwrap().to_vec();
        let f = ix.plan_fetch(&keys[..1], &[]).unwrap().unwrap();
        ix.complete(f.ticket).unwrap();
        let probe = p.probe(&ix, "a").unwrap();
        assert_eq!(probe.exists_keys.len(), 4 + 4, "4 groups, 4 end states");
        // Groups 0..3 exist; states only at the end of group 1 (page 4).
        let codes = [1, 1, 1, 0, 0, 1, 0, 0];
        let plan = p.plan_fetch(&mut ix, &probe, &codes).unwrap().unwrap();
        assert_eq!(plan.objects.len(), 3, "two groups and the state");
        assert_eq!((plan.pages, plan.states), (3, 1));
        assert_eq!(plan.objects[0].pieces[0].0, p.scratch().0);
        ix.abort(plan.ticket).unwrap();
        ix.check().unwrap();
        assert!(p.probe(&ix, "unknown").is_none());
    }
}
