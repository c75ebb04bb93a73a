//! `kvtier._core.Index` and the L3 helpers.
use std::sync::MutexGuard;

use numpy::PyArray1;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::{
    bad_argument, int, int32s, namespace_bytes, non_negative, opt_int, raised_by, slots_array, to_py, with_prompt,
};
use kvtier::cache::{full_blocks, lookup, Prompt as _, Request, SharedIndex};
use kvtier::index::chain::{Check, HashKind, TokenIds};
use kvtier::index::events::Event;
use kvtier::index::policy::Policy;
use kvtier::index::pool::PolicyState;
use kvtier::index::{Config, Index, Ready};

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyIndexConfig>()?;
    m.add_class::<PyIndex>()?;
    m.add_class::<PyLookup>()?;
    m.add_class::<PyLoadPlan>()?;
    m.add_class::<PyStorePlan>()?;
    m.add_class::<PyReady>()?;
    m.add_class::<PyKvEvent>()?;
    m.add_class::<PyKeyAnswers>()?;
    m.add_class::<PyPolicyState>()?;
    m.add("EVICTION_POLICIES", Policy::NAMES.to_vec())?;
    m.add("HASH_KINDS", HashKind::NAMES.to_vec())?;
    Ok(())
}

type SlotTriple = (u64, Vec<Option<u32>>, Vec<Option<u32>>);

/// The index of one cache: chains, host page and state pools, planning, statistics. Thread-safe; calls that
/// hash release the GIL.
#[pyclass(name = "Index", module = "kvtier._core", frozen)]
pub struct PyIndex {
    inner: SharedIndex,
}

/// What a completed store made ready: the prompt's first `pages` pages and states at `state_pages` (pages).
#[pyclass(name = "Ready", module = "kvtier._core", frozen)]
pub struct PyReady {
    pub(super) inner: Ready,
}

impl From<Ready> for PyReady {
    fn from(inner: Ready) -> Self {
        Self { inner }
    }
}

#[pymethods]
impl PyReady {
    #[getter]
    fn pages(&self) -> usize {
        self.inner.page_keys.len()
    }
    #[getter]
    fn state_pages(&self) -> Vec<usize> {
        self.inner.state_pages.clone()
    }
    fn __repr__(&self) -> String {
        format!("Ready(pages={}, state_pages={:?})", self.inner.page_keys.len(), self.inner.state_pages)
    }
}

/// What the host holds for a prompt: `hit_tokens` (0 for a miss), the ready run before snapping to a state
/// boundary, and the keep_tokens cap, in pages.
#[pyclass(name = "Lookup", module = "kvtier._core", frozen, get_all)]
pub struct PyLookup {
    hit_tokens: usize,
    ready_pages: usize,
    limit_pages: usize,
}

#[pymethods]
impl PyLookup {
    fn __repr__(&self) -> String {
        format!(
            "Lookup(hit_tokens={}, ready_pages={}, limit_pages={})",
            self.hit_tokens, self.ready_pages, self.limit_pages
        )
    }
}

/// A load begun: host slots of pages 0.. and the state slot, pinned until `complete` or `abort` of `ticket`.
#[pyclass(name = "LoadPlan", module = "kvtier._core", frozen, get_all)]
pub struct PyLoadPlan {
    ticket: u64,
    hit_tokens: usize,
    page_slots: Py<PyArray1<i32>>,
    state_slot: Option<u32>,
}

/// A store planned: copy prompt page `page_indices[i]` (GPU block `src_blocks[i]` when a block table was given)
/// into host slot `page_slots[i]`, and the state at `state_boundaries[j]` tokens into `state_slots[j]`; then
/// `complete(ticket)`, or `abort(ticket)` if the copies failed.
#[pyclass(name = "StorePlan", module = "kvtier._core", frozen, get_all)]
pub struct PyStorePlan {
    ticket: u64,
    page_indices: Py<PyArray1<i32>>,
    page_slots: Py<PyArray1<i32>>,
    src_blocks: Option<Py<PyArray1<i32>>>,
    state_boundaries: Vec<usize>,
    state_slots: Py<PyArray1<i32>>,
}

