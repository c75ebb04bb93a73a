//! Python classes of the copy path: `HostPool`, `PageCopier` (over layer tensors read through DLPack;
//! python/kvtier/copy.py wraps it for an engine's pool), `CompletionQueue`, the copy streams' `CopyStream` and
//! `CopyEvent`, and `JobCopier` (copy jobs on three lanes, for an engine that names its own transfers).
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::dlpack::layer_tensor;
use crate::{bad_argument, int, int32s, lock, non_negative, opt_int, to_py};
use kvtier::executor::copy::{self, CompletionQueue, CopyOptions, Direction, GpuPool, Method, PageCopier};
use kvtier::executor::cuda::{self, Event, Stream};
use kvtier::executor::hostmem::{self, HostPool};
use kvtier::executor::jobs::{Jobs, Lane, Piece};

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyHostPool>()?;
    m.add_class::<PyPageCopier>()?;
    m.add_class::<PyCompletionQueue>()?;
    m.add_class::<PyCopyStream>()?;
    m.add_class::<PyCopyEvent>()?;
    m.add_class::<PyJobCopier>()?;
    m.add_function(wrap_pyfunction!(dma_supported, m)?)?;
    m.add("COPY_METHODS", Method::NAMES.to_vec())?;
    m.add("PIN_METHODS", hostmem::PinMethod::NAMES.to_vec())?;
    Ok(())
}

/// Host memory for `slots` slots of `slot_bytes`, reserved as one range and backed and pinned one pin step
/// (`step_bytes`) at a time, the way `pin_method` says (rust/executor/hostmem.rs).
#[pyclass(name = "HostPool", module = "kvtier._core", frozen)]
pub struct PyHostPool {
    inner: Arc<HostPool>,
}

impl PyHostPool {
    pub(crate) fn pool(&self) -> &Arc<HostPool> {
        &self.inner
    }
}

#[pymethods]
impl PyHostPool {
    #[new]
    #[pyo3(signature = (slots, slot_bytes, *, step_bytes = None, pin = None, pin_method = "auto"))]
    fn new(
        #[pyo3(from_py_with = int)] slots: i64,
        #[pyo3(from_py_with = int)] slot_bytes: i64,
        #[pyo3(from_py_with = opt_int)] step_bytes: Option<i64>,
        pin: Option<bool>,
        pin_method: &str,
    ) -> PyResult<Self> {
        let step_bytes = step_bytes.unwrap_or(hostmem::DEFAULT_STEP_BYTES as i64);
        let pool = HostPool::new(
            non_negative("slots", slots)?,
            non_negative("slot_bytes", slot_bytes)?,
            non_negative("step_bytes", step_bytes)?,
            pin,
            pin_method.parse().map_err(to_py)?,
        )
        .map_err(to_py)?;
        Ok(Self { inner: Arc::new(pool) })
    }

    #[getter]
    fn slots(&self) -> u32 {
        self.inner.slots()
    }

    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.inner.slot_bytes()
    }

    #[getter]
    fn step_bytes(&self) -> u64 {
        self.inner.step_bytes()
    }

    #[getter]
    fn pinned(&self) -> bool {
        self.inner.pinned()
    }

    /// How the memory is pinned: "driver", "register" or "none".
    #[getter]
    fn pinning(&self) -> &'static str {
        self.inner.pinning().name()
    }

    #[getter]
    fn base_ptr(&self) -> u64 {
        self.inner.base_ptr()
    }

    #[getter]
    fn usable_slots(&self) -> u32 {
        self.inner.usable_slots()
    }

    #[getter]
    fn backed_bytes(&self) -> u64 {
        self.inner.backed_bytes()
    }

    /// Back and pin the next pin step (the GIL is released meanwhile); returns usable_slots after it.
    fn grow_step(&self, py: Python<'_>) -> PyResult<u32> {
        py.detach(|| self.inner.grow_step()).map_err(to_py)
    }

    /// Grow until at least `slots` slots are usable (or the pool is full); returns usable_slots.
    fn grow_to(&self, py: Python<'_>, #[pyo3(from_py_with = int)] slots: i64) -> PyResult<u32> {
        let slots = non_negative("slots", slots)?;
        py.detach(|| self.inner.grow_to(slots)).map_err(to_py)
    }

    /// A copy of one usable slot's bytes.
    fn read<'py>(&self, py: Python<'py>, #[pyo3(from_py_with = int)] slot: i64) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.inner.read(non_negative("slot", slot)?).map_err(to_py)?;
        Ok(PyBytes::new(py, &data))
    }

    /// Overwrite the start of one usable slot with `data`.
    fn write(&self, #[pyo3(from_py_with = int)] slot: i64, data: &[u8]) -> PyResult<()> {
        self.inner.write(non_negative("slot", slot)?, data).map_err(to_py)
    }

    /// Unpin and unmap the memory; no copy may still be in flight. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.close()).map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "HostPool(slots={}, slot_bytes={}, usable_slots={}, pinning='{}')",
            self.inner.slots(),
            self.inner.slot_bytes(),
            self.inner.usable_slots(),
            self.inner.pinning().name()
        )
    }
}

