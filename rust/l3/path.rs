//! The one L3 object path. Every adapter (kvtier's own tier, SGLang's `KvtierStore`, vLLM's
//! `KvtierMooncakeTier`) turns its engine's handles into objects (a Store key, the chain key its header names, and
//! the payload's host pieces) and hands them with a `Store` to this path, which runs the rest once: batching,
//! header slots, staging, sealing, the Store calls, the check of what a get read, the removal of objects that
//! fail it, and one typed outcome per object. How each Store code is read is decided once, in `CODES`.
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::error::{invalid, Result};
use crate::index::chain::{engine_page_keys, Key};
use crate::l3::{group_key_string, ObjectFormat, ObjectKind, Reject, HEADER_BYTES};

/// Objects one Store call moves at most: the header slots of each direction (SGLang's HiCache batches 128 pages;
/// a larger plan takes several calls).
pub const HEADER_SLOTS: usize = 256;

/// What a Store's answer says about one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeClass {
    /// The object is not in the Store (never put, evicted, removed).
    Missing,
    /// The Store holds a value of another length than the object: a wrong object, rejected and removed.
    WrongLength,
    /// The Store has no room: the object is not cached (a put), nothing is wrong with any object.
    NoSpace,
    /// The Store or its transfer path failed for now; the object may be fine: it is never removed.
    Transient,
}

/// One Store return code: its number, its name and how it is read.
#[derive(Clone, Copy, Debug)]
pub struct Code {
    pub code: i64,
    pub name: &'static str,
    pub class: CodeClass,
    /// Whether the code says the Store itself (master or transfer path) fails, not one object: it opens the
    /// client's breaker.
    pub store_failing: bool,
}

const fn code(code: i64, name: &'static str, class: CodeClass, store_failing: bool) -> Code {
    Code { code, name, class, store_failing }
}

/// A code kvtier's Store client gives when the value has another length than the buffers of a get.
pub const WRONG_LENGTH: i64 = -1100;
/// A code kvtier's Store client gives when its call did not return in time (it may still run).
pub const RPC_TIMEOUT: i64 = -901;
/// The code of an object whose Store call raised something other than a Store error (a bug, a fault injected).
pub const STORE_RAISED: i64 = -1101;

use CodeClass::{Missing, NoSpace, Transient, WrongLength};

/// Every code an L3 Store answers with (Mooncake Store 0.3's `ErrorCode`s that matter, and kvtier's own below
/// -1000), read one way for every adapter. A code not listed is `Transient`: nothing is removed on a code nobody
/// has read.
pub const CODES: &[Code] = &[
    code(-1, "INTERNAL_ERROR", Transient, false),
    code(-200, "NO_SPACE", NoSpace, false),
    // A get whose buffers are smaller than the value: the value is longer than the object.
    code(-600, "INVALID_PARAMS", WrongLength, false),
    code(-703, "REPLICA_IS_NOT_READY", Transient, false),
    code(-704, "OBJECT_NOT_FOUND", Missing, false),
    code(-705, "OBJECT_ALREADY_EXISTS", Transient, false),
    code(-706, "OBJECT_HAS_LEASE", Transient, false),
    code(-707, "LEASE_EXPIRED", Transient, false),
    code(-800, "TRANSFER_FAIL", Transient, true),
    code(-900, "RPC_FAIL", Transient, true),
    code(RPC_TIMEOUT, "RPC_TIMEOUT", Transient, true),
    code(WRONG_LENGTH, "WRONG_LENGTH", WrongLength, false),
    code(STORE_RAISED, "STORE_RAISED", Transient, false),
];

/// How a negative Store code is read (`Transient` for a code not in `CODES`).
pub fn classify(code: i64) -> CodeClass {
    CODES.iter().find(|c| c.code == code).map_or(Transient, |c| c.class)
}

/// A Store call that failed as a whole: the code its objects get and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub code: i64,
    pub message: String,
}

pub type Answer = std::result::Result<Vec<i64>, Failure>;

/// The one seam between the object path and a storage backend (Mooncake Store through its Python client). Batch
/// calls answer one int per key as Mooncake does: exists 1 / 0 / a negative code; put 0 or a code; get the bytes
/// read or a code. Pieces are `(address, bytes)` of memory the path keeps alive and untouched for the call. A call
/// returns only once the backend no longer uses its buffers (a call that timed out is waited out first).
pub trait Store {
    fn exists(&self, keys: &[String]) -> Answer;
    fn put(&self, keys: &[String], pieces: &[Vec<(usize, usize)>]) -> Answer;
    fn get(&self, keys: &[String], pieces: &[Vec<(usize, usize)>]) -> Answer;
    /// Removes one object even when it is leased: 0, or a code.
    fn remove(&self, key: &str) -> std::result::Result<i64, Failure>;
}

