//! L3 planning: which objects a put sends and a fetch gets, their key strings, the host pointers of their
//! pieces, their headers, and the check of what a fetch got. The L3 tier's threads only run Store calls on
//! these plans and report the answers back.
//!
//! A put names the whole groups of `group_pages` pages of what a store made ready, and its states at group
//! ends, skips what the seen-set knows, and holds the host entries it reads. A fetch probes the groups beyond
//! the host's ready run, takes the longest run in the Store, snaps it to the deepest group end with a state (on
//! the host or in the Store; the lookup's rule) and reserves fresh slots; its objects are admitted only when
//! every header and digest checks.
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::chain::Key;
use crate::error::{invalid, Result};
use crate::index::{deepest_with_state, Index, Ready};
use crate::l3::{group_key_string, state_key_string, ObjectFormat, ObjectKind, Reject, SeenSet, HEADER_BYTES};

/// Seen-set ids of state objects differ from those of groups named by the same chain key.
const STATE_ID: Key = 0x5354_4154_4500_0000_0000_0000_0000_0001;

/// A Store code that says the object's value has another length (kvtier's own, below Mooncake's codes).
pub const WRONG_LENGTH: i64 = -1100;

/// Whether an L3 fetch of groups of `group_pages` could add whole groups between the host's ready run and the
/// lookup's cap (pages).
pub fn wants_fetch(group_pages: usize, ready_pages: usize, limit_pages: usize) -> bool {
    limit_pages / group_pages > ready_pages / group_pages
}

/// Where the host pools live. The addresses stay valid while the planner lives (the owner guarantees it).
#[derive(Clone, Copy, Debug)]
pub struct HostLayout {
    pub page_base: usize,
    pub page_bytes: usize,
    pub state_base: usize,
    pub state_bytes: usize,
}

/// A zeroed, fixed heap buffer handed to the Store by address: headers, and pages a fetch reads but the host
/// has already. Accessed only through raw pointers, since a Store call may still use it after a timeout.
#[derive(Debug)]
struct Buffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain bytes, used through raw pointers only; the planner's lock orders its users.
unsafe impl Send for Buffer {}
// SAFETY: as for Send: a shared reference only hands out the address.
unsafe impl Sync for Buffer {}

impl Buffer {
    fn new(bytes: usize) -> Self {
        let layout = Layout::from_size_align(bytes.max(1), 64).expect("a small buffer");
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).expect("allocation of an L3 buffer");
        Self { ptr, layout }
    }
    fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
    fn bytes(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Header slots handed out round robin, so that a plan whose Store call timed out (and may still run) is not
/// overwritten by the next plan at once; even then a clash only makes a header fail its check.
#[derive(Debug)]
struct Headers {
    buf: Buffer,
    slots: usize,
    next: usize,
}

impl Headers {
    fn take(&mut self) -> usize {
        let at = self.buf.addr() + self.next * HEADER_BYTES;
        self.next = (self.next + 1) % self.slots;
        at
    }
}

/// One object of a plan: its key string, the chain key its header names, and its pieces (header first).
#[derive(Clone, Debug)]
pub struct Object {
    pub key: String,
    pub chain_key: Key,
    pub kind: ObjectKind,
    /// `(address, bytes)`: the header, then the payload pieces in order.
    pub pieces: Vec<(usize, usize)>,
    /// The chain keys of a group's pages, in order (none for a state): what its KV events name.
    pub pages: Vec<Key>,
}

impl Object {
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.1).sum()
    }
    fn seen_id(&self) -> Key {
        match self.kind {
            ObjectKind::Group => self.chain_key,
            ObjectKind::State => self.chain_key ^ STATE_ID,
        }
    }
}

/// Which way a Store call moves objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    Put,
    Get,
}

/// A put: objects to send, and the hold ticket that keeps their host entries until the put returned.
#[derive(Clone, Debug)]
pub struct PutPlan {
    pub ticket: u64,
    pub objects: Vec<Object>,
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
}