type KeyStoreTuple<'py> = (u64, Option<Vec<u32>>, Bound<'py, PyArray1<i32>>, Vec<Bound<'py, PyBytes>>);

/// `Index.key_answers`: one engine key's state on the host, answered with the engine's own objects.
#[pyclass(name = "KeyAnswers", module = "kvtier._core", frozen)]
pub struct PyKeyAnswers {
    index: Py<PyIndex>,
    answers: [Py<PyAny>; 3],
}

#[pymethods]
impl PyKeyAnswers {
    /// The answer for `key` (bytes of 1 to 64); `req_context` (the engine's request context, named as vLLM names
    /// it) is not read.
    #[pyo3(signature = (key, req_context=None))]
    fn lookup(&self, py: Python<'_>, key: &[u8], req_context: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
        let _ = req_context;
        let state = self.index.get().lock().lookup_key(key).map_err(to_py)?;
        Ok(self.answers[state as usize].clone_ref(py))
    }
}

/// Engine keys copied out of a sequence of bytes objects into one buffer (the GIL is released while the index
/// works on them, and another thread may change the sequence meanwhile).
struct PackedKeys {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl PackedKeys {
    fn views(&self) -> Vec<&[u8]> {
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let key = &self.bytes[start..end];
                start = end;
                key
            })
            .collect()
    }
}

/// A sequence of bytes objects, copied (the GIL is released while the index works on them).
fn engine_keys(keys: &Bound<'_, PyAny>) -> PyResult<PackedKeys> {
    if keys.is_instance_of::<PyBytes>() || keys.is_instance_of::<pyo3::types::PyString>() {
        return Err(bad_argument(format!(
            "keys must be a sequence of bytes objects, got one {}",
            keys.get_type().name()?
        )));
    }
    let n = keys.len().unwrap_or(0);
    let mut out = PackedKeys { bytes: Vec::with_capacity(n * 40), ends: Vec::with_capacity(n) };
    let mut add = |i: usize, k: &Bound<'_, PyAny>| -> PyResult<()> {
        let b = k.cast::<PyBytes>().map_err(|_| {
            let t = k.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            bad_argument(format!("keys[{i}] must be bytes, got {t}"))
        })?;
        out.bytes.extend_from_slice(b.as_bytes());
        out.ends.push(out.bytes.len());
        Ok(())
    };
    // A list (what engines pass) is read in place; any other iterable through the iterator protocol.
    if let Ok(list) = keys.cast::<PyList>() {
        for (i, k) in list.iter().enumerate() {
            add(i, &k)?;
        }
    } else {
        let raised = |e| raised_by(keys.py(), "keys", e);
        for (i, k) in keys.try_iter().map_err(raised)?.enumerate() {
            add(i, &k.map_err(raised)?)?;
        }
    }
    Ok(out)
}

/// Pages stored into (`removed` false) or removed from a tier (`medium` "CPU": the host pool, "STORAGE": L3),
/// with the log's sequence number (a gap means events were dropped). `keys` are the pages' keys as bytes (the
/// engine's key for pages stored by engine key, else the chain key, 16 bytes big-endian), in prompt order for a
/// store.
#[pyclass(name = "KvEvent", module = "kvtier._core", frozen, get_all)]
pub struct PyKvEvent {
    seq: u64,
    removed: bool,
    medium: &'static str,
    keys: Vec<Py<PyBytes>>,
}

impl PyKvEvent {
    fn new(py: Python<'_>, e: Event) -> Self {
        let keys = if e.names.is_empty() {
            e.keys.iter().map(|k| PyBytes::new(py, &k.to_be_bytes()).unbind()).collect()
        } else {
            e.names.iter().map(|n| PyBytes::new(py, n).unbind()).collect()
        };
        Self { seq: e.seq, removed: e.removed, medium: e.medium.name(), keys }
    }
}