/// One object of a put or get: its Store key, the chain key and kind its header names, and its payload pieces.
#[derive(Clone, Debug)]
pub struct Object {
    pub key: String,
    pub chain_key: Key,
    pub kind: ObjectKind,
    /// `(address, bytes)` of the payload, in order.
    pub pieces: Vec<(usize, usize)>,
    /// The chain keys of a group's pages, in order (none for a state): what its KV events name.
    pub pages: Vec<Key>,
}

/// How one engine's own objects are named, sealed and checked: each is one page (SGLang's HiCache page, vLLM's CPU
/// chunk) under the chain key of the engine's page hash (`chain::engine_page_key`), in the format of the L3 tier's
/// groups.
#[derive(Clone, Debug)]
pub struct EngineFormat {
    fingerprint: String,
    format: ObjectFormat,
}

impl EngineFormat {
    /// `hash_key`: the deployment's secret (empty: the unkeyed digest).
    pub fn new(fingerprint: &str, hash_key: &[u8]) -> Result<Self> {
        if fingerprint.is_empty() || fingerprint.contains('/') {
            return Err(invalid(format!("fingerprint must be non-empty and without '/', got {fingerprint:?}")));
        }
        Ok(Self { fingerprint: fingerprint.to_owned(), format: ObjectFormat::new(fingerprint, hash_key) })
    }
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
    pub fn format(&self) -> &ObjectFormat {
        &self.format
    }
    /// The Store key of a page's chain key: `kvtier/v<format>/<fingerprint>/g1/<hex>`, an object of one page.
    pub fn store_key(&self, key: Key) -> String {
        group_key_string(&self.fingerprint, 1, key)
    }

    /// The objects of pages named by the engine's hashes, each with its payload pieces.
    pub fn objects<S: AsRef<str>>(&self, page_hashes: &[S], pieces: Vec<Vec<(usize, usize)>>) -> Result<Vec<Object>> {
        if page_hashes.len() != pieces.len() {
            return Err(invalid(format!(
                "need the pieces of {} pages, got {} piece lists",
                page_hashes.len(),
                pieces.len()
            )));
        }
        let keys = engine_page_keys(page_hashes)?;
        Ok(keys
            .into_iter()
            .zip(pieces)
            .map(|(k, pieces)| Object {
                key: self.store_key(k),
                chain_key: k,
                kind: ObjectKind::Group,
                pieces,
                pages: vec![k],
            })
            .collect())
    }
}

/// The memory an engine's objects may move from and into: `(address, bytes)` ranges its owner registered (the
/// host pool an engine keeps its pages in, a buffer held for one call). Every piece of every object must lie
/// inside one of them before the path reads or writes it.
#[derive(Clone, Debug, Default)]
pub struct Regions(Vec<(usize, usize)>);

impl Regions {
    pub fn add(&mut self, addr: usize, bytes: usize) {
        self.0.push((addr, bytes));
    }

    /// Refuses the first piece that lies outside every region, naming its object and where it is.
    pub fn check(&self, objects: &[Object]) -> Result<()> {
        let inside = |&(p, n): &(usize, usize)| {
            self.0.iter().any(|&(start, len)| p >= start && p.checked_add(n).is_some_and(|end| end <= start + len))
        };
        for (i, o) in objects.iter().enumerate() {
            if let Some(&(p, n)) = o.pieces.iter().find(|piece| !inside(piece)) {
                return Err(invalid(format!(
                    "object {i} ({}): its piece of {n} bytes at {p:#x} lies outside the memory registered with the \
                     object path",
                    o.key
                )));
            }
        }
        Ok(())
    }
}

impl Object {
    /// Bytes of the object in the Store: header and payload.
    pub fn bytes(&self) -> usize {
        HEADER_BYTES + self.payload_bytes()
    }
    pub fn payload_bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.1).sum()
    }
}

/// What a put did with one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    Stored,
    /// The Store has it already (a put never replaces an object: the first writer wins).
    Present,
    /// Not stored: the Store's code (see `classify`).
    Failed(i64),
}

/// What a get did with one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GetOutcome {
    /// Whole and verified in its pieces.
    Loaded,
    /// Not in the Store.
    Missing,
    /// Not read for now (a transient Store code or failure); the object may be fine and stays.
    Lost(i64),
    /// A wrong object under this key (length, header or digest): never served, and removed (`removed`) so that
    /// an honest writer can put the right one.
    Rejected { why: Reject, removed: bool },
}

