//! `kvtier._core.L3Planner` (the L3 tier's planning and jobs, rust/l3/plan.rs), `ObjectPath` (the one object path,
//! rust/l3/path.rs) and the Python Store client as the core's `Store`.
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::copy::PyHostPool;
use crate::dlpack::host_region;
use crate::index::{PyIndex, PyReady};
use crate::objects::PyObjectFormat;
use crate::{bad_argument, int, lock, namespace_bytes, non_negative, opt_int, to_py};
use kvtier::l3;
use kvtier::l3::path::{
    self as l3path, Answer, CodeClass, Failure, GetOutcome, Object, ObjectPath, PutOutcome, Regions, Store,
};
use kvtier::l3::plan::{Fetched, HostPools, Planner, Tier};

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyL3Planner>()?;
    m.add_class::<PyObjectPath>()?;
    m.add_class::<PyOutcome>()?;
    m.add_class::<PyPutReport>()?;
    m.add_class::<PyFetchReport>()?;
    m.add_function(wrap_pyfunction!(fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(part_digests, m)?)?;
    m.add("DIGEST_PART_BYTES", l3::DIGEST_PART_BYTES)?;
    m.add("L3_FORMAT_VERSION", l3::FORMAT_VERSION)?;
    m.add("L3_HEADER_BYTES", l3::HEADER_BYTES)?;
    let codes: Vec<(i64, &str, &str, bool)> =
        l3path::CODES.iter().map(|c| (c.code, c.name, class_name(c.class), c.store_failing)).collect();
    m.add("L3_CODES", codes)?;
    Ok(())
}

fn class_name(c: CodeClass) -> &'static str {
    match c {
        CodeClass::Missing => "missing",
        CodeClass::WrongLength => "wrong_length",
        CodeClass::NoSpace => "no_space",
        CodeClass::Transient => "transient",
    }
}

/// The layout fingerprint of L3 keys: a hash of every field that changes the bytes behind a key, the object
/// format version and the chain's key scheme.
#[pyfunction]
fn fingerprint(fields: std::collections::BTreeMap<String, String>) -> PyResult<String> {
    l3::fingerprint(&fields.into_iter().collect::<Vec<_>>()).map_err(to_py)
}

/// The BLAKE3 digests of each `DIGEST_PART_BYTES` part of a 1-D contiguous numpy uint8 array, concatenated;
/// digested on several threads with the GIL released.
#[pyfunction]
fn part_digests<'py>(
    py: Python<'py>,
    data: numpy::PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let bytes = data.as_slice().map_err(|_| bad_argument("part_digests needs a contiguous uint8 array"))?;
    let parts = py.detach(|| l3::part_digests(bytes));
    Ok(pyo3::types::PyBytes::new(py, &parts.concat()))
}

/// A Python Store client (python/kvtier/l3/store.py's `Store` protocol) as the core's `Store`. Each call takes the
/// GIL for the call only. A client's `L3Error` is the Store's failure (its code, RPC_FAIL without one); after an
/// `L3Timeout` the call waits until the native call returned (its `pending` future), so the buffers are free when
/// the path reuses them; any other exception is `STORE_RAISED`.
struct PyStore<'a>(&'a Py<PyAny>);

