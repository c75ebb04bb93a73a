//! `kvtier._core.Cache`: the engine calls of a cache (rust/cache.rs), one call into the core each. The call runs
//! with the GIL released; the engine's callbacks (allocate, its state kernels) and reading a prompt held as a
//! Python list take it back for as long as they run. The first Python exception a callback or a prompt raised is
//! what the call raises, once the core has aborted whatever it had planned.
use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyString, PyTuple};

use crate::copy::PyPageCopier;
use crate::index::{PyIndex, PyReady};
use crate::{
    bad_argument, int, lock, namespace_bytes, non_negative, opt_int, raised_by, to_py, with_prompt, Ids, KvtierError,
    NeverType, Raised,
};
use kvtier::cache::{Allocation, Cache, Hooks, Request, Resumed, Stored};
use kvtier::error::{Error, Result};
use kvtier::executor::{block_table, Executor};

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCache>()?;
    Ok(())
}

/// The engine's callbacks of one call.
struct PyHooks<'a> {
    allocate: Option<Py<PyAny>>,
    state: Option<Py<PyAny>>,
    cache: &'a PyCache,
    raised: &'a Mutex<Raised>,
}

impl PyHooks<'_> {
    fn state_call(&self, f: &Option<Py<PyAny>>, row: usize, boundary: usize) -> Result<()> {
        Python::attach(|py| {
            let f = f.as_ref().ok_or_else(|| KvtierError::new_err("this cache has no state callbacks"))?;
            let rows =
                self.cache.staging.as_ref().ok_or_else(|| KvtierError::new_err("this cache has no staging rows"))?;
            let row = rows.bind(py).get_item(row)?;
            let state = self.state.as_ref().map(|s| s.clone_ref(py)).unwrap_or_else(|| py.None());
            f.bind(py).call1((state, boundary, row)).map(drop)
        })
        .map_err(|e| lock(self.raised).keep(e))
    }
}

impl Hooks for PyHooks<'_> {
    fn allocate(&mut self) -> Result<Allocation> {
        let allocate = self.allocate.as_ref().expect("resume passes allocate");
        Python::attach(|py| -> PyResult<Allocation> {
            let table = allocate.bind(py).call0().map_err(|e| raised_by(py, "allocate()", e))?;
            if table.is_none() {
                return Ok(Allocation::NotNow);
            }
            if table.is_instance_of::<NeverType>() {
                return Ok(Allocation::Never);
            }
            if table.is_instance_of::<PyBool>() {
                return Err(bad_argument("allocate() must return the block table or None, got a bool"));
            }
            block_ids(&table, "allocate()'s block table", self.cache.num_blocks).map(Allocation::Blocks)
        })
        .map_err(|e| lock(self.raised).keep(e))
    }
    fn select_state(&mut self, row: usize, boundary: usize) -> Result<()> {
        self.state_call(&self.cache.select_state, row, boundary)
    }
    fn load_state(&mut self, row: usize, boundary: usize) -> Result<()> {
        self.state_call(&self.cache.load_state, row, boundary)
    }
}

/// GPU block ids as the engine holds them (a list or tuple of ints, a 1-D integer numpy array, a CPU tensor
/// through numpy), as the core's `block_table` takes them.
pub(super) fn block_ids(obj: &Bound<'_, PyAny>, what: &str, num_blocks: u32) -> PyResult<Vec<i32>> {
    let py = obj.py();
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        // A subclass's own __len__ and __iter__ run here: what they raise is the caller's.
        let raised = |e| raised_by(py, what, e);
        let mut out = Vec::with_capacity(obj.len().map_err(raised)?);
        for (i, item) in obj.try_iter().map_err(raised)?.enumerate() {
            let item = item.map_err(raised)?;
            let v: i64 = if item.is_instance_of::<PyBool>() { None } else { item.extract().ok() }.ok_or_else(|| {
                let ty = item.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                bad_argument(format!("{what}[{i}] must be an int, got {ty} {item:?}"))
            })?;
            out.push(v);
        }
        return block_table(out, what, num_blocks).map_err(to_py);
    }
    if obj.is_instance_of::<PyString>() {
        return Err(bad_argument(format!("{what} must be a sequence of ints or an integer array, got str")));
    }
    let ty = obj.get_type().name()?.to_string();
    let not_ids =
        |why: String| bad_argument(format!("{what} must be a sequence of ints or an integer array, got {ty}{why}"));
    let arr = match obj.cast::<PyUntypedArray>() {
        Ok(a) => a.clone(),
        Err(_) => {
            // numpy reads the object through its own __len__, __iter__ or __array__: what they raise is the cause.
            let view = py.import("numpy")?.getattr("asarray")?.call1((obj,)).map_err(|e| {
                let out = not_ids(format!(" ({e})"));
                out.set_cause(py, Some(e));
                out
            })?;
            let view = view.cast_into::<PyUntypedArray>().map_err(|e| not_ids(format!(" ({e})")))?;
            if !matches!(view.dtype().kind(), b'i' | b'u') {
                return Err(not_ids(format!(" (of dtype {})", view.dtype())));
            }
            view
        }
    };
    if !matches!(arr.dtype().kind(), b'i' | b'u') {
        return Err(bad_argument(format!("{what} must hold integers, got dtype {}", arr.dtype())));
    }
    if arr.ndim() != 1 {
        return Err(bad_argument(format!("{what} must be 1-D, got shape {:?}", arr.shape())));
    }
    let wide = arr.call_method1("astype", ("int64",))?;
    let wide = wide.cast::<PyArray1<i64>>()?.try_readonly()?;
    block_table(wide.as_array().iter().copied(), what, num_blocks).map_err(to_py)
}