/// The counters of one object path (rust/index/stats.rs names them `l3_*`).
#[derive(Debug, Default)]
pub struct Counters {
    pub objects_put: AtomicU64,
    pub objects_present: AtomicU64,
    pub puts_failed: AtomicU64,
    pub bytes_put: AtomicU64,
    pub objects_loaded: AtomicU64,
    pub bytes_loaded: AtomicU64,
    pub objects_missing: AtomicU64,
    pub objects_lost: AtomicU64,
    pub rejected: AtomicU64,
    pub rejected_removed: AtomicU64,
    pub store_errors: AtomicU64,
}

impl Counters {
    /// `(name, value)` of each counter, named as in rust/index/stats.rs's table.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let v = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("l3_objects_put", v(&self.objects_put)),
            ("l3_puts_present", v(&self.objects_present)),
            ("l3_puts_failed", v(&self.puts_failed)),
            ("l3_bytes_put", v(&self.bytes_put)),
            ("l3_objects_loaded", v(&self.objects_loaded)),
            ("l3_bytes_loaded", v(&self.bytes_loaded)),
            ("l3_objects_missing", v(&self.objects_missing)),
            ("l3_objects_lost", v(&self.objects_lost)),
            ("l3_rejected", v(&self.rejected)),
            ("l3_rejected_removed", v(&self.rejected_removed)),
            ("l3_store_errors", v(&self.store_errors)),
        ]
    }
}

fn add(c: &AtomicU64, n: usize) {
    c.fetch_add(n as u64, Ordering::Relaxed);
}

/// A zeroed, fixed heap buffer handed to the Store by address (header slots, staging, scratch pages). Used
/// through raw pointers only, since a Store call writes it.
#[derive(Debug)]
pub(crate) struct Buffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain bytes, used through raw pointers only; its owner's lock orders its users.
unsafe impl Send for Buffer {}
// SAFETY: as for Send: a shared reference only hands out the address.
unsafe impl Sync for Buffer {}