#[pymethods]
impl PyKvEvent {
    fn __repr__(&self) -> String {
        format!(
            "KvEvent(seq={}, removed={}, medium={:?}, keys=<{}>)",
            self.seq,
            self.removed,
            self.medium,
            self.keys.len()
        )
    }
}

/// A pool's eviction lists as the policy keeps them: evictable keys of probation and protected (least recent
/// first; `lru` has probation only), the ghost keys of each (oldest first) and probation's target size in
/// sixteenths of a slot.
#[pyclass(name = "PolicyState", module = "kvtier._core", frozen, get_all)]
pub struct PyPolicyState {
    probation: Vec<u128>,
    protected: Vec<u128>,
    probation_ghosts: Vec<u128>,
    protected_ghosts: Vec<u128>,
    target: u64,
}

impl From<PolicyState> for PyPolicyState {
    fn from(s: PolicyState) -> Self {
        Self {
            probation: s.probation,
            protected: s.protected,
            probation_ghosts: s.probation_ghosts,
            protected_ghosts: s.protected_ghosts,
            target: s.target,
        }
    }
}

/// A count of host slots: non-negative and below 2**31 (slot ids are int32 on the Python side).
fn slot_count(name: &str, v: i64) -> PyResult<u32> {
    let n: u32 = non_negative(name, v)?;
    if n > i32::MAX as u32 {
        return Err(bad_argument(format!("{name} must be < 2**31, got {v}")));
    }
    Ok(n)
}

/// Everything that decides an index's behaviour, given once: `Index(IndexConfig(page_slots, ...))`. Every value is
/// checked here; `min_hit_tokens=None` means two blocks.
#[pyclass(name = "IndexConfig", module = "kvtier._core", frozen)]
pub struct PyIndexConfig {
    cfg: Config,
}

#[pymethods]
impl PyIndexConfig {
    #[new]
    #[pyo3(signature = (page_slots, *, state_slots=0, block_size=16, keep_tokens=1, min_hit_tokens=None,
        state_lookback_blocks=4, ring_slack=0, hash_kind="blake3", hash_key=None, eviction_policy="lru",
        event_buffer=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        #[pyo3(from_py_with = int)] page_slots: i64,
        #[pyo3(from_py_with = int)] state_slots: i64,
        #[pyo3(from_py_with = int)] block_size: i64,
        #[pyo3(from_py_with = int)] keep_tokens: i64,
        #[pyo3(from_py_with = opt_int)] min_hit_tokens: Option<i64>,
        #[pyo3(from_py_with = int)] state_lookback_blocks: i64,
        #[pyo3(from_py_with = int)] ring_slack: i64,
        hash_kind: &str,
        hash_key: Option<&Bound<'_, PyAny>>,
        eviction_policy: &str,
        #[pyo3(from_py_with = int)] event_buffer: i64,
    ) -> PyResult<Self> {
        let block_size: usize = non_negative("block_size", block_size)?;
        let cfg = Config {
            page_slots: slot_count("page_slots", page_slots)?,
            state_slots: slot_count("state_slots", state_slots)?,
            block_size,
            keep_tokens: non_negative("keep_tokens", keep_tokens)?,
            min_hit_tokens: match min_hit_tokens {
                Some(v) => non_negative("min_hit_tokens", v)?,
                None => 2 * block_size,
            },
            state_lookback_blocks: non_negative("state_lookback_blocks", state_lookback_blocks)?,
            ring_slack: non_negative("ring_slack", ring_slack)?,
            hash_kind: HashKind::parse(hash_kind).map_err(to_py)?,
            hash_key: namespace_bytes(hash_key)?,
            eviction_policy: Policy::parse(eviction_policy).map_err(to_py)?,
            event_buffer: non_negative("event_buffer", event_buffer)?,
        };
        cfg.validate().map_err(to_py)?;
        Ok(Self { cfg })
    }

    #[getter]
    fn page_slots(&self) -> u32 {
        self.cfg.page_slots
    }
    #[getter]
    fn state_slots(&self) -> u32 {
        self.cfg.state_slots
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    #[getter]
    fn keep_tokens(&self) -> usize {
        self.cfg.keep_tokens
    }
    #[getter]
    fn min_hit_tokens(&self) -> usize {
        self.cfg.min_hit_tokens
    }
    #[getter]
    fn state_lookback_blocks(&self) -> usize {
        self.cfg.state_lookback_blocks
    }
    #[getter]
    fn ring_slack(&self) -> usize {
        self.cfg.ring_slack
    }
    #[getter]
    fn hash_kind(&self) -> &'static str {
        self.cfg.hash_kind.name()
    }
    #[getter]
    fn eviction_policy(&self) -> &'static str {
        self.cfg.eviction_policy.name()
    }
    #[getter]
    fn event_buffer(&self) -> usize {
        self.cfg.event_buffer
    }

    fn __repr__(&self) -> String {
        let c = &self.cfg;
        format!(
            "IndexConfig(page_slots={}, state_slots={}, block_size={}, keep_tokens={}, min_hit_tokens={}, \
             state_lookback_blocks={}, ring_slack={}, hash_kind={:?}, eviction_policy={:?}, event_buffer={})",
            c.page_slots,
            c.state_slots,
            c.block_size,
            c.keep_tokens,
            c.min_hit_tokens,
            c.state_lookback_blocks,
            c.ring_slack,
            c.hash_kind.name(),
            c.eviction_policy.name(),
            c.event_buffer
        )
    }
}