/// Copies pages between a GPU pool, given as its layer tensors (objects with `__dlpack__`: torch tensors
/// `[num_blocks, segment_bytes]` of uint8, one device, one shape), and a `HostPool`. The tensors' memory is read
/// through DLPack and held for the copier's life; every block id a copy names is checked against the tensors'
/// shape. `kvtier.copy.PageCopier` wraps it for an engine's pool.
#[pyclass(name = "PageCopier", module = "kvtier._core", frozen)]
pub struct PyPageCopier {
    inner: PageCopier,
    /// The layers' DLPack capsules: they keep the memory the copier reaches alive.
    _owners: Vec<Py<PyAny>>,
}

#[pymethods]
impl PyPageCopier {
    #[new]
    #[pyo3(signature = (
        layers, host, *, ctas = None, threads = None, method = "auto", crossover_bytes = None, store_ctas = None,
        store_method = None, piece_bytes = None
    ))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one a copy option
    fn new(
        layers: Vec<Bound<'_, PyAny>>,
        host: &Bound<'_, PyHostPool>,
        #[pyo3(from_py_with = opt_int)] ctas: Option<i64>,
        #[pyo3(from_py_with = opt_int)] threads: Option<i64>,
        method: &str,
        #[pyo3(from_py_with = opt_int)] crossover_bytes: Option<i64>,
        #[pyo3(from_py_with = opt_int)] store_ctas: Option<i64>,
        store_method: Option<&str>,
        #[pyo3(from_py_with = opt_int)] piece_bytes: Option<i64>,
    ) -> PyResult<Self> {
        let (tensors, owners): (Vec<_>, Vec<_>) = layers
            .iter()
            .enumerate()
            .map(|(i, t)| layer_tensor(t, &format!("layers[{i}]")))
            .collect::<PyResult<Vec<_>>>()?
            .into_iter()
            .unzip();
        let pool = GpuPool::of_layers(&tensors).map_err(to_py)?;
        let ctas = ctas.map_or(Ok(copy::DEFAULT_CTAS), |b| non_negative("ctas", b))?;
        let method = Method::parse(method).map_err(to_py)?;
        let opts = CopyOptions {
            ctas,
            threads: threads.map_or(Ok(copy::DEFAULT_THREADS), |t| non_negative("threads", t))?,
            method,
            store_ctas: store_ctas.map_or(Ok(ctas), |b| non_negative("store_ctas", b))?,
            store_method: store_method.map_or(Ok(method), Method::parse).map_err(to_py)?,
            crossover_bytes: crossover_bytes
                .map_or(Ok(copy::DEFAULT_CROSSOVER_BYTES), |c| non_negative("crossover_bytes", c))?,
            piece_bytes: piece_bytes.map_or(Ok(u64::MAX), |b| non_negative("piece_bytes", b))?,
            debug_sync: std::env::var("KVTIER_DEBUG_SYNC").is_ok_and(|v| v == "1"),
        };
        // SAFETY: each layer's memory is the DLPack tensor it was read from, of `num_blocks` rows of `stride` bytes
        // (the last row `segment_bytes`), and its capsule is held by this object for its whole life (a cache that
        // copies through it holds this object too); the HostPool's memory is kept by the Arc.
        let inner = unsafe { PageCopier::new(pool, Arc::clone(&host.get().inner), opts) }.map_err(to_py)?;
        Ok(Self { inner, _owners: owners })
    }

    /// GPU blocks -> host slots; launched on `stream` (a raw cudaStream_t) without waiting, or copied before
    /// returning on a CPU pool. `layers` (start, end) copies those layers' segments only. Returns what carried the
    /// batch: "kernel", "dma" or "memcpy".
    #[pyo3(signature = (gpu_ids, host_slots, stream = 0, layers = None))]
    fn to_host(
        &self,
        py: Python<'_>,
        gpu_ids: &Bound<'_, PyAny>,
        host_slots: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = int)] stream: u64,
        layers: Option<(i64, i64)>,
    ) -> PyResult<&'static str> {
        self.copy(py, Direction::ToHost, gpu_ids, host_slots, stream, layers)
    }

    /// Host slots -> GPU blocks; see `to_host`.
    #[pyo3(signature = (host_slots, gpu_ids, stream = 0, layers = None))]
    fn to_gpu(
        &self,
        py: Python<'_>,
        host_slots: &Bound<'_, PyAny>,
        gpu_ids: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = int)] stream: u64,
        layers: Option<(i64, i64)>,
    ) -> PyResult<&'static str> {
        self.copy(py, Direction::ToGpu, gpu_ids, host_slots, stream, layers)
    }

    #[getter]
    fn ctas(&self) -> u32 {
        self.inner.options().ctas
    }

    #[getter]
    fn store_ctas(&self) -> u32 {
        self.inner.options().store_ctas
    }

    #[getter]
    fn store_method(&self) -> &'static str {
        self.inner.options().store_method.name()
    }

    #[getter]
    fn threads(&self) -> u32 {
        self.inner.options().threads
    }

    #[getter]
    fn method(&self) -> &'static str {
        self.inner.options().method.name()
    }

    #[getter]
    fn crossover_bytes(&self) -> u64 {
        self.inner.options().crossover_bytes
    }

    /// The most bytes one copy-engine copy takes (None: no bound).
    #[getter]
    fn piece_bytes(&self) -> Option<u64> {
        Some(self.inner.options().piece_bytes).filter(|&b| b != u64::MAX)
    }

    #[getter]
    fn dma_available(&self) -> bool {
        self.inner.dma_available()
    }

    #[getter]
    fn page_bytes(&self) -> u64 {
        self.inner.page_bytes()
    }

    /// The pool's layers as runs `(start, end)` of evenly spaced tensors: the copy engine copies a page's segments
    /// of one run as one 2D piece.
    #[getter]
    fn layer_runs(&self) -> Vec<(usize, usize)> {
        self.inner.layer_runs().map(|r| (r.start, r.end)).collect()
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.pool().layers.len()
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.pool().num_blocks
    }

    #[getter]
    fn device(&self) -> Option<i32> {
        self.inner.pool().device
    }
}