/// The engine calls of one cache: its index (shared with an L3 tier) and its executor (the host pools' copiers,
/// the copy streams, the completion queue). `select_state(state, pos, staging_row)` and `load_state(state, pos,
/// staging_row)` are the engine's state kernels, `staging_rows` the staging buffer's rows (torch tensors), for
/// models with state.
#[pyclass(name = "Cache", module = "kvtier._core", frozen)]
pub struct PyCache {
    inner: Cache,
    index: Py<PyIndex>,
    block_size: usize,
    num_blocks: u32,
    select_state: Option<Py<PyAny>>,
    load_state: Option<Py<PyAny>>,
    staging: Option<Py<PyAny>>,
    /// The copiers the executor copies through: they hold the memory of the GPU pool.
    _copiers: Vec<Py<PyPageCopier>>,
}

impl PyCache {
    fn cache(&self) -> &Cache {
        &self.inner
    }

    /// Runs `f` on the core with the GIL released, the prompt's ids and a keeper of the first Python exception.
    fn with_prompt<R: Send>(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        f: impl for<'a> FnOnce(&Cache, &mut Ids<'a>, &'a Mutex<Raised>) -> Result<R> + Send,
    ) -> PyResult<R> {
        with_prompt(py, token_ids, self.block_size, |ids, raised| f(self.cache(), ids, raised))
    }
}

#[pymethods]
impl PyCache {
    #[classattr]
    const MISS: i64 = 0;
    #[classattr]
    const RETRY: i64 = -1;
    /// What `resume` answers when the request should consult L3 first (nothing was allocated).
    #[classattr]
    const FETCH: i64 = -2;