impl Buffer {
    pub(crate) fn new(bytes: usize) -> Self {
        let layout = Layout::from_size_align(bytes.max(1), 64).expect("a small buffer");
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).expect("allocation of an L3 buffer");
        Self { ptr, layout }
    }
    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
    pub(crate) fn bytes(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// One direction's memory: header slots and, staged, the staging buffer. Its lock is held for a whole put or get.
#[derive(Debug)]
struct Lane {
    headers: Buffer,
    staging: Option<Buffer>,
}

/// Payload bytes worth a digesting thread of their own (BLAKE3 runs at a few GB/s a core; a thread costs tens of us).
const DIGEST_BYTES_PER_THREAD: u64 = 1 << 20;

/// The object path of one adapter; see the module docs.
#[derive(Debug)]
pub struct ObjectPath {
    put: Mutex<Lane>,
    get: Mutex<Lane>,
    counters: Counters,
}

impl ObjectPath {
    /// `staging_bytes`: the size of each direction's staging buffer, which then is the only memory the Store must
    /// have registered (what a get read is copied out into its pieces before it is checked there, so no peer of
    /// the Store can write memory an engine loads from); None moves objects straight from and into their pieces
    /// and the header slots (zero-copy: the Store must have those registered).
    pub fn new(staging_bytes: Option<usize>) -> Result<Self> {
        if staging_bytes.is_some_and(|b| b <= HEADER_BYTES) {
            return Err(invalid(format!(
                "l3_staging_bytes must hold an object (more than its {HEADER_BYTES}-byte header), got {staging_bytes:?}"
            )));
        }
        let lane =
            || Lane { headers: Buffer::new(HEADER_SLOTS * HEADER_BYTES), staging: staging_bytes.map(Buffer::new) };
        Ok(Self { put: Mutex::new(lane()), get: Mutex::new(lane()), counters: Counters::default() })
    }

    pub fn zero_copy(&self) -> bool {
        lock(&self.put).staging.is_none()
    }

    /// The bytes of the largest object a call moves (staged: the staging buffer's size).
    pub fn staging_bytes(&self) -> Option<usize> {
        lock(&self.put).staging.as_ref().map(Buffer::bytes)
    }

    /// `(address, bytes)` of the path's buffers the Store must have registered: the staging buffers, or zero-copy
    /// the header slots (and then every object's pieces too).
    pub fn buffers(&self) -> Vec<(usize, usize)> {
        let of = |b: &Buffer| (b.addr(), b.bytes());
        [lock(&self.put), lock(&self.get)]
            .iter()
            .map(|l| l.staging.as_ref().map_or_else(|| of(&l.headers), of))
            .collect()
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Puts each object unless the Store has it, sealed by `format`. The pieces must stay readable and unwritten
    /// for the call. Returns one outcome per object, in order.
    pub fn put(&self, store: &dyn Store, format: &ObjectFormat, objects: &[Object]) -> Result<Vec<PutOutcome>> {
        let lane = lock(&self.put);
        check_fits(&lane, objects)?;
        let keys: Vec<String> = objects.iter().map(|o| o.key.clone()).collect();
        // An exists that fails puts everything: a put never replaces what the Store has.
        let present = store.exists(&keys).unwrap_or_else(|f| {
            add(&self.counters.store_errors, 1);
            vec![f.code; keys.len()]
        });
        let mut out: Vec<PutOutcome> = (0..objects.len())
            .map(|i| if present.get(i) == Some(&1) { PutOutcome::Present } else { PutOutcome::Failed(0) })
            .collect();
        let todo: Vec<usize> = (0..objects.len()).filter(|&i| out[i] != PutOutcome::Present).collect();
        add(&self.counters.objects_present, objects.len() - todo.len());
        for run in batches(&lane, todo.iter().map(|&i| &objects[i])) {
            let idx = &todo[run];
            let batch: Vec<&Object> = idx.iter().map(|&i| &objects[i]).collect();
            seal_all(&lane.headers, format, &batch);
            let wire = wire(&lane, &batch, true);
            let keys: Vec<String> = batch.iter().map(|o| o.key.clone()).collect();
            let codes = store.put(&keys, &wire).unwrap_or_else(|f| {
                add(&self.counters.store_errors, 1);
                vec![f.code; keys.len()]
            });
            for (j, &i) in idx.iter().enumerate() {
                let code = codes.get(j).copied().unwrap_or(STORE_RAISED);
                out[i] = if code == 0 {
                    add(&self.counters.objects_put, 1);
                    add(&self.counters.bytes_put, objects[i].bytes());
                    PutOutcome::Stored
                } else {
                    add(&self.counters.puts_failed, 1);
                    PutOutcome::Failed(code)
                };
            }
        }
        Ok(out)
    }

    /// Gets each object into its pieces and checks it with `format`; a wrong object is removed from the Store.
    /// The pieces must be the caller's to write and unread by others for the call. One outcome per object.
    pub fn get(&self, store: &dyn Store, format: &ObjectFormat, objects: &[Object]) -> Result<Vec<GetOutcome>> {
        let lane = lock(&self.get);
        check_fits(&lane, objects)?;
        let mut out = Vec::with_capacity(objects.len());
        for run in batches(&lane, objects.iter()) {
            let start = run.start;
            let batch: Vec<&Object> = objects[run].iter().collect();
            let wire = wire(&lane, &batch, false);
            let keys: Vec<String> = batch.iter().map(|o| o.key.clone()).collect();
            let got = store.get(&keys, &wire).unwrap_or_else(|f| {
                add(&self.counters.store_errors, 1);
                vec![f.code; keys.len()]
            });
            let got: Vec<i64> = (0..batch.len()).map(|j| got.get(j).copied().unwrap_or(STORE_RAISED)).collect();
            unstage(&lane, &batch, &got);
            let checked = check_all(&lane.headers, format, &batch, &got);
            for (j, verdict) in checked.into_iter().enumerate() {
                let o = &objects[start + j];
                out.push(match verdict {
                    Ok(()) => {
                        add(&self.counters.objects_loaded, 1);
                        add(&self.counters.bytes_loaded, o.bytes());
                        GetOutcome::Loaded
                    }
                    Err(Some(why)) => {
                        add(&self.counters.rejected, 1);
                        // Removed so that an honest writer can put the right bytes (the first writer wins).
                        let removed = store.remove(&o.key) == Ok(0);
                        add(&self.counters.rejected_removed, usize::from(removed));
                        GetOutcome::Rejected { why, removed }
                    }
                    Err(None) if classify(got[j]) == Missing => {
                        add(&self.counters.objects_missing, 1);
                        GetOutcome::Missing
                    }
                    Err(None) => {
                        add(&self.counters.objects_lost, 1);
                        GetOutcome::Lost(got[j])
                    }
                });
            }
        }
        Ok(out)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn check_fits(lane: &Lane, objects: &[Object]) -> Result<()> {
    if let Some(cap) = lane.staging.as_ref().map(Buffer::bytes) {
        if let Some(o) = objects.iter().find(|o| o.bytes() > cap) {
            return Err(invalid(format!(
                "object {} needs {} bytes, more than l3_staging_bytes = {cap}",
                o.key,
                o.bytes()
            )));
        }
    }
    if let Some(o) = objects.iter().find(|o| o.pieces.iter().any(|&(p, n)| p == 0 || n == 0)) {
        return Err(invalid(format!("object {}: every piece needs an address and bytes, got {:?}", o.key, o.pieces)));
    }
    Ok(())
}

/// Consecutive runs of objects one Store call moves: at most the header slots and, staged, what the staging
/// buffer holds. Ranges of indices into the objects given.
fn batches<'a>(lane: &Lane, objects: impl Iterator<Item = &'a Object>) -> Vec<std::ops::Range<usize>> {
    let cap = lane.staging.as_ref().map_or(usize::MAX, Buffer::bytes);
    let mut out = Vec::new();
    let (mut start, mut bytes, mut n) = (0, 0, 0);
    for (i, o) in objects.enumerate() {
        if i > start && (i - start == HEADER_SLOTS || bytes + o.bytes() > cap) {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += o.bytes();
        n = i + 1;
    }
    if start < n {
        out.push(start..n);
    }
    out
}

fn header_at(headers: &Buffer, j: usize) -> usize {
    headers.addr() + j * HEADER_BYTES
}

/// The payload pieces of an object as byte slices.
///
/// # Safety
/// Every piece must be readable memory of its length for the lifetime of the result.
unsafe fn payload_of(o: &Object) -> Vec<&[u8]> {
    o.pieces.iter().map(|&(p, n)| std::slice::from_raw_parts(p as *const u8, n)).collect()
}

fn digest_threads(batch: &[&Object]) -> usize {
    let bytes: usize = batch.iter().map(|o| o.payload_bytes()).sum();
    crate::par::threads_for(bytes as u64, DIGEST_BYTES_PER_THREAD, batch.len(), usize::MAX)
}

/// Seals object j's header into header slot j, digesting on a few threads when there are MiBs.
fn seal_all(headers: &Buffer, format: &ObjectFormat, batch: &[&Object]) {
    crate::par::map(batch.len(), digest_threads(batch), |j| {
        let o = batch[j];
        // SAFETY: slot j lies in the lane's header buffer (a batch has at most HEADER_SLOTS objects), written by
        // this thread alone under the lane's lock; the payload pieces are readable for the call (`put`'s contract).
        unsafe {
            let header = &mut *(header_at(headers, j) as *mut [u8; HEADER_BYTES]);
            format.seal(header, o.chain_key, o.kind, &payload_of(o));
        }
    });
}

/// The `(address, bytes)` pieces of each object a Store call reads (a put) or writes (a get): zero-copy, its
/// header slot and payload pieces; staged, one range of the staging buffer each, which a put fills first.
fn wire(lane: &Lane, batch: &[&Object], put: bool) -> Vec<Vec<(usize, usize)>> {
    let Some(staging) = &lane.staging else {
        return batch
            .iter()
            .enumerate()
            .map(|(j, o)| {
                std::iter::once((header_at(&lane.headers, j), HEADER_BYTES)).chain(o.pieces.iter().copied()).collect()
            })
            .collect();
    };
    let mut at = staging.addr();
    batch
        .iter()
        .enumerate()
        .map(|(j, o)| {
            let start = at;
            if put {
                for (p, n) in
                    std::iter::once((header_at(&lane.headers, j), HEADER_BYTES)).chain(o.pieces.iter().copied())
                {
                    // SAFETY: the header slot and payload pieces are readable (`put`'s contract); the batch fits the
                    // staging buffer (`batches`), which this lane's lock gives to this call alone.
                    unsafe { std::ptr::copy_nonoverlapping(p as *const u8, at as *mut u8, n) };
                    at += n;
                }
            } else {
                at += o.bytes();
            }
            vec![(start, o.bytes())]
        })
        .collect()
}

/// After a staged get: copies each whole object (`got[j]` its bytes) out of the staging buffer into its header
/// slot and pieces, where it is checked and served. Nothing to do zero-copy.
fn unstage(lane: &Lane, batch: &[&Object], got: &[i64]) {
    let Some(staging) = &lane.staging else { return };
    let mut at = staging.addr();
    for (j, o) in batch.iter().enumerate() {
        if got[j] == o.bytes() as i64 {
            let mut from = at;
            for (p, n) in std::iter::once((header_at(&lane.headers, j), HEADER_BYTES)).chain(o.pieces.iter().copied()) {
                // SAFETY: the pieces are the caller's to write (`get`'s contract) and the header slot is the lane's;
                // the get into the staging range has returned.
                unsafe { std::ptr::copy_nonoverlapping(from as *const u8, p as *mut u8, n) };
                from += n;
            }
        }
        at += o.bytes();
    }
}

/// The check of each object of a get: Ok when whole and verified; Err(Some) for a wrong object (length, header
/// or digest); Err(None) when the code says it was not read (missing, or a transient failure).
fn check_all(
    headers: &Buffer,
    format: &ObjectFormat,
    batch: &[&Object],
    got: &[i64],
) -> Vec<std::result::Result<(), Option<Reject>>> {
    crate::par::map(batch.len(), digest_threads(batch), |j| {
        let (o, code) = (batch[j], got[j]);
        if code == o.bytes() as i64 {
            // SAFETY: the header slot is the lane's; the pieces were written by the get (or unstaged), which has
            // returned, and are not written by others during the call (`get`'s contract).
            let checked = unsafe {
                let header = &*(header_at(headers, j) as *const [u8; HEADER_BYTES]);
                format.check(header, o.chain_key, o.kind, &payload_of(o))
            };
            checked.map_err(Some)
        } else if code >= 0 || classify(code) == WrongLength {
            Err(Some(Reject::Length(code)))
        } else {
            Err(None)
        }
    })
}

/// A Store in a map for the core's tests, answering as Mooncake does: a longer value -600, a shorter one
/// `WRONG_LENGTH`, a missing one -704; `answer` replaces a get's code (a transient failure), `fail` fails every call.
#[cfg(test)]
pub(crate) mod test_store {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// A Store in a map; `answer` replaces the get code of a key (a transient failure), `fail` fails every call.
    #[derive(Default)]
    pub(crate) struct MapStore {
        pub(crate) values: RefCell<HashMap<String, Vec<u8>>>,
        pub(crate) answer: RefCell<HashMap<String, i64>>,
        pub(crate) fail: Option<Failure>,
        pub(crate) removed: RefCell<Vec<String>>,
    }

    impl Store for MapStore {
        fn exists(&self, keys: &[String]) -> Answer {
            if let Some(f) = &self.fail {
                return Err(f.clone());
            }
            Ok(keys.iter().map(|k| i64::from(self.values.borrow().contains_key(k))).collect())
        }
        fn put(&self, keys: &[String], pieces: &[Vec<(usize, usize)>]) -> Answer {
            if let Some(f) = &self.fail {
                return Err(f.clone());
            }
            for (k, p) in keys.iter().zip(pieces) {
                // SAFETY: test pieces are live for the call.
                let v: Vec<u8> = p
                    .iter()
                    .flat_map(|&(a, n)| unsafe { std::slice::from_raw_parts(a as *const u8, n) }.to_vec())
                    .collect();
                self.values.borrow_mut().entry(k.clone()).or_insert(v);
            }
            Ok(vec![0; keys.len()])
        }
        fn get(&self, keys: &[String], pieces: &[Vec<(usize, usize)>]) -> Answer {
            if let Some(f) = &self.fail {
                return Err(f.clone());
            }
            Ok(keys
                .iter()
                .zip(pieces)
                .map(|(k, p)| {
                    if let Some(&c) = self.answer.borrow().get(k) {
                        return c;
                    }
                    let Some(v) = self.values.borrow().get(k).cloned() else { return -704 };
                    let want: usize = p.iter().map(|x| x.1).sum();
                    if v.len() > want {
                        return -600;
                    }
                    if v.len() < want {
                        return WRONG_LENGTH;
                    }
                    let mut at = 0;
                    for &(a, n) in p {
                        // SAFETY: test pieces are live for the call.
                        unsafe { std::ptr::copy_nonoverlapping(v[at..].as_ptr(), a as *mut u8, n) };
                        at += n;
                    }
                    v.len() as i64
                })
                .collect())
        }
        fn remove(&self, key: &str) -> std::result::Result<i64, Failure> {
            self.removed.borrow_mut().push(key.to_owned());
            Ok(if self.values.borrow_mut().remove(key).is_some() { 0 } else { -704 })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_store::MapStore;

    #[test]
    fn an_engines_objects_are_one_page_each_under_its_page_hash() {
        let f = EngineFormat::new("fp", b"").unwrap();
        let objects = f.objects(&["ab", "cd"], vec![vec![(0x1000, 8)], vec![(0x2000, 4), (0x3000, 4)]]).unwrap();
        let k = crate::index::chain::engine_page_key("cd");
        assert_eq!(objects[1].key, format!("kvtier/v{}/fp/g1/{k:032x}", crate::l3::FORMAT_VERSION));
        assert_eq!(
            (objects[1].chain_key, objects[1].pages.clone(), objects[1].bytes()),
            (k, vec![k], HEADER_BYTES + 8)
        );
        let err = f.objects(&["ab", "cd"], vec![vec![(0x1000, 8)]]).unwrap_err();
        assert_eq!(err.to_string(), "need the pieces of 2 pages, got 1 piece lists");
        assert!(f.objects(&["ab", ""], vec![vec![], vec![]]).unwrap_err().to_string().contains("page_hashes[1]"));
        for bad in ["", "a/b"] {
            let err = EngineFormat::new(bad, b"").unwrap_err();
            assert!(err.to_string().starts_with("fingerprint must be non-empty and without '/'"), "{err}");
        }
    }

    #[test]
    fn a_piece_outside_the_registered_memory_is_refused() {
        let object = |pieces: Vec<(usize, usize)>| Object {
            key: "k".into(),
            chain_key: 1,
            kind: ObjectKind::Group,
            pieces,
            pages: vec![1],
        };
        let mut regions = Regions::default();
        regions.add(0x1000, 0x100);
        regions.add(0x4000, 0x10);
        let inside = [object(vec![(0x1000, 0x100)]), object(vec![(0x1080, 0x10), (0x4000, 0x10)])];
        regions.check(&inside).unwrap();
        for bad in [(0x1000, 0x101), (0xff0, 0x20), (0x4008, 0x10), (0x2000, 1), (usize::MAX, 2)] {
            let err = regions.check(&[inside[0].clone(), object(vec![(0x1000, 1), bad])]).unwrap_err();
            assert!(err.to_string().starts_with("object 1 (k): its piece of"), "{err}");
        }
        assert!(Regions::default().check(&inside).is_err(), "nothing registered: nothing moves");
    }
    use super::*;

    fn objects(pages: &mut [Vec<u8>]) -> Vec<Object> {
        pages
            .iter_mut()
            .enumerate()
            .map(|(i, p)| Object {
                key: format!("k{i}"),
                chain_key: i as Key + 1,
                kind: ObjectKind::Group,
                pieces: vec![(p.as_mut_ptr() as usize, p.len())],
                pages: vec![i as Key + 1],
            })
            .collect()
    }

    fn paths() -> [ObjectPath; 2] {
        [ObjectPath::new(None).unwrap(), ObjectPath::new(Some(3 * (HEADER_BYTES + 64))).unwrap()]
    }

    #[test]
    fn every_code_is_listed_once_and_each_class_is_read_its_way() {
        let mut codes: Vec<i64> = CODES.iter().map(|c| c.code).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), CODES.len(), "a code is listed twice");
        assert_eq!(classify(-704), Missing);
        assert_eq!(classify(-600), WrongLength);
        assert_eq!(classify(WRONG_LENGTH), WrongLength);
        assert_eq!(classify(-200), NoSpace);
        for transient in [-800, -707, -900, RPC_TIMEOUT, STORE_RAISED, -12345] {
            assert_eq!(classify(transient), Transient, "{transient}");
        }
        let failing: Vec<i64> = CODES.iter().filter(|c| c.store_failing).map(|c| c.code).collect();
        assert_eq!(failing, vec![-800, -900, RPC_TIMEOUT]);
    }

    #[test]
    fn objects_round_trip_present_ones_are_not_sent_again() {
        for path in paths() {
            let fmt = ObjectFormat::new("fp", b"");
            let store = MapStore::default();
            let mut src: Vec<Vec<u8>> = (0..7).map(|i| vec![i as u8 + 1; 64]).collect();
            let put = path.put(&store, &fmt, &objects(&mut src)).unwrap();
            assert!(put.iter().all(|o| *o == PutOutcome::Stored), "{put:?}");
            assert!(path.put(&store, &fmt, &objects(&mut src)).unwrap().iter().all(|o| *o == PutOutcome::Present));
            let mut dst: Vec<Vec<u8>> = (0..7).map(|_| vec![0u8; 64]).collect();
            let got = path.get(&store, &fmt, &objects(&mut dst)).unwrap();
            assert!(got.iter().all(|o| *o == GetOutcome::Loaded), "{got:?}");
            assert_eq!(dst, src);
            let c = path.counters().snapshot();
            assert!(c.contains(&("l3_objects_put", 7)) && c.contains(&("l3_puts_present", 7)), "{c:?}");
            assert!(c.contains(&("l3_objects_loaded", 7)), "{c:?}");
        }
    }

    #[test]
    fn transient_codes_and_failed_calls_never_remove_an_object() {
        for path in paths() {
            let fmt = ObjectFormat::new("fp", b"");
            let mut store = MapStore::default();
            let mut src: Vec<Vec<u8>> = (0..4).map(|i| vec![i as u8; 64]).collect();
            path.put(&store, &fmt, &objects(&mut src)).unwrap();
            for (i, code) in [-800, -707, -900, RPC_TIMEOUT].into_iter().enumerate() {
                store.answer.borrow_mut().insert(format!("k{i}"), code);
            }
            let mut dst: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 64]).collect();
            let got = path.get(&store, &fmt, &objects(&mut dst)).unwrap();
            assert_eq!(
                got,
                vec![
                    GetOutcome::Lost(-800),
                    GetOutcome::Lost(-707),
                    GetOutcome::Lost(-900),
                    GetOutcome::Lost(RPC_TIMEOUT)
                ]
            );
            store.fail = Some(Failure { code: RPC_TIMEOUT, message: "timed out".into() });
            let got = path.get(&store, &fmt, &objects(&mut dst)).unwrap();
            assert!(got.iter().all(|o| *o == GetOutcome::Lost(RPC_TIMEOUT)), "{got:?}");
            assert!(store.removed.borrow().is_empty() && store.values.borrow().len() == 4);
        }
    }

    #[test]
    fn values_of_any_wrong_length_are_rejected_removed_and_put_again() {
        for path in paths() {
            let fmt = ObjectFormat::new("fp", b"");
            let store = MapStore::default();
            let mut src: Vec<Vec<u8>> = (0..3).map(|i| vec![i as u8; 64]).collect();
            path.put(&store, &fmt, &objects(&mut src)).unwrap();
            store.values.borrow_mut().get_mut("k0").unwrap().push(0); // one byte longer
            store.values.borrow_mut().get_mut("k1").unwrap().pop(); // one byte shorter
            let mut dst: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 64]).collect();
            let got = path.get(&store, &fmt, &objects(&mut dst)).unwrap();
            assert!(matches!(got[0], GetOutcome::Rejected { why: Reject::Length(-600), removed: true }), "{got:?}");
            assert!(
                matches!(got[1], GetOutcome::Rejected { why: Reject::Length(WRONG_LENGTH), removed: true }),
                "{got:?}"
            );
            assert_eq!(got[2], GetOutcome::Loaded);
            assert_eq!(dst[0], vec![0u8; 64], "a staged wrong object never reaches its pieces");
            let again = path.put(&store, &fmt, &objects(&mut src)).unwrap();
            assert_eq!(again, vec![PutOutcome::Stored, PutOutcome::Stored, PutOutcome::Present]);
            assert!(path.get(&store, &fmt, &objects(&mut dst)).unwrap().iter().all(|o| *o == GetOutcome::Loaded));
        }
    }

    #[test]
    fn an_object_checked_under_another_format_is_rejected_and_a_large_one_is_refused() {
        let path = ObjectPath::new(Some(HEADER_BYTES + 64)).unwrap();
        let store = MapStore::default();
        let mut src = vec![vec![5u8; 64]];
        path.put(&store, &ObjectFormat::new("a", b""), &objects(&mut src)).unwrap();
        let got = path.get(&store, &ObjectFormat::new("b", b""), &objects(&mut src)).unwrap();
        assert!(matches!(got[0], GetOutcome::Rejected { why: Reject::Fingerprint, .. }), "{got:?}");
        let mut big = vec![vec![0u8; 65]];
        let err = path.put(&store, &ObjectFormat::new("a", b""), &objects(&mut big)).unwrap_err();
        assert!(err.to_string().contains("l3_staging_bytes"), "{err}");
        assert!(ObjectPath::new(Some(HEADER_BYTES)).is_err());
    }

    #[test]
    fn batches_respect_header_slots_and_staging() {
        let staged = ObjectPath::new(Some(2 * (HEADER_BYTES + 64))).unwrap();
        let mut src: Vec<Vec<u8>> = (0..5).map(|_| vec![0u8; 64]).collect();
        let objs = objects(&mut src);
        assert_eq!(batches(&lock(&staged.put), objs.iter()), vec![0..2, 2..4, 4..5]);
        let zero = ObjectPath::new(None).unwrap();
        let mut many: Vec<Vec<u8>> = (0..HEADER_SLOTS + 1).map(|_| vec![0u8; 8]).collect();
        let objs = objects(&mut many);
        assert_eq!(batches(&lock(&zero.put), objs.iter()), vec![0..HEADER_SLOTS, HEADER_SLOTS..HEADER_SLOTS + 1]);
    }
}