/// A fetch: objects to get into fresh slots (and the scratch buffer), under a fetch ticket.
#[derive(Clone, Debug)]
pub struct FetchPlan {
    pub ticket: u64,
    pub objects: Vec<Object>,
    /// New host pages and states the ticket fills.
    pub pages: usize,
    pub states: usize,
}

/// The check of what a fetch got: objects rejected (wrong length, header or digest) and lost (a Store code).
#[derive(Clone, Debug, Default)]
pub struct Verdict {
    pub rejected: Vec<(usize, Reject)>,
    pub lost: Vec<(usize, i64)>,
}

impl Verdict {
    pub fn admitted(&self) -> bool {
        self.rejected.is_empty() && self.lost.is_empty()
    }
}

/// How a Store call moves an object's bytes.
#[derive(Debug)]
enum Wire {
    /// Straight from and into the host pools and the planner's header and scratch buffers, all of them registered
    /// with the Store: any peer of the Store's transfer engine can write them.
    ZeroCopy,
    /// Through staging buffers of their own (one for puts, one for fetches), the only memory registered: a put
    /// copies each object there first; a fetch lands there and is copied out before it is checked, so what is
    /// checked and served is memory no peer can write.
    Staged { put: Buffer, fetch: Buffer },
}

/// The L3 planner of one cache; see the module docs.
#[derive(Debug)]
pub struct Planner {
    fingerprint: String,
    format: ObjectFormat,
    hash_key: Vec<u8>,
    group_pages: usize,
    host: HostLayout,
    seen: SeenSet,
    seen_keys: usize,
    put_headers: Headers,
    fetch_headers: Headers,
    scratch: Buffer,
    scratch_pages: usize,
    wire: Wire,
}