    #[new]
    #[pyo3(signature = (index, pages, *, parts=None, states=None, copy_streams=true, layerwise_loads=false,
        select_state=None, load_state=None, staging_rows=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        index: Py<PyIndex>,
        pages: &Bound<'_, PyPageCopier>,
        parts: Option<&Bound<'_, PyPageCopier>>,
        states: Option<&Bound<'_, PyPageCopier>>,
        copy_streams: bool,
        layerwise_loads: bool,
        select_state: Option<Py<PyAny>>,
        load_state: Option<Py<PyAny>>,
        staging_rows: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let shared = Arc::clone(index.get().shared());
        let block_size = kvtier::cache::lock(&shared).config().block_size;
        let copier = |c: &Bound<'_, PyPageCopier>| c.get().copier();
        let exec = Executor::new(copier(pages), parts.map(copier), states.map(copier), copy_streams, layerwise_loads)
            .map_err(to_py)?;
        let inner = Cache::new(shared, exec).map_err(to_py)?;
        if inner.executor().states().is_some()
            && (select_state.is_none() || load_state.is_none() || staging_rows.is_none())
        {
            return Err(bad_argument("a cache with states needs select_state, load_state and staging_rows"));
        }
        let num_blocks = inner.executor().pages().pool().num_blocks;
        let copiers = [Some(pages), parts, states].into_iter().flatten().map(|c| c.clone().unbind()).collect();
        Ok(Self {
            inner,
            index,
            block_size,
            num_blocks,
            select_state,
            load_state,
            staging: staging_rows,
            _copiers: copiers,
        })
    }

    #[getter]
    fn index(&self, py: Python<'_>) -> Py<PyIndex> {
        self.index.clone_ref(py)
    }
    /// Whether copies run on kvtier's own copy streams.
    #[getter]
    fn copy_streams(&self) -> bool {
        self.cache().executor().copy_streams()
    }
    #[getter]
    fn layerwise_loads(&self) -> bool {
        self.cache().executor().layerwise_loads()
    }
    /// The raw cudaStream_t of stores and of loads (0 without copy streams).
    #[getter]
    fn streams(&self) -> (u64, u64) {
        self.cache().executor().stream_handles()
    }
    /// The layer parts a layer-wise load is issued in (and `wait_layer` takes).
    #[getter]
    fn num_layers(&self) -> usize {
        self.cache().executor().num_layers()
    }
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// Copies launched and not yet retired.
    #[getter]
    fn copies_in_flight(&self) -> usize {
        self.cache().executor().pending()
    }

    /// Switches layer-wise loads on or off between loads (they need copy streams).
    fn set_layerwise_loads(&self, on: bool) -> PyResult<()> {
        self.cache().executor().set_layerwise_loads(on).map_err(to_py)
    }

    /// A seam for fault tests: `fault()` is called before each copy batch, and a true answer makes the batch fail
    /// as a failed launch does (CopyError). None removes it.
    fn set_copy_fault(&self, fault: Option<Py<PyAny>>) {
        let hook = fault.map(|f| -> kvtier::executor::CopyFault {
            Box::new(move || {
                Python::attach(|py| f.bind(py).call0().and_then(|r| r.is_truthy()))
                    .map_err(|e| Error::Hook(e.to_string()))
            })
        });
        self.cache().executor().set_copy_fault(hook);
    }

    /// Looks the prompt up and, on a hit, fills the sequence's first blocks (and state) from the host: the hit's
    /// tokens, `MISS`, `RETRY` (allocate() returned None) or `FETCH` (with `fetch_group_pages`, the L3 tier's
    /// group size: whole groups lie beyond the host's ready run; nothing was allocated). A hit compares every
    /// token with the request's chain first. `allocate()` returns the sequence's block table or None (not now);
    /// a RuntimeError means never (a miss). `stream`: the engine's raw cudaStream_t (0 on the CPU).
    #[pyo3(signature = (request_id, token_ids, *, allocate, state=None, namespace=None, stream=0,
        fetch_group_pages=None))]
    #[allow(clippy::too_many_arguments)]
    fn resume(
        &self,
        py: Python<'_>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        allocate: Py<PyAny>,
        state: Option<Py<PyAny>>,
        namespace: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = int)] stream: u64,
        #[pyo3(from_py_with = opt_int)] fetch_group_pages: Option<i64>,
    ) -> PyResult<i64> {
        if !allocate.bind(py).is_callable() {
            return Err(bad_argument(format!(
                "allocate must be callable, got {}",
                allocate.bind(py).get_type().name()?
            )));
        }
        let ns = namespace_bytes(namespace)?;
        let group = fetch_group_pages.map(|g| non_negative::<usize>("fetch_group_pages", g)).transpose()?;
        let out = self.with_prompt(py, token_ids, |cache, ids, raised| {
            let mut hooks = PyHooks { allocate: Some(allocate), state, cache: self, raised };
            cache.resume(Request { id: request_id, namespace: &ns }, ids, &mut hooks, stream, group.filter(|&g| g > 0))
        })?;
        Ok(match out {
            Resumed::Hit(n) => n as i64,
            Resumed::Miss => Self::MISS,
            Resumed::Retry => Self::RETRY,
            Resumed::Fetch { .. } => Self::FETCH,
        })
    }

    /// The write-through store of a prompt whose prefill has run (see rust/cache.rs): "copying", "present",
    /// "skipped" or "skipped_pinning" (the host pool was still being pinned).
    #[pyo3(signature = (request_id, token_ids, block_table, *, seq_len=None, state=None, namespace=None, stream=0))]
    #[allow(clippy::too_many_arguments)]
    fn store(
        &self,
        py: Python<'_>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        block_table: &Bound<'_, PyAny>,
        seq_len: Option<&Bound<'_, PyAny>>,
        state: Option<Py<PyAny>>,
        namespace: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = int)] stream: u64,
    ) -> PyResult<&'static str> {
        let ns = namespace_bytes(namespace)?;
        let table = block_ids(block_table, "block_table", self.num_blocks)?;
        let seq_len = seq_len.map(|v| count(v, "seq_len")).transpose()?;
        let out = self.with_prompt(py, token_ids, |cache, ids, raised| {
            let mut hooks = PyHooks { allocate: None, state, cache: self, raised };
            cache.store(Request { id: request_id, namespace: &ns }, ids, &table, seq_len, &mut hooks, stream)
        })?;
        Ok(match out {
            Stored::Copying => "copying",
            Stored::Present => "present",
            Stored::Skipped { pinning: false } => "skipped",
            Stored::Skipped { pinning: true } => "skipped_pinning",
        })
    }

    /// Retires finished copies (never blocks); returns what each completed store made ready (for an L3 tier).
    fn poll(&self, py: Python<'_>) -> PyResult<Vec<PyReady>> {
        let ready = py.detach(|| self.cache().poll()).map_err(to_py)?;
        Ok(ready.into_iter().map(PyReady::from).collect())
    }

    /// Before layer part `layer` reads its KV: the engine's stream waits (GPU-side) for its layer-wise loads.
    #[pyo3(signature = (layer, *, stream=0))]
    fn wait_layer(&self, layer: &Bound<'_, PyAny>, #[pyo3(from_py_with = int)] stream: u64) -> PyResult<()> {
        self.cache().wait_layer(layer_index(layer)?, stream).map_err(to_py)
    }

    /// Whether `wait_layer(layer)` (None: `wait_loads`) has a load to wait for (the layer checked as there).
    #[pyo3(signature = (layer=None))]
    fn waiting(&self, layer: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        self.cache().waiting(layer.map(layer_index).transpose()?).map_err(to_py)
    }

    /// `wait_layer` for every layer part.
    #[pyo3(signature = (*, stream=0))]
    fn wait_loads(&self, #[pyo3(from_py_with = int)] stream: u64) -> PyResult<()> {
        self.cache().wait_loads(stream).map_err(to_py)
    }

    /// Before the engine rewrites `blocks`: its stream waits (GPU-side) for the pending stores that read them.
    #[pyo3(signature = (blocks, *, stream=0))]
    fn release(&self, blocks: &Bound<'_, PyAny>, #[pyo3(from_py_with = int)] stream: u64) -> PyResult<()> {
        let blocks = block_ids(blocks, "blocks", self.num_blocks)?;
        self.cache().release(&blocks, stream).map_err(to_py)
    }

    /// The request is gone: the engine's stream waits for its pending stores and its chain is dropped. Returns
    /// whether the index knew it.
    #[pyo3(signature = (request_id, *, stream=0))]
    fn forget(&self, request_id: &str, #[pyo3(from_py_with = int)] stream: u64) -> PyResult<bool> {
        self.cache().forget(request_id, stream).map_err(to_py)
    }

    /// Waits (GIL released) for every copy in flight and completes its ticket; returns what became ready.
    fn drain(&self, py: Python<'_>) -> PyResult<Vec<PyReady>> {
        let ready = py.detach(|| self.cache().drain()).map_err(to_py)?;
        Ok(ready.into_iter().map(PyReady::from).collect())
    }
}

/// A non-negative int argument (not a bool) below 2**63.
fn count(v: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    let n = if v.is_instance_of::<PyBool>() { None } else { v.extract::<i64>().ok() };
    match n {
        Some(n) if n >= 0 => non_negative(what, n),
        Some(_) => Err(bad_argument(format!("{what} must be in [0, 2**63), got {v:?}"))),
        None if v.is_instance_of::<pyo3::types::PyInt>() && !v.is_instance_of::<PyBool>() => {
            Err(bad_argument(format!("{what} must be in [0, 2**63), got {v:?}")))
        }
        None => {
            let ty = v.get_type().name()?.to_string();
            Err(bad_argument(format!("{what} must be an int, got {ty} {v:?}")))
        }
    }
}

/// An engine's layer index: an int, not a bool.
fn layer_index(layer: &Bound<'_, PyAny>) -> PyResult<i64> {
    let l = if layer.is_instance_of::<PyBool>() { None } else { layer.extract::<i64>().ok() };
    l.ok_or_else(|| bad_argument(format!("layer must be an int, got {layer:?}")))
}