impl PyPageCopier {
    /// The core copier, for a cache's executor. SAFETY of its pointers: `kvtier.copy.PageCopier`, which holds the
    /// tensors, is kept by the cache for as long as its executor lives.
    pub(super) fn copier(&self) -> PageCopier {
        self.inner.clone()
    }

    fn copy(
        &self,
        py: Python<'_>,
        dir: Direction,
        gpu_ids: &Bound<'_, PyAny>,
        host_slots: &Bound<'_, PyAny>,
        stream: u64,
        layers: Option<(i64, i64)>,
    ) -> PyResult<&'static str> {
        let g = int32s(gpu_ids, "gpu_ids")?;
        let h = int32s(host_slots, "host_slots")?;
        let n = self.inner.pool().layers.len();
        let range = match layers {
            None => 0..n,
            Some((a, b)) => non_negative::<usize>("layers start", a)?..non_negative::<usize>("layers end", b)?,
        };
        let (g, h) = (g.as_slice(), h.as_slice());
        py.detach(|| self.inner.copy(dir, g, h, stream, range)).map(|u| u.name()).map_err(to_py)
    }
}

/// Tickets of launched copies, completed in record order; `poll` never blocks.
#[pyclass(name = "CompletionQueue", module = "kvtier._core", frozen)]
pub struct PyCompletionQueue {
    inner: Mutex<CompletionQueue>,
}