impl PyStore<'_> {
    fn failure(py: Python<'_>, e: PyErr) -> Failure {
        let message = e.to_string();
        let l3_error = py.import("kvtier.l3.errors").and_then(|m| m.getattr("L3Error")).ok();
        let value = e.value(py);
        if l3_error.is_some_and(|cls| value.is_instance(&cls).unwrap_or(false)) {
            if let Ok(pending) = value.getattr("pending") {
                // The native call may still use the buffers: wait until it returned (GIL released while waiting).
                let _ = pending.call_method0("exception");
            }
            let code = value.getattr("code").and_then(|c| c.extract::<Option<i64>>()).ok().flatten();
            return Failure { code: code.unwrap_or(-900), message };
        }
        Failure { code: l3path::STORE_RAISED, message }
    }

    fn batch(&self, method: &str, keys: &[String], pieces: Option<&[Vec<(usize, usize)>]>) -> Answer {
        Python::attach(|py| {
            let store = self.0.bind(py);
            let called = match pieces {
                None => store.call_method1(method, (keys.to_vec(),)),
                Some(pieces) => {
                    let ptrs: Vec<Vec<usize>> = pieces.iter().map(|p| p.iter().map(|x| x.0).collect()).collect();
                    let sizes: Vec<Vec<usize>> = pieces.iter().map(|p| p.iter().map(|x| x.1).collect()).collect();
                    store.call_method1(method, (keys.to_vec(), ptrs, sizes))
                }
            };
            let codes = called.and_then(|r| r.extract::<Vec<i64>>()).map_err(|e| Self::failure(py, e))?;
            if codes.len() != keys.len() {
                return Err(Failure {
                    code: l3path::STORE_RAISED,
                    message: format!("{method} answered {} codes for {} keys", codes.len(), keys.len()),
                });
            }
            Ok(codes)
        })
    }
}

impl Store for PyStore<'_> {
    fn exists(&self, keys: &[String]) -> Answer {
        self.batch("exists_many", keys, None)
    }
    fn put(&self, keys: &[String], pieces: &[Vec<(usize, usize)>]) -> Answer {
        self.batch("put_many", keys, Some(pieces))
    }
    fn get(&self, keys: &[String], pieces: &[Vec<(usize, usize)>]) -> Answer {
        self.batch("get_many", keys, Some(pieces))
    }
    fn remove(&self, key: &str) -> std::result::Result<i64, Failure> {
        Python::attach(|py| {
            self.0
                .bind(py)
                .call_method1("remove", (key, true))
                .and_then(|r| r.extract::<i64>())
                .map_err(|e| Self::failure(py, e))
        })
    }
}

/// What the object path did with one object: `kind` is "stored", "present" or "failed" (a put), "loaded",
/// "missing", "lost" or "rejected" (a get); `code` the Store's code of a failed or lost object; `reason` why one
/// was rejected, and `removed` whether it was removed from the Store.
#[pyclass(name = "Outcome", module = "kvtier._core", frozen, get_all)]
pub struct PyOutcome {
    kind: &'static str,
    code: Option<i64>,
    reason: Option<String>,
    removed: bool,
}

#[pymethods]
impl PyOutcome {
    /// Whether the object is now in the Store (stored, present) or whole and verified in its pieces (loaded).
    #[getter]
    fn ok(&self) -> bool {
        matches!(self.kind, "stored" | "present" | "loaded")
    }
    fn __repr__(&self) -> String {
        format!("Outcome({}, code={:?}, reason={:?}, removed={})", self.kind, self.code, self.reason, self.removed)
    }
}

impl From<&PutOutcome> for PyOutcome {
    fn from(o: &PutOutcome) -> Self {
        let (kind, code) = match o {
            PutOutcome::Stored => ("stored", None),
            PutOutcome::Present => ("present", None),
            PutOutcome::Failed(c) => ("failed", Some(*c)),
        };
        Self { kind, code, reason: None, removed: false }
    }
}

impl From<&GetOutcome> for PyOutcome {
    fn from(o: &GetOutcome) -> Self {
        match o {
            GetOutcome::Loaded => Self { kind: "loaded", code: None, reason: None, removed: false },
            GetOutcome::Missing => Self { kind: "missing", code: Some(-704), reason: None, removed: false },
            GetOutcome::Lost(c) => Self { kind: "lost", code: Some(*c), reason: None, removed: false },
            GetOutcome::Rejected { why, removed } => {
                Self { kind: "rejected", code: None, reason: Some(why.to_string()), removed: *removed }
            }
        }
    }
}