impl Planner {
    /// `header_slots` bounds the objects of one plan; `scratch_pages` the pages a fetch reads that the host
    /// holds already (a plan is cut before a group that needs more). `staging_bytes`: the size of each staging
    /// buffer (puts, fetches), which must hold the largest object; None moves objects zero-copy.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        fingerprint: &str,
        hash_key: &[u8],
        group_pages: usize,
        host: HostLayout,
        seen_keys: usize,
        header_slots: usize,
        scratch_pages: usize,
        staging_bytes: Option<usize>,
    ) -> Result<Self> {
        if group_pages == 0 || header_slots < 2 || host.page_bytes == 0 {
            return Err(invalid(format!(
                "need group_pages >= 1, header_slots >= 2, page_bytes >= 1; got {group_pages}, {header_slots}, {}",
                host.page_bytes
            )));
        }
        let wire = match staging_bytes {
            None => Wire::ZeroCopy,
            Some(bytes) => {
                let largest = HEADER_BYTES + (group_pages * host.page_bytes).max(host.state_bytes);
                if bytes < largest {
                    return Err(invalid(format!(
                        "l3_staging_bytes must hold the largest L3 object ({largest} bytes: {group_pages} pages of \
                         {} bytes and a header), got {bytes}",
                        host.page_bytes
                    )));
                }
                Wire::Staged { put: Buffer::new(bytes), fetch: Buffer::new(bytes) }
            }
        };
        let headers = || Headers { buf: Buffer::new(header_slots * HEADER_BYTES), slots: header_slots, next: 0 };
        Ok(Self {
            fingerprint: fingerprint.to_owned(),
            format: ObjectFormat::new(fingerprint, hash_key),
            hash_key: hash_key.to_vec(),
            group_pages,
            host,
            seen: SeenSet::new(seen_keys)?,
            seen_keys,
            put_headers: headers(),
            fetch_headers: headers(),
            scratch: Buffer::new(scratch_pages * host.page_bytes),
            scratch_pages,
            wire,
        })
    }

    /// A new fingerprint (the model version changed): later plans name objects under it and check against it,
    /// and nothing is remembered as seen any more.
    pub fn set_fingerprint(&mut self, fingerprint: &str) -> Result<()> {
        self.fingerprint = fingerprint.to_owned();
        self.format = ObjectFormat::new(fingerprint, &self.hash_key);
        self.seen = SeenSet::new(self.seen_keys)?;
        Ok(())
    }

    /// Whether objects move straight from and into the host pools (which the Store must then have registered).
    pub fn zero_copy(&self) -> bool {
        matches!(self.wire, Wire::ZeroCopy)
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
    pub fn group_pages(&self) -> usize {
        self.group_pages
    }
    /// `(address, bytes)` of the planner's buffers the Store must have registered: the staging buffers, or
    /// zero-copy the header and scratch buffers (the host pools besides, see `zero_copy`).
    pub fn buffers(&self) -> Vec<(usize, usize)> {
        let of = |b: &Buffer| (b.addr(), b.bytes());
        match &self.wire {
            Wire::ZeroCopy => vec![of(&self.put_headers.buf), of(&self.fetch_headers.buf), of(&self.scratch)],
            Wire::Staged { put, fetch } => vec![of(put), of(fetch)],
        }
    }

    /// The plan's objects in runs that one Store call moves: all of them zero-copy, else as many consecutive ones
    /// as the staging buffer holds. `(start, end)` object indices.
    pub fn batches(&self, objects: &[Object]) -> Vec<(usize, usize)> {
        let cap = match &self.wire {
            Wire::ZeroCopy => usize::MAX,
            Wire::Staged { put, .. } => put.bytes(),
        };
        let mut out = Vec::new();
        let (mut start, mut bytes) = (0, 0);
        for (i, o) in objects.iter().enumerate() {
            if bytes + o.bytes() > cap && i > start {
                out.push((start, i));
                (start, bytes) = (i, 0);
            }
            bytes += o.bytes();
        }
        if start < objects.len() {
            out.push((start, objects.len()));
        }
        out
    }

    /// `(address, bytes)` pieces of each object that a Store call reads (`Direction::Put`) or writes (`Get`):
    /// the object's own pieces zero-copy, else one range of the staging buffer, which a put fills first. The
    /// objects are one batch of `batches`.
    pub fn wire(&self, objects: &[Object], dir: Transfer) -> Vec<Vec<(usize, usize)>> {
        let Some(base) = self.staging(dir) else {
            return objects.iter().map(|o| o.pieces.clone()).collect();
        };
        let mut at = base;
        objects
            .iter()
            .map(|o| {
                if dir == Transfer::Put {
                    for &(p, n) in &o.pieces {
                        // SAFETY: the pieces are the header slot and host slots the put's ticket holds (nobody
                        // writes them until it is released); the batch fits the staging buffer (`batches`).
                        unsafe { std::ptr::copy_nonoverlapping(p as *const u8, at as *mut u8, n) };
                        at += n;
                    }
                    vec![(at - o.bytes(), o.bytes())]
                } else {
                    at += o.bytes();
                    vec![(at - o.bytes(), o.bytes())]
                }
            })
            .collect()
    }

    /// After a staged get of one batch: copies each whole object (`got[i]` its bytes) out of the staging buffer
    /// into its own pieces, where it is checked and served. Nothing to do zero-copy.
    pub fn unstage(&self, objects: &[Object], got: &[i64]) {
        let Some(mut at) = self.staging(Transfer::Get) else { return };
        for (i, o) in objects.iter().enumerate() {
            if got.get(i).copied() == Some(o.bytes() as i64) {
                for &(p, n) in &o.pieces {
                    // SAFETY: the pieces are a header slot, slots the fetch's ticket reserved and scratch pages, all
                    // this planner's or the cache's private memory; the get into the staging range has returned.
                    unsafe { std::ptr::copy_nonoverlapping(at as *const u8, p as *mut u8, n) };
                    at += n;
                }
            } else {
                at += o.bytes();
            }
        }
    }

    fn staging(&self, dir: Transfer) -> Option<usize> {
        match (&self.wire, dir) {
            (Wire::ZeroCopy, _) => None,
            (Wire::Staged { put, .. }, Transfer::Put) => Some(put.addr()),
            (Wire::Staged { fetch, .. }, Transfer::Get) => Some(fetch.addr()),
        }
    }

    pub fn group_key(&self, last_page_key: Key) -> String {
        group_key_string(&self.fingerprint, self.group_pages as u32, last_page_key)
    }
    pub fn state_key(&self, page_key: Key) -> String {
        state_key_string(&self.fingerprint, page_key)
    }

    fn page_ptr(&self, slot: u32) -> usize {
        self.host.page_base + slot as usize * self.host.page_bytes
    }
    fn state_ptr(&self, slot: u32) -> usize {
        self.host.state_base + slot as usize * self.host.state_bytes
    }

    /// Plans the put of what a store made ready: new whole groups and group-end states, held on the host.
    /// None when there is nothing new to put.
    pub fn plan_put(&mut self, ix: &mut Index, ready: &Ready) -> Result<Option<PutPlan>> {
        let g = self.group_pages;
        let keys = &ready.page_keys;
        let groups: Vec<usize> = (0..keys.len() / g).filter(|&j| self.seen.insert(keys[(j + 1) * g - 1])).collect();
        let has_states = ix.config().state_slots > 0 && self.host.state_bytes > 0;
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
        let mut objects = Vec::new();
        for (j, slots) in groups.iter().zip(held.page_slots.chunks(g)) {
            let chain_key = keys[(j + 1) * g - 1];
            match slots.iter().copied().collect::<Option<Vec<u32>>>() {
                Some(slots) => objects.push(Object {
                    key: self.group_key(chain_key),
                    chain_key,
                    kind: ObjectKind::Group,
                    pieces: slots.iter().map(|&s| (self.page_ptr(s), self.host.page_bytes)).collect(),
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
                    pieces: vec![(self.state_ptr(*s), self.host.state_bytes)],
                    pages: Vec::new(),
                }),
                None => {
                    self.seen.remove(k ^ STATE_ID);
                }
            }
        }
        let cap = self.put_headers.slots;
        for dropped in objects.drain(objects.len().min(cap)..) {
            self.seen.remove(dropped.seen_id()); // more objects than header slots: a later store puts the rest
        }
        for o in &mut objects {
            o.pieces.insert(0, (self.put_headers.take(), HEADER_BYTES));
        }
        Ok(Some(PutPlan { ticket: held.ticket, objects }))
    }

    /// How this cache writes and checks its objects (for `seal` and `verify`, which need no lock).
    pub fn format(&self) -> &ObjectFormat {
        &self.format
    }

    /// Objects not to send: `present[i] == 1` says the Store has object i (a put never replaces one). They are
    /// not remembered as seen: nobody has checked them, and once a reader rejects and removes one, the next store
    /// of it puts the right bytes.
    pub fn drop_present(&mut self, plan: &mut PutPlan, present: &[i64]) -> usize {
        let before = plan.objects.len();
        let mut i = 0;
        let seen = &mut self.seen;
        plan.objects.retain(|o| {
            i += 1;
            let keep = present.get(i - 1) != Some(&1);
            if !keep {
                seen.remove(o.seen_id());
            }
            keep
        });
        before - plan.objects.len()
    }

    /// Forget that these objects were sent or seen (a failed put or get: a later store may put them again).
    pub fn unsee(&mut self, objects: &[&Object]) {
        for o in objects {
            self.seen.remove(o.seen_id());
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
        Some(Probe { keys, g0, state_on_host, asked, exists_keys })
    }

    /// The second step: from the Store's exists() answers, the run to get; reserves its slots. None for a
    /// miss (nothing usable in the Store, or the host pools cannot make room now).
    pub fn plan_fetch(&mut self, ix: &mut Index, probe: &Probe, codes: &[i64]) -> Result<Option<FetchPlan>> {
        let g = self.group_pages;
        let n_groups = probe.state_on_host.len();
        if codes.len() != probe.exists_keys.len() {
            return Err(invalid(format!("need {} exists codes, got {}", probe.exists_keys.len(), codes.len())));
        }
        let end = |i: usize| probe.keys[(probe.g0 + i + 1) * g - 1];
        let mut run = codes[..n_groups].iter().take_while(|&&c| c == 1).count();
        // Groups the host partly holds are read whole (the digest covers every page) into the scratch buffer;
        // cut the run where scratch or header slots run out.
        let mut scratch_used = 0;
        for i in 0..run {
            let first = (probe.g0 + i) * g;
            let present = probe.keys[first..first + g].iter().filter(|&&k| ix.pages().slot_of(k).is_some()).count();
            let need = if present == g { 0 } else { present };
            if scratch_used + need > self.scratch_pages || i + 2 > self.fetch_headers.slots {
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
        let mut objects = Vec::new();
        let mut scratch_next = 0;
        for (i, group) in slots.page_slots.chunks(g).enumerate() {
            if group.iter().all(Option::is_none) {
                continue; // the host holds this whole group already
            }
            let mut all = vec![(self.fetch_headers.take(), HEADER_BYTES)];
            for s in group {
                let at = match s {
                    Some(s) => self.page_ptr(*s),
                    None => {
                        scratch_next += 1;
                        self.scratch.addr() + (scratch_next - 1) * self.host.page_bytes
                    }
                };
                all.push((at, self.host.page_bytes));
            }
            let first = (probe.g0 + i) * g;
            objects.push(Object {
                key: self.group_key(end(i)),
                chain_key: end(i),
                kind: ObjectKind::Group,
                pieces: all,
                pages: probe.keys[first..first + g].to_vec(),
            });
        }
        if let (Some(k), Some(Some(s))) = (state_at, slots.state_slots.first()) {
            let pieces = vec![(self.fetch_headers.take(), HEADER_BYTES), (self.state_ptr(*s), self.host.state_bytes)];
            objects.push(Object {
                key: self.state_key(k),
                chain_key: k,
                kind: ObjectKind::State,
                pieces,
                pages: Vec::new(),
            });
        }
        for o in &objects {
            self.seen.insert(o.seen_id()); // unseen again unless the object checks (`verify`, `unsee`)
        }
        Ok(Some(FetchPlan {
            ticket: slots.ticket,
            objects,
            pages: slots.page_slots.iter().flatten().count(),
            states: slots.state_slots.iter().flatten().count(),
        }))
    }
}

/// Writes the headers of a put: digests of the held entries (no lock needed).
pub fn seal(format: &ObjectFormat, plan: &PutPlan) {
    for o in &plan.objects {
        // SAFETY: the header slot lies in the planner's put headers; the payload pieces are host slots held by
        // the plan's ticket (ready, written by no one until released) inside pools that outlive the planner.
        unsafe {
            let payload = payload_of(o);
            let header = &mut *(o.pieces[0].0 as *mut [u8; HEADER_BYTES]);
            format.seal(header, o.chain_key, o.kind, &payload);
        }
    }
}

/// Checks what a fetch got: `got[i]` is the Store's answer for `objects[i]` (bytes read, or a code), after
/// `Planner::unstage`. No index lock needed: the slots are reserved by the plan's ticket.
pub fn verify(format: &ObjectFormat, objects: &[Object], got: &[i64]) -> Verdict {
    let mut v = Verdict::default();
    for (i, o) in objects.iter().enumerate() {
        let code = got.get(i).copied().unwrap_or(i64::MIN);
        if code == o.bytes() as i64 {
            // SAFETY: the header slot lies in `fetch_headers`; the payload pieces are slots reserved by the
            // plan's ticket or scratch pages, and the get that wrote them has returned.
            let checked = unsafe {
                let header = &*(o.pieces[0].0 as *const [u8; HEADER_BYTES]);
                format.check(header, o.chain_key, o.kind, &payload_of(o))
            };
            if let Err(why) = checked {
                v.rejected.push((i, why));
            }
        } else if code >= 0 || code == WRONG_LENGTH || code == -600 {
            v.rejected.push((i, Reject::Length(code))); // -600: Mooncake's "buffer too small", a long value
        } else {
            v.lost.push((i, code));
        }
    }
    v
}

/// The payload pieces of an object as byte slices.
///
/// # Safety
/// Every piece after the header must be readable memory of its length for the lifetime of the result.
unsafe fn payload_of(o: &Object) -> Vec<&[u8]> {
    o.pieces[1..].iter().map(|&(p, n)| std::slice::from_raw_parts(p as *const u8, n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::HashKind;
    use crate::index::Config;

    struct Host {
        pages: Vec<u8>,
        states: Vec<u8>,
    }

    fn setup(g: usize, page_slots: u32, state_slots: u32) -> (Index, Host, Planner) {
        setup_wire(g, page_slots, state_slots, None)
    }

    fn setup_wire(g: usize, page_slots: u32, state_slots: u32, staging: Option<usize>) -> (Index, Host, Planner) {
        let cfg = Config {
            min_hit_tokens: 0,
            state_lookback_blocks: 8,
            ring_slack: 1000,
            hash_kind: HashKind::Xxh3,
            ..Config::new(page_slots, state_slots, 4)
        };
        let ix = Index::new(cfg, page_slots, state_slots).unwrap();
        let host = Host { pages: vec![0; page_slots as usize * 32], states: vec![0; state_slots.max(1) as usize * 16] };
        let layout = HostLayout {
            page_base: host.pages.as_ptr() as usize,
            page_bytes: 32,
            state_base: host.states.as_ptr() as usize,
            state_bytes: 16,
        };
        let p = Planner::new("fp", b"", g, layout, 1024, 16, 4, staging).unwrap();
        (ix, host, p)
    }

    /// Copies a put's objects into a map, as a Store would keep them, through the planner's wire (batch by
    /// batch).
    fn put_all(p: &Planner, plan: &PutPlan) -> std::collections::HashMap<String, Vec<u8>> {
        let mut out = std::collections::HashMap::new();
        for (a, b) in p.batches(&plan.objects) {
            let objects = &plan.objects[a..b];
            for (o, wire) in objects.iter().zip(p.wire(objects, Transfer::Put)) {
                // SAFETY: test buffers outlive the plan.
                let bytes: Vec<u8> = wire
                    .iter()
                    .flat_map(|&(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) }.to_vec())
                    .collect();
                out.insert(o.key.clone(), bytes);
            }
        }
        out
    }

    /// A fetch's gets through the planner's wire, batch by batch, each unstaged and checked: the codes and the
    /// verdicts.
    fn get_all(
        p: &Planner,
        plan: &FetchPlan,
        store: &std::collections::HashMap<String, Vec<u8>>,
    ) -> (Vec<i64>, Verdict) {
        let (mut codes, mut verdict) = (Vec::new(), Verdict::default());
        for (a, b) in p.batches(&plan.objects) {
            let objects = &plan.objects[a..b];
            let got: Vec<i64> = objects
                .iter()
                .zip(p.wire(objects, Transfer::Get))
                .map(|(o, wire)| match store.get(&o.key) {
                    Some(v) if v.len() == o.bytes() => {
                        let mut at = 0;
                        for &(p, n) in &wire {
                            // SAFETY: test buffers outlive the plan.
                            unsafe { std::ptr::copy_nonoverlapping(v[at..].as_ptr(), p as *mut u8, n) };
                            at += n;
                        }
                        v.len() as i64
                    }
                    Some(_) => WRONG_LENGTH,
                    None => -704,
                })
                .collect();
            p.unstage(objects, &got);
            let v = verify(p.format(), objects, &got);
            verdict.rejected.extend(v.rejected.into_iter().map(|(i, why)| (a + i, why)));
            verdict.lost.extend(v.lost.into_iter().map(|(i, code)| (a + i, code)));
            codes.extend(got);
        }
        (codes, verdict)
    }

    /// Zero-copy and staged (with a staging buffer that holds two objects, so that a plan takes several batches).
    #[test]
    fn put_then_fetch_round_trips_and_rejects_tampering() {
        for staging in [None, Some(2 * (HEADER_BYTES + 2 * 32))] {
            round_trip(staging);
        }
    }

    fn round_trip(staging: Option<usize>) {
        let (mut ix, mut host, mut p) = setup_wire(2, 16, 4, staging);
        assert_eq!(p.zero_copy(), staging.is_none());
        let tokens: Vec<i32> = (0..33).collect();
        let plan = ix.plan_store("a", b"", &tokens, 33).unwrap();
        for (i, &s) in plan.page_slots.iter().enumerate() {
            host.pages[s as usize * 32..(s as usize + 1) * 32].fill(i as u8 + 1);
        }
        for &s in &plan.state_slots {
            host.states[s as usize * 16..(s as usize + 1) * 16].fill(0xee);
        }
        let ready = ix.complete(plan.ticket).unwrap().unwrap();
        assert_eq!(ready.page_keys.len(), 8);
        assert_eq!(ready.state_pages, vec![8, 7, 6, 5, 4, 3, 2, 1][..4].to_vec());
        let put = p.plan_put(&mut ix, &ready).unwrap().unwrap();
        assert_eq!(put.objects.len(), 4 + 2, "4 groups, states at pages 8 and 6");
        assert_eq!(p.batches(&put.objects).len(), if staging.is_some() { 3 } else { 1 });
        seal(p.format(), &put);
        let mut store = put_all(&p, &put);
        ix.complete(put.ticket).unwrap();
        assert!(p.plan_put(&mut ix, &ready).unwrap().is_none(), "seen");
        ix.check().unwrap();

        // A second cache over the same planner format reads them back.
        let (mut ix2, host2, mut p2) = setup_wire(2, 16, 4, staging);
        ix2.lookup("b", b"", &tokens).unwrap();
        let probe = p2.probe(&ix2, "b").unwrap();
        let codes: Vec<i64> = probe.exists_keys.iter().map(|k| i64::from(store.contains_key(k))).collect();
        let fetch = p2.plan_fetch(&mut ix2, &probe, &codes).unwrap().unwrap();
        assert_eq!((fetch.pages, fetch.states), (8, 1));
        assert!(get_all(&p2, &fetch, &store).1.admitted());
        ix2.complete(fetch.ticket).unwrap();
        assert_eq!(ix2.lookup("b", b"", &tokens).unwrap().hit_tokens, 32);
        assert_eq!(host2.pages[..32], [1u8; 32], "page 0's bytes arrived");

        // Tampered values: one bit flipped, a short value; both rejected, the ticket aborted.
        let (mut ix3, _host3, mut p3) = setup_wire(2, 16, 4, staging);
        let first = fetch.objects[0].key.clone();
        store.get_mut(&first).unwrap()[HEADER_BYTES + 3] ^= 1;
        let last = fetch.objects[3].key.clone();
        store.get_mut(&last).unwrap().pop();
        ix3.lookup("c", b"", &tokens).unwrap();
        let probe = p3.probe(&ix3, "c").unwrap();
        let codes: Vec<i64> = probe.exists_keys.iter().map(|k| i64::from(store.contains_key(k))).collect();
        let fetch = p3.plan_fetch(&mut ix3, &probe, &codes).unwrap().unwrap();
        let (_, v) = get_all(&p3, &fetch, &store);
        assert_eq!(v.rejected.len(), 2, "{v:?}");
        assert_eq!(v.rejected[0].1, Reject::Digest);
        assert_eq!(v.rejected[1].1, Reject::Length(WRONG_LENGTH));
        ix3.abort(fetch.ticket).unwrap();
        assert_eq!(ix3.pages().used(), 0);
        ix3.check().unwrap();
    }

    /// Staged, the bytes checked are the copy out of the staging buffer: a peer writing the staging buffer after
    /// the get cannot change what is served, and what it writes before the check is caught.
    #[test]
    fn a_staged_fetch_checks_and_serves_its_private_copy() {
        let staging = Some(4 * (HEADER_BYTES + 2 * 32));
        let (mut ix, mut host, mut p) = setup_wire(2, 16, 0, staging);
        let tokens: Vec<i32> = (0..17).collect();
        let plan = ix.plan_store("a", b"", &tokens, 17).unwrap();
        for &s in &plan.page_slots {
            host.pages[s as usize * 32..(s as usize + 1) * 32].fill(7);
        }
        let ready = ix.complete(plan.ticket).unwrap().unwrap();
        let put = p.plan_put(&mut ix, &ready).unwrap().unwrap();
        seal(p.format(), &put);
        let store = put_all(&p, &put);
        ix.complete(put.ticket).unwrap();

        let (mut ix2, host2, mut p2) = setup_wire(2, 16, 0, staging);
        ix2.lookup("b", b"", &tokens).unwrap();
        let probe = p2.probe(&ix2, "b").unwrap();
        let fetch = p2.plan_fetch(&mut ix2, &probe, &[1, 1]).unwrap().unwrap();
        let wire = p2.wire(&fetch.objects, Transfer::Get);
        let got: Vec<i64> = fetch
            .objects
            .iter()
            .zip(&wire)
            .map(|(o, w)| {
                // SAFETY: test buffers outlive the plan; one staging range an object.
                unsafe { std::ptr::copy_nonoverlapping(store[&o.key].as_ptr(), w[0].0 as *mut u8, w[0].1) };
                o.bytes() as i64
            })
            .collect();
        p2.unstage(&fetch.objects, &got);
        // A peer scribbles over the staging buffer after the copy out: the check and the host slots do not see it.
        // SAFETY: the first staging range is the planner's buffer.
        unsafe { std::ptr::write_bytes(wire[0][0].0 as *mut u8, 0xee, wire[0][0].1) };
        assert!(verify(p2.format(), &fetch.objects, &got).admitted());
        ix2.complete(fetch.ticket).unwrap();
        assert!(host2.pages[..4 * 32].iter().all(|&b| b == 7));
        assert!(p2.buffers().iter().all(|&(a, _)| a != host2.pages.as_ptr() as usize), "host pools not registered");
    }

    #[test]
    fn staging_must_hold_the_largest_object() {
        let layout = HostLayout { page_base: 64, page_bytes: 32, state_base: 64, state_bytes: 1000 };
        let err = Planner::new("fp", b"", 2, layout, 16, 4, 4, Some(HEADER_BYTES + 64)).unwrap_err();
        assert!(err.to_string().contains("l3_staging_bytes") && err.to_string().contains("1080"), "{err}");
    }

    /// An object the Store holds already is not remembered as seen: it may be a forgery, and once a reader
    /// rejects and removes it the next store of it puts the right bytes.
    #[test]
    fn present_objects_are_put_again_once_removed() {
        let (mut ix, _host, mut p) = setup(2, 16, 0);
        let tokens: Vec<i32> = (0..17).collect();
        let plan = ix.plan_store("a", b"", &tokens, 17).unwrap();
        let ready = ix.complete(plan.ticket).unwrap().unwrap();
        let mut put = p.plan_put(&mut ix, &ready).unwrap().unwrap();
        assert_eq!(p.drop_present(&mut put, &[1, 1]), 2);
        ix.complete(put.ticket).unwrap();
        let again = p.plan_put(&mut ix, &ready).unwrap().expect("present objects are put again when asked");
        assert_eq!(again.objects.len(), 2);
        ix.complete(again.ticket).unwrap();
        assert!(p.plan_put(&mut ix, &ready).unwrap().is_none(), "objects this cache sent are remembered");
        ix.check().unwrap();
    }

    #[test]
    fn ready_names_only_the_run_from_page_zero_that_the_store_covered() {
        let (mut ix, _host, _p) = setup(2, 16, 0);
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
        let (mut ix, _host, mut p) = setup(2, 16, 4);
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
        assert_eq!(plan.objects[0].pieces[1].0, p.scratch.addr());
        ix.abort(plan.ticket).unwrap();
        ix.check().unwrap();
        assert!(p.probe(&ix, "unknown").is_none());
    }
}