#[pymethods]
impl PyCompletionQueue {
    #[new]
    #[pyo3(signature = (device = None))]
    fn new(#[pyo3(from_py_with = opt_int)] device: Option<i64>) -> PyResult<Self> {
        let device = device
            .map(|d| i32::try_from(d).map_err(|_| bad_argument(format!("device {d} is out of range"))))
            .transpose()?;
        Ok(Self { inner: Mutex::new(CompletionQueue::new(device).map_err(to_py)?) })
    }

    /// Record `ticket` after the work launched so far on `stream` (a raw cudaStream_t; ignored for CPU queues).
    #[pyo3(signature = (ticket, stream = 0))]
    fn record(&self, #[pyo3(from_py_with = int)] ticket: i64, #[pyo3(from_py_with = int)] stream: u64) -> PyResult<()> {
        let ticket = non_negative("ticket", ticket)?;
        lock(&self.inner).record(ticket, stream).map_err(to_py)
    }

    /// Tickets completed since the last poll, in record order, up to the first still running.
    fn poll(&self) -> PyResult<Vec<u64>> {
        lock(&self.inner).poll().map_err(to_py)
    }

    fn pending(&self) -> usize {
        lock(&self.inner).pending()
    }

    /// Block (GIL released) until all recorded work has completed; returns the tickets not yet polled.
    fn wait_all(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        py.detach(|| lock(&self.inner).wait_all()).map_err(to_py)
    }
}

/// Whether the copy engine's batch copy (cudaMemcpyBatchAsync) is compiled in and the driver has it.
#[pyfunction]
fn dma_supported() -> bool {
    cuda::dma_supported()
}

fn device_arg(device: i64) -> PyResult<i32> {
    let count = cuda::device_count();
    match i32::try_from(device) {
        Ok(d) if (0..count).contains(&d) => Ok(d),
        _ => Err(bad_argument(format!("device {device} is not a visible CUDA device ({count} visible)"))),
    }
}

/// A non-blocking CUDA stream of one device, made by kvtier for its copies; destroyed with the object.
#[pyclass(name = "CopyStream", module = "kvtier._core", frozen)]
pub struct PyCopyStream {
    inner: Stream,
}

#[pymethods]
impl PyCopyStream {
    #[new]
    fn new(#[pyo3(from_py_with = int)] device: i64) -> PyResult<Self> {
        Ok(Self { inner: Stream::new(device_arg(device)?).map_err(to_py)? })
    }

    /// The raw cudaStream_t.
    #[getter]
    fn handle(&self) -> u64 {
        self.inner.handle()
    }
}

/// A CUDA event (no timing) that orders streams on the GPU: `record(stream)`, then `wait_in(other)` makes the other
/// stream's later work wait for what `stream` had before the record; the host never waits, except in `synchronize`.
#[pyclass(name = "CopyEvent", module = "kvtier._core", frozen)]
pub struct PyCopyEvent {
    inner: Event,
}

#[pymethods]
impl PyCopyEvent {
    #[new]
    fn new(#[pyo3(from_py_with = int)] device: i64) -> PyResult<Self> {
        Ok(Self { inner: Event::new(device_arg(device)?).map_err(to_py)? })
    }

    fn record(&self, #[pyo3(from_py_with = int)] stream: u64) -> PyResult<()> {
        self.inner.record(stream).map_err(to_py)
    }

    fn wait_in(&self, #[pyo3(from_py_with = int)] stream: u64) -> PyResult<()> {
        self.inner.wait_in(stream).map_err(to_py)
    }

    /// Whether the recorded work has completed; never blocks.
    fn done(&self) -> PyResult<bool> {
        self.inner.done().map_err(to_py)
    }

    /// Block (GIL released) until the recorded work has completed.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.wait()).map_err(to_py)
    }
}

/// A job's pieces as Python passes them: (copier, gpu_ids, host_slots, layers or None).
type PyPiece<'py> = (usize, Bound<'py, PyAny>, Bound<'py, PyAny>, Option<(i64, i64)>);
/// A completed job as Python sees it: (job, success, bytes, seconds or None).
type FinishedJob = (u64, bool, u64, Option<f64>);