fn counters(py: Python<'_>, path: &ObjectPath) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in path.counters().snapshot() {
        d.set_item(k, v)?;
    }
    Ok(d.unbind())
}

/// The one L3 object path of an engine's own objects, each one page under the engine's page hash (SGLang's
/// HiCache pages, vLLM's CPU chunks): batching, header slots, staging (`staging_bytes`; None moves objects
/// zero-copy), sealing, the check of what a get read and the removal of objects that fail it run in the core
/// (rust/l3/path.rs), with the GIL released but for the Store's own calls.
#[pyclass(name = "ObjectPath", module = "kvtier._core", frozen)]
pub struct PyObjectPath {
    inner: ObjectPath,
    /// The memory objects may move from and into (`add_memory`), and the DLPack capsules that keep it alive.
    memory: Mutex<(Regions, Vec<Py<PyAny>>)>,
}

/// `(address, bytes)` payload pieces of each page, checked once at the boundary.
type Pieces = Vec<Vec<(usize, usize)>>;

impl PyObjectPath {
    /// The engine's objects of one call, their pieces checked against the registered memory and `memory`, and
    /// the capsules that hold `memory` for the call.
    fn objects(
        &self,
        fmt: &PyObjectFormat,
        hashes: Vec<String>,
        pieces: Pieces,
        memory: &[Bound<'_, PyAny>],
    ) -> PyResult<(Vec<Object>, Vec<Py<PyAny>>)> {
        let objects = fmt.engine().objects(&hashes, pieces).map_err(to_py)?;
        let mut regions = lock(&self.memory).0.clone();
        let mut held = Vec::with_capacity(memory.len());
        for (i, m) in memory.iter().enumerate() {
            let ((addr, bytes), owner) = host_region(m, &format!("memory[{i}]"))?;
            regions.add(addr, bytes);
            held.push(owner);
        }
        regions.check(&objects).map_err(to_py)?;
        Ok((objects, held))
    }
}

#[pymethods]
impl PyObjectPath {
    #[new]
    #[pyo3(signature = (*, staging_bytes=None))]
    fn new(#[pyo3(from_py_with = opt_int)] staging_bytes: Option<i64>) -> PyResult<Self> {
        let staging = staging_bytes.map(|b| non_negative("staging_bytes", b)).transpose()?;
        Ok(Self { inner: ObjectPath::new(staging).map_err(to_py)?, memory: Mutex::default() })
    }
    /// Registers host memory objects may move from and into (a CPU tensor or array with `__dlpack__`: an engine's
    /// host pool), held for the path's life. Every piece a put or get names must lie inside registered memory.
    fn add_memory(&self, memory: &Bound<'_, PyAny>) -> PyResult<()> {
        let ((addr, bytes), owner) = host_region(memory, "memory")?;
        let mut m = lock(&self.memory);
        m.0.add(addr, bytes);
        m.1.push(owner);
        Ok(())
    }
    /// `(address, bytes)` of the buffers the Store must have registered: the staging buffers, or zero-copy the
    /// header slots (and then the pages' memory too).
    fn buffers(&self) -> Vec<(usize, usize)> {
        self.inner.buffers()
    }
    #[getter]
    fn zero_copy(&self) -> bool {
        self.inner.zero_copy()
    }
    /// The path's counters, named as in `kvtier.STATS` (`l3_*`).
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        counters(py, &self.inner)
    }
    /// Puts each page (its engine hash, its payload `(address, bytes)` pieces, unwritten by the caller for the
    /// call) as one object sealed by `fmt`, unless the Store has it: one `Outcome` a page. Each piece must lie in
    /// registered memory (`add_memory`) or in `memory`, buffers held for this call.
    #[pyo3(signature = (store, fmt, hashes, pieces, *, memory=Vec::new()))]
    fn put(
        &self,
        py: Python<'_>,
        store: Py<PyAny>,
        fmt: &PyObjectFormat,
        hashes: Vec<String>,
        pieces: Pieces,
        memory: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<PyOutcome>> {
        let (objects, _held) = self.objects(fmt, hashes, pieces, &memory)?;
        let out = py.detach(|| self.inner.put(&PyStore(&store), fmt.engine().format(), &objects)).map_err(to_py)?;
        Ok(out.iter().map(PyOutcome::from).collect())
    }
    /// Gets each page's object into its pieces (the caller's to write for the call; in registered memory or in
    /// `memory`, as for `put`) and checks it with `fmt`; an object that fails is removed from the Store. One
    /// `Outcome` a page.
    #[pyo3(signature = (store, fmt, hashes, pieces, *, memory=Vec::new()))]
    fn get(
        &self,
        py: Python<'_>,
        store: Py<PyAny>,
        fmt: &PyObjectFormat,
        hashes: Vec<String>,
        pieces: Pieces,
        memory: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<PyOutcome>> {
        let (objects, _held) = self.objects(fmt, hashes, pieces, &memory)?;
        let out = py.detach(|| self.inner.get(&PyStore(&store), fmt.engine().format(), &objects)).map_err(to_py)?;
        Ok(out.iter().map(PyOutcome::from).collect())
    }
}

/// What a write-behind put did: `objects` planned, `present` the Store had, `failed` `(key, code)` not stored.
#[pyclass(name = "PutReport", module = "kvtier._core", frozen, get_all)]
pub struct PyPutReport {
    objects: usize,
    present: usize,
    failed: Vec<(String, i64)>,
}

/// How a fetch ended: `outcome` is "miss", "failed" (the exists() call: `error`), "admitted" (`pages`, `states`,
/// `bytes` now ready) or "refused" (`missing` keys, `lost` `(key, code)`, `rejected` `(key, reason, removed)`);
/// `exists_s` and `get_s` the seconds of its Store calls.
#[pyclass(name = "FetchReport", module = "kvtier._core", frozen, get_all)]
pub struct PyFetchReport {
    outcome: &'static str,
    error: Option<(i64, String)>,
    pages: usize,
    states: usize,
    bytes: usize,
    missing: Vec<String>,
    lost: Vec<(String, i64)>,
    rejected: Vec<(String, String, bool)>,
    exists_s: f64,
    get_s: f64,
}

/// The L3 planner of one cache over its `Index` and host pools, and its object path; see rust/l3/plan.rs. It holds
/// the pools: every address it hands the Store lies in slots they have backed.
#[pyclass(name = "L3Planner", module = "kvtier._core", frozen)]
pub struct PyL3Planner {
    index: Py<PyIndex>,
    inner: Mutex<Planner>,
    path: ObjectPath,
    group_pages: usize,
}

impl PyL3Planner {
    fn tier(&self) -> Tier<'_> {
        Tier { planner: &self.inner, index: self.index.get().shared(), path: &self.path }
    }
}

#[pymethods]
impl PyL3Planner {
    #[new]
    #[pyo3(signature = (index, fingerprint, *, group_pages, pages, states=None, hash_key=None, seen_keys=1 << 20,
        scratch_pages=None, staging_bytes=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        index: Py<PyIndex>,
        fingerprint: &str,
        #[pyo3(from_py_with = int)] group_pages: i64,
        pages: &PyHostPool,
        states: Option<&PyHostPool>,
        hash_key: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = int)] seen_keys: i64,
        #[pyo3(from_py_with = opt_int)] scratch_pages: Option<i64>,
        #[pyo3(from_py_with = opt_int)] staging_bytes: Option<i64>,
    ) -> PyResult<Self> {
        let group_pages: usize = non_negative("group_pages", group_pages)?;
        let host = HostPools { pages: pages.pool().clone(), states: states.map(|s| s.pool().clone()) };
        let scratch = scratch_pages.map(|v| non_negative("scratch_pages", v)).transpose()?;
        let staging: Option<usize> = staging_bytes.map(|b| non_negative("staging_bytes", b)).transpose()?;
        let planner = Planner::new(
            fingerprint,
            &namespace_bytes(hash_key)?,
            group_pages,
            host,
            non_negative("seen_keys", seen_keys)?,
            scratch,
        )
        .map_err(to_py)?;
        let path = planner.object_path(staging).map_err(to_py)?;
        Ok(Self { index, inner: Mutex::new(planner), path, group_pages })
    }

    #[getter]
    fn fingerprint(&self) -> String {
        lock(&self.inner).fingerprint().to_owned()
    }
    #[getter]
    fn group_pages(&self) -> usize {
        self.group_pages
    }
    /// `(address, bytes)` of the memory the Store must have registered: the staging buffers, or zero-copy the host
    /// pools, the header slots and the scratch pages.
    fn buffers(&self) -> Vec<(usize, usize)> {
        lock(&self.inner).registered(&self.path)
    }
    /// Whether objects move straight from and into the host pools (the Store then registers them).
    #[getter]
    fn zero_copy(&self) -> bool {
        self.path.zero_copy()
    }
    /// The object path's counters (`l3_*`).
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        counters(py, &self.path)
    }
    /// A new fingerprint (the model version changed); nothing is remembered as seen any more. Puts and fetches
    /// already planned keep the fingerprint they were planned under.
    fn set_fingerprint(&self, py: Python<'_>, fingerprint: &str) -> PyResult<()> {
        // The planner's lock is only ever taken with the GIL released (a job holds it without the GIL).
        py.detach(|| lock(&self.inner).set_fingerprint(fingerprint)).map_err(to_py)
    }
    /// The Store key of the group whose last page has this chain key.
    fn group_key(&self, py: Python<'_>, last_page_key: u128) -> String {
        py.detach(|| lock(&self.inner).group_key(last_page_key))
    }
    /// The Store key of the state after the page with this chain key.
    fn state_key(&self, py: Python<'_>, page_key: u128) -> String {
        py.detach(|| lock(&self.inner).state_key(page_key))
    }

    /// The write-behind of what a store made ready, through `store` (the Store client): None when nothing is new.
    fn put(&self, py: Python<'_>, store: Py<PyAny>, ready: &PyReady) -> PyResult<Option<PyPutReport>> {
        let report = py.detach(|| self.tier().put(&PyStore(&store), &ready.inner)).map_err(to_py)?;
        Ok(report.map(|r| PyPutReport { objects: r.objects, present: r.present, failed: r.failed }))
    }

    /// The request's fetch through `store`, from its last lookup; its slots become ready only when every object
    /// checked.
    fn fetch(&self, py: Python<'_>, store: Py<PyAny>, request_id: &str) -> PyResult<PyFetchReport> {
        let report = py.detach(|| self.tier().fetch(&PyStore(&store), request_id)).map_err(to_py)?;
        let mut out = PyFetchReport {
            outcome: "miss",
            error: None,
            pages: 0,
            states: 0,
            bytes: 0,
            missing: Vec::new(),
            lost: Vec::new(),
            rejected: Vec::new(),
            exists_s: report.exists_s,
            get_s: report.get_s,
        };
        match report.fetched {
            Fetched::Miss => {}
            Fetched::Failed(f) => (out.outcome, out.error) = ("failed", Some((f.code, f.message))),
            Fetched::Admitted { pages, states, bytes } => {
                (out.outcome, out.pages, out.states, out.bytes) = ("admitted", pages, states, bytes);
            }
            Fetched::Refused { missing, lost, rejected } => {
                out.outcome = "refused";
                out.missing = missing;
                out.lost = lost;
                out.rejected = rejected.into_iter().map(|(k, why, removed)| (k, why.to_string(), removed)).collect();
            }
        }
        Ok(out)
    }
}