/// A model version: a non-empty str (UTF-8) or bytes.
fn version_bytes(v: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let b = if let Ok(s) = v.cast::<pyo3::types::PyString>() {
        s.to_str()?.as_bytes().to_vec()
    } else if let Ok(b) = v.cast::<pyo3::types::PyBytes>() {
        b.as_bytes().to_vec()
    } else {
        return Err(bad_argument(format!("model version must be str or bytes, got {}", v.get_type().name()?)));
    };
    if b.is_empty() {
        return Err(bad_argument("model version must not be empty"));
    }
    Ok(b)
}

impl PyIndex {
    pub(super) fn lock(&self) -> MutexGuard<'_, Index> {
        kvtier::cache::lock(&self.inner)
    }

    /// The index itself, for a cache or a planner that shares it.
    pub(super) fn shared(&self) -> &SharedIndex {
        &self.inner
    }

    /// Runs `f` on the index and every id of the prompt with the GIL released (an array read in place).
    fn with_ids<R: Send>(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        f: impl FnOnce(&mut Index, &dyn TokenIds) -> kvtier::error::Result<R> + Send,
    ) -> PyResult<R> {
        let bs = self.lock().config().block_size;
        with_prompt(py, token_ids, bs, |ids, _| {
            let t = ids.ids(Check::Full, 0)?;
            f(&mut self.lock(), t)
        })
    }
}

#[pymethods]
impl PyIndex {
    #[new]
    #[pyo3(signature = (config, *, usable_page_slots=None, usable_state_slots=None))]
    fn new(
        config: &PyIndexConfig,
        #[pyo3(from_py_with = opt_int)] usable_page_slots: Option<i64>,
        #[pyo3(from_py_with = opt_int)] usable_state_slots: Option<i64>,
    ) -> PyResult<Self> {
        let cfg = config.cfg.clone();
        let usable_pages = match usable_page_slots {
            Some(v) => slot_count("usable_page_slots", v)?,
            None => cfg.page_slots,
        };
        let usable_states = match usable_state_slots {
            Some(v) => slot_count("usable_state_slots", v)?,
            None => cfg.state_slots,
        };
        let index = Index::new(cfg, usable_pages, usable_states).map_err(to_py)?;
        Ok(Self { inner: std::sync::Arc::new(std::sync::Mutex::new(index)) })
    }