/// Copy jobs over page copiers (one device) on three lanes: stores, loads, expedited loads
/// (rust/executor/jobs.rs). Each `submit` checks every piece before copying; a CUDA failure fails the job, which
/// `finished` reports, and `submit` returns its message.
#[pyclass(name = "JobCopier", module = "kvtier._core", frozen)]
pub struct PyJobCopier {
    inner: Mutex<Jobs>,
    /// The copiers: they hold the memory the jobs reach.
    _copiers: Vec<Py<PyPageCopier>>,
}

#[pymethods]
impl PyJobCopier {
    #[new]
    #[pyo3(signature = (copiers, copy_streams = true))]
    fn new(copiers: Vec<Bound<'_, PyPageCopier>>, copy_streams: bool) -> PyResult<Self> {
        let core = copiers.iter().map(|c| c.get().copier()).collect();
        let inner = Jobs::new(core, copy_streams).map_err(to_py)?;
        Ok(Self { inner: Mutex::new(inner), _copiers: copiers.into_iter().map(Bound::unbind).collect() })
    }

    /// Copies the pieces GPU -> host (`to_host`) or back on `lane` ("store", "load", "expedited"), after the work
    /// on `engine_stream` (a raw cudaStream_t) so far. Returns None, or the CUDA error that failed the job.
    #[pyo3(signature = (job, to_host, lane, pieces, engine_stream = 0))]
    fn submit(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = int)] job: u64,
        to_host: bool,
        lane: &str,
        pieces: Vec<PyPiece<'_>>,
        #[pyo3(from_py_with = int)] engine_stream: u64,
    ) -> PyResult<Option<String>> {
        let lane = Lane::parse(lane).map_err(to_py)?;
        let mut ids = Vec::with_capacity(pieces.len());
        for (i, (copier, gpu_ids, host_slots, layers)) in pieces.iter().enumerate() {
            let layers = match layers {
                None => None,
                Some((a, b)) => Some(
                    non_negative::<usize>(&format!("pieces[{i}] layers start"), *a)?
                        ..non_negative::<usize>(&format!("pieces[{i}] layers end"), *b)?,
                ),
            };
            let g = int32s(gpu_ids, &format!("pieces[{i}] gpu_ids"))?;
            let h = int32s(host_slots, &format!("pieces[{i}] host_slots"))?;
            ids.push((*copier, g, h, layers));
        }
        let pieces: Vec<Piece<'_>> = ids
            .iter()
            .map(|(copier, g, h, layers)| Piece {
                copier: *copier,
                gpu_ids: g.as_slice(),
                host_slots: h.as_slice(),
                layers: layers.clone(),
            })
            .collect();
        let failed =
            py.detach(|| lock(&self.inner).submit(job, to_host, lane, &pieces, engine_stream)).map_err(to_py)?;
        Ok(failed.map(|e| e.to_string()))
    }

    /// (job, success, bytes, seconds) of the jobs completed since the last call, each lane's in submission order;
    /// seconds: how long the job's copies took (None when it failed or could not be timed).
    fn finished(&self, py: Python<'_>) -> PyResult<Vec<FinishedJob>> {
        let done = py.detach(|| lock(&self.inner).finished()).map_err(to_py)?;
        Ok(done.into_iter().map(|f| (f.job, f.ok, f.bytes, f.seconds)).collect())
    }

    /// Returns once the given jobs (those in flight) completed; their results stay for `finished`.
    fn wait(&self, py: Python<'_>, jobs: Vec<u64>) -> PyResult<()> {
        py.detach(|| lock(&self.inner).wait(&jobs)).map_err(to_py)
    }

    /// Waits for every job in flight.
    fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| lock(&self.inner).wait_all()).map_err(to_py)
    }

    /// The raw copy stream of `lane`, or None when jobs run on the engine's stream.
    fn lane_stream(&self, lane: &str) -> PyResult<Option<u64>> {
        Ok(lock(&self.inner).lane_stream(Lane::parse(lane).map_err(to_py)?))
    }

    #[getter]
    fn pending(&self) -> usize {
        lock(&self.inner).pending()
    }

    #[getter]
    fn copy_streams(&self) -> bool {
        lock(&self.inner).copy_streams()
    }
}