    #[getter]
    fn page_slots(&self) -> u32 {
        self.lock().config().page_slots
    }
    #[getter]
    fn state_slots(&self) -> u32 {
        self.lock().config().state_slots
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.lock().config().block_size
    }
    #[getter]
    fn keep_tokens(&self) -> usize {
        self.lock().config().keep_tokens
    }
    #[getter]
    fn hash_kind(&self) -> &'static str {
        self.lock().config().hash_kind.name()
    }
    #[getter]
    fn eviction_policy(&self) -> &'static str {
        self.lock().config().eviction_policy.name()
    }
    /// A short public digest of the hash key (fingerprints differ per key without revealing it).
    #[getter]
    fn key_id(&self) -> String {
        self.lock().hasher().key_id()
    }

    /// The model version every key is derived under (a checkpoint revision the deployment vouches for). A new
    /// version retires everything of the old one: evictable entries now, entries in use when their copies finish;
    /// copies in flight never make an entry ready, and requests seen before serve and store nothing until
    /// forgotten. Returns whether the version changed.
    fn set_model_version(&self, version: &Bound<'_, PyAny>) -> PyResult<bool> {
        let v = version_bytes(version)?;
        Ok(self.lock().set_model_version(&v))
    }

    #[getter]
    fn model_version<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        pyo3::types::PyBytes::new(py, self.lock().model_version())
    }

    /// More host slots are usable now (a pin step of the lazily allocated host pool is ready).
    fn grow(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = int)] usable_page_slots: i64,
        #[pyo3(from_py_with = int)] usable_state_slots: i64,
    ) -> PyResult<()> {
        let p: u32 = non_negative("usable_page_slots", usable_page_slots)?;
        let s: u32 = non_negative("usable_state_slots", usable_state_slots)?;
        py.detach(|| self.lock().grow(p, s));
        Ok(())
    }

    /// Hashes the prompt into the request's chain and returns its block keys. A request's tokens only grow until
    /// `forget`: a known request's prompt must extend every token hashed (PromptMismatchError otherwise), and only
    /// its new full blocks are hashed.
    #[pyo3(signature = (request_id, token_ids, *, namespace=None))]
    fn chain(
        &self,
        py: Python<'_>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u128>> {
        let ns = namespace_bytes(namespace)?;
        self.with_ids(py, token_ids, |ix, t| ix.chain(request_id, &ns, t, Check::Full).map(<[u128]>::to_vec))
    }

    /// The block keys hashed so far for a request.
    fn keys(&self, request_id: &str) -> PyResult<Vec<u128>> {
        self.lock().keys(request_id).map(<[u128]>::to_vec).map_err(to_py)
    }

    /// What a resume of this prompt would restore now. A request is counted in the lookup statistics once,
    /// however often it is retried. The prompt must extend what was hashed for the request (see `chain`): its
    /// first and last hashed blocks are compared, so that a call for a request already hashed costs its new tokens
    /// and the pages walked, not the prompt; with `verify` (a hit is loaded next) a hit also compares every hashed
    /// token.
    #[pyo3(signature = (request_id, token_ids, *, namespace=None, verify=false))]
    fn lookup(
        &self,
        py: Python<'_>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        verify: bool,
    ) -> PyResult<PyLookup> {
        let ns = namespace_bytes(namespace)?;
        let bs = self.lock().config().block_size;
        let request = Request { id: request_id, namespace: &ns };
        let l = with_prompt(py, token_ids, bs, |ids, _| lookup(&self.inner, request, ids, verify))?;
        Ok(PyLookup { hit_tokens: l.hit_tokens, ready_pages: l.ready_pages, limit_pages: l.limit_pages })
    }

    /// What `lookup` would answer now, keeping nothing (no chain, no statistics).
    #[pyo3(signature = (token_ids, *, namespace=None))]
    fn peek(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyLookup> {
        let ns = namespace_bytes(namespace)?;
        let l = self.with_ids(py, token_ids, |ix, t| ix.peek(&ns, t))?;
        Ok(PyLookup { hit_tokens: l.hit_tokens, ready_pages: l.ready_pages, limit_pages: l.limit_pages })
    }

    /// Compares every token hashed for the request with the prompt (PromptMismatchError when it does not extend
    /// them); `lookup(verify=True)` does this for a hit.
    #[pyo3(signature = (request_id, token_ids, *, namespace=None))]
    fn verify(
        &self,
        py: Python<'_>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ns = namespace_bytes(namespace)?;
        self.with_ids(py, token_ids, |ix, t| ix.verify(request_id, &ns, t))
    }

    /// A hit could not be resumed now (no GPU blocks); nothing is touched.
    fn defer(&self, request_id: &str) -> PyResult<()> {
        self.lock().defer(request_id).map_err(to_py)
    }

    /// Pins the pages (and state) of a hit for a host -> GPU copy; raises StaleLookupError if they left the host.
    fn begin_load(
        &self,
        py: Python<'_>,
        request_id: &str,
        #[pyo3(from_py_with = int)] hit_tokens: i64,
    ) -> PyResult<PyLoadPlan> {
        let hit: usize = non_negative("hit_tokens", hit_tokens)?;
        let plan = self.lock().begin_load(request_id, hit).map_err(to_py)?;
        Ok(PyLoadPlan {
            ticket: plan.ticket,
            hit_tokens: plan.hit_tokens,
            page_slots: slots_array(py, &plan.page_slots).unbind(),
            state_slot: plan.state_slot,
        })
    }

    /// Plans the write-through store of a prompt (see StorePlan). `seq_len` (default: the prompt length) is the
    /// sequence's length now, for the ring constraint of states. With `block_table`, `src_blocks` gives the GPU
    /// block of each page to copy.
    #[pyo3(signature = (request_id, token_ids, *, seq_len=None, namespace=None, block_table=None))]
    fn plan_store(
        &self,
        py: Python<'_>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = opt_int)] seq_len: Option<i64>,
        namespace: Option<&Bound<'_, PyAny>>,
        block_table: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStorePlan> {
        let ns = namespace_bytes(namespace)?;
        let seq_len: Option<usize> = seq_len.map(|v| non_negative("seq_len", v)).transpose()?;
        let table = block_table.map(|b| int32s(b, "block_table")).transpose()?;
        let bt = table.as_ref().map(|t| t.as_slice());
        let plan = self.with_ids(py, token_ids, |ix, t| {
            if let Some(bt) = bt {
                full_blocks(bt, t.len(), ix.config().block_size, "block_table")?;
            }
            ix.plan_store(request_id, &ns, t, seq_len.unwrap_or(t.len()))
        })?;
        let src_blocks = table.map(|table| {
            let bt = table.as_slice();
            PyArray1::from_iter(py, plan.page_indices.iter().map(|&i| bt[i as usize])).unbind()
        });
        Ok(PyStorePlan {
            ticket: plan.ticket,
            page_indices: slots_array(py, &plan.page_indices).unbind(),
            page_slots: slots_array(py, &plan.page_slots).unbind(),
            src_blocks,
            state_boundaries: plan.state_boundaries,
            state_slots: slots_array(py, &plan.state_slots).unbind(),
        })
    }

    /// The copies of a ticket finished: stored entries become ready, references drop. Returns what a store made
    /// ready (for the L3 write-behind), None for other tickets.
    fn complete(&self, #[pyo3(from_py_with = int)] ticket: u64) -> PyResult<Option<PyReady>> {
        Ok(self.lock().complete(ticket).map_err(to_py)?.map(PyReady::from))
    }

    /// The copies of a ticket failed: stored entries are discarded, held ones released.
    fn abort(&self, #[pyo3(from_py_with = int)] ticket: u64) -> PyResult<()> {
        self.lock().abort(ticket).map_err(to_py)
    }

    /// Pins the ready entries of these keys while an L3 put reads them: `(ticket, page_slots, state_slots)`,
    /// None for a key not ready on the host. `complete(ticket)` releases them.
    fn hold(&self, py: Python<'_>, page_keys: Vec<u128>, state_keys: Vec<u128>) -> PyResult<SlotTriple> {
        let p = py.detach(|| self.lock().hold(&page_keys, &state_keys)).map_err(to_py)?;
        Ok((p.ticket, p.page_slots, p.state_slots))
    }

    /// Reserves fresh slots for pages and states fetched from L3 (keys already on the host get None), all or
    /// none: `(ticket, page_slots, state_slots)`, or None when the pools cannot make room. Complete the ticket
    /// once the bytes are in; abort it if the get failed.
    fn plan_fetch(&self, py: Python<'_>, page_keys: Vec<u128>, state_keys: Vec<u128>) -> PyResult<Option<SlotTriple>> {
        let p = py.detach(|| self.lock().plan_fetch(&page_keys, &state_keys)).map_err(to_py)?;
        Ok(p.map(|p| (p.ticket, p.page_slots, p.state_slots)))
    }

    /// How many of the engine's keys (a prompt's pages in order, bytes of 1 to 64) are ready on the host from the
    /// first, and whether the next one is being stored: `(hits, pending)`. Nothing is held.
    fn lookup_keys(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<(usize, bool)> {
        let keys = engine_keys(keys)?;
        let l = py.detach(|| self.lock().lookup_keys(&keys.views())).map_err(to_py)?;
        Ok((l.hits, l.pending))
    }

    /// Holds the pages of these engine keys for a host -> GPU copy (every one ready, else ValueError naming the
    /// first that is not, and nothing is held): `(ticket, page_slots)`, the slots an int32 array. Complete or
    /// abort the ticket.
    fn load_keys<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<(u64, Bound<'py, PyArray1<i32>>)> {
        let keys = engine_keys(keys)?;
        let p = py.detach(|| self.lock().load_keys(&keys.views())).map_err(to_py)?;
        let slots: Vec<u32> = p.page_slots.into_iter().flatten().collect();
        Ok((p.ticket, slots_array(py, &slots)))
    }

    /// Reports the host -> GPU copies of these engine keys done, each to the oldest `load_keys` ticket in flight
    /// that named it; a ticket completes once each of its keys is reported. Returns how many completed. A key
    /// reported more often than loads of it are in flight raises BadArgument naming it, and nothing is reported.
    fn complete_load_keys(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = engine_keys(keys)?;
        py.detach(|| self.lock().complete_load_keys(&keys.views())).map_err(to_py)
    }

    /// Plans a GPU -> host store of the pages of these engine keys: `(ticket, indices, slots, evicted)`, the
    /// positions of the keys to copy (those not on the host yet; None when that is every key, in order) with the
    /// slot each goes to (an int32 array), and the engine keys evicted to make room; None when the pool cannot
    /// take them all (nothing changes). Report the keys' copies with `complete_keys`, or complete the ticket once
    /// the copies are done and abort it if they failed.
    fn store_keys<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<Option<KeyStoreTuple<'py>>> {
        let keys = engine_keys(keys)?;
        let n = keys.ends.len();
        let Some(p) = py.detach(|| self.lock().store_keys(&keys.views())).map_err(to_py)? else { return Ok(None) };
        let evicted = p.evicted.iter().map(|k| PyBytes::new(py, k.as_bytes())).collect();
        let indices = if p.indices.len() == n { None } else { Some(p.indices) };
        Ok(Some((p.ticket, indices, slots_array(py, &p.slots), evicted)))
    }

    /// Where one engine key stands on the host: 0 absent, 1 being stored, 2 ready. Not counted as a lookup
    /// (`key_answers` counts).
    fn key_state(&self, key: &[u8]) -> PyResult<u8> {
        Ok(self.lock().key_state(key).map_err(to_py)? as u8)
    }

    /// Reports the copies of these engine keys done (`ok`) or failed: `(matched, due)`, how many of them belonged
    /// to a store in flight (each key belongs to the `store_keys` call that planned its copy until reported once;
    /// others are ignored), and the stores all of whose keys are now reported, oldest first, as `(ticket,
    /// failed)`. Complete each due ticket that did not fail, abort each that did.
    fn complete_keys(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, ok: bool) -> PyResult<(usize, Vec<(u64, bool)>)> {
        let keys = engine_keys(keys)?;
        let done = py.detach(|| self.lock().complete_keys(&keys.views(), ok)).map_err(to_py)?;
        Ok((done.matched, done.due))
    }

    /// A callable `answers.lookup(key, req_context=None)` for an engine that asks about one key a call and wants
    /// its own objects back: `absent`, `pending` or `ready` (see `key_state`), counted as a lookup of one block.
    fn key_answers(slf: Py<Self>, absent: Py<PyAny>, pending: Py<PyAny>, ready: Py<PyAny>) -> PyKeyAnswers {
        PyKeyAnswers { index: slf, answers: [absent, pending, ready] }
    }

    /// Drops a request's chain; returns whether the request was known.
    fn forget(&self, request_id: &str) -> bool {
        self.lock().forget(request_id)
    }

    /// The KV events recorded since the last call, oldest first (none unless `event_buffer` > 0): host pages
    /// made ready or evicted, and the L3 tier's reports. Beyond `event_buffer` events the oldest are dropped
    /// (`events_dropped` in `stats()`).
    fn take_events(&self, py: Python<'_>) -> Vec<PyKvEvent> {
        let events = self.lock().take_events();
        events.into_iter().map(|e| PyKvEvent::new(py, e)).collect()
    }

    /// The L3 tier stored the objects holding these pages (or, `removed`, found them gone): recorded as
    /// "STORAGE" events.
    fn record_storage(&self, removed: bool, page_keys: Vec<u128>) {
        self.lock().record_storage(removed, page_keys);
    }

    /// Counts an error handled by the caller.
    fn count_error(&self) {
        self.lock().count_error();
    }

    /// Counters, pool occupancy and the token hit rate.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ix = self.lock();
        let d = PyDict::new(py);
        for (k, v) in ix.stat_values() {
            d.set_item(k, v)?;
        }
        d.set_item("token_hit_rate", ix.stats().token_hit_rate())?;
        Ok(d)
    }

    /// Evictable page keys, least recently used first (under `adaptive`, both lists merged).
    fn page_lru(&self) -> Vec<u128> {
        self.lock().pages().lru_keys()
    }

    /// State keys in eviction order, least recent first.
    fn state_lru(&self) -> Vec<u128> {
        self.lock().states().lru_keys()
    }

    /// The page pool's eviction lists, ghosts and target.
    fn page_policy(&self) -> PyPolicyState {
        self.lock().pages().policy_state().into()
    }

    /// The state pool's eviction lists, ghosts and target.
    fn state_policy(&self) -> PyPolicyState {
        self.lock().states().policy_state().into()
    }

    /// `(key, refs, ready)` of a page slot, or None when the slot is free.
    fn page_entry(&self, #[pyo3(from_py_with = int)] slot: u32) -> Option<(u128, u32, bool)> {
        self.lock().pages().entry(slot).map(|e| (e.key, e.refs, e.ready))
    }

    /// `(key, refs, ready)` of a state slot, or None when the slot is free.
    fn state_entry(&self, #[pyo3(from_py_with = int)] slot: u32) -> Option<(u128, u32, bool)> {
        self.lock().states().entry(slot).map(|e| (e.key, e.refs, e.ready))
    }

    /// Host page slot of a key, or None.
    fn page_slot(&self, key: u128) -> Option<u32> {
        self.lock().pages().slot_of(key)
    }

    /// Host state slot of a key, or None.
    fn state_slot(&self, key: u128) -> Option<u32> {
        self.lock().states().slot_of(key)
    }

    /// Raises KvtierError if any invariant of the pools or the tickets is broken.
    fn check(&self) -> PyResult<()> {
        self.lock().check().map_err(to_py)
    }
}
