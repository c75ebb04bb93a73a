//! `kvtier._core.L3Planner` and its plans: the L3 tier's planning (rust/l3plan.rs) for the Python executor.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::index::{PyIndex, PyReady};
use super::{namespace_bytes, non_negative, to_py};
use crate::l3;
use crate::l3plan::{self, FetchPlan, HostLayout, Object, Planner, Probe, PutPlan, Transfer};

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyL3Planner>()?;
    m.add_class::<PyPutPlan>()?;
    m.add_class::<PyProbe>()?;
    m.add_class::<PyFetchPlan>()?;
    m.add_class::<PyVerdict>()?;
    m.add_function(wrap_pyfunction!(fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(part_digests, m)?)?;
    m.add("DIGEST_PART_BYTES", l3::DIGEST_PART_BYTES)?;
    m.add("L3_FORMAT_VERSION", l3::FORMAT_VERSION)?;
    m.add("L3_HEADER_BYTES", l3::HEADER_BYTES)?;
    m.add("L3_WRONG_LENGTH", l3plan::WRONG_LENGTH)?;
    Ok(())
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
    let bytes = data.as_slice().map_err(|_| PyTypeError::new_err("part_digests needs a contiguous uint8 array"))?;
    let parts = py.detach(|| l3::part_digests(bytes));
    Ok(pyo3::types::PyBytes::new(py, &parts.concat()))
}

type Request = (Vec<String>, Vec<Vec<usize>>, Vec<Vec<usize>>);

/// A put: `L3Planner.wire` gives the keys, pointers and sizes of each batch for the Store; `L3Planner.finish`
/// releases its hold.
#[pyclass(name = "PutPlan", module = "kvtier._core", frozen)]
pub struct PyPutPlan {
    inner: Mutex<PutPlan>,
    finished: AtomicBool,
}

#[pymethods]
impl PyPutPlan {
    #[getter]
    fn ticket(&self) -> u64 {
        locked(&self.inner).ticket
    }
    #[getter]
    fn keys(&self) -> Vec<String> {
        locked(&self.inner).objects.iter().map(|o| o.key.clone()).collect()
    }
    /// Bytes of every object (headers included).
    #[getter]
    fn bytes(&self) -> usize {
        locked(&self.inner).objects.iter().map(Object::bytes).sum()
    }
    fn __len__(&self) -> usize {
        locked(&self.inner).objects.len()
    }
}

/// The keys a fetch asks the Store about first.
#[pyclass(name = "Probe", module = "kvtier._core", frozen)]
pub struct PyProbe {
    inner: Probe,
}

#[pymethods]
impl PyProbe {
    #[getter]
    fn keys(&self) -> Vec<String> {
        self.inner.exists_keys.clone()
    }
}

/// A fetch into reserved slots: for each batch `L3Planner.wire` for the Store and `L3Planner.verify` on what it
/// got, then `L3Planner.finish(plan, admit)`.
#[pyclass(name = "FetchPlan", module = "kvtier._core", frozen)]
pub struct PyFetchPlan {
    inner: FetchPlan,
    finished: AtomicBool,
}

#[pymethods]
impl PyFetchPlan {
    #[getter]
    fn ticket(&self) -> u64 {
        self.inner.ticket
    }
    #[getter]
    fn keys(&self) -> Vec<String> {
        self.inner.objects.iter().map(|o| o.key.clone()).collect()
    }
    /// New host pages and states the fetch fills.
    #[getter]
    fn pages(&self) -> usize {
        self.inner.pages
    }
    #[getter]
    fn states(&self) -> usize {
        self.inner.states
    }
    /// Bytes of every object (headers included).
    #[getter]
    fn bytes(&self) -> usize {
        self.inner.objects.iter().map(Object::bytes).sum()
    }
    fn __len__(&self) -> usize {
        self.inner.objects.len()
    }
}

/// The check of a fetch: `admitted` when every object is whole and verified; else the keys `rejected` (with
/// the reason) and `lost` (with the Store's code).
#[pyclass(name = "Verdict", module = "kvtier._core", frozen, get_all)]
pub struct PyVerdict {
    admitted: bool,
    rejected: Vec<(String, String)>,
    lost: Vec<(String, i64)>,
}

/// The L3 planner of one cache over its `Index` and host pools; see rust/l3plan.rs. Calls that plan or check
/// release the GIL.
///
/// `page_base` / `state_base` are the addresses of the host pools (`HostPool.base_ptr`): the caller keeps the
/// pools alive, and their memory in place, for as long as the planner or any plan of it lives.
#[pyclass(name = "L3Planner", module = "kvtier._core", frozen)]
pub struct PyL3Planner {
    index: Py<PyIndex>,
    inner: Mutex<Planner>,
    group_pages: usize,
}

impl PyL3Planner {
    fn lock(&self) -> MutexGuard<'_, Planner> {
        locked(&self.inner)
    }
}

#[pymethods]
impl PyL3Planner {
    #[new]
    #[pyo3(signature = (index, fingerprint, *, group_pages, page_base, page_bytes, state_base=0, state_bytes=0,
        hash_key=None, seen_keys=1 << 20, header_slots=4096, scratch_pages=None, staging_bytes=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        index: Py<PyIndex>,
        fingerprint: &str,
        group_pages: i64,
        page_base: i64,
        page_bytes: i64,
        state_base: i64,
        state_bytes: i64,
        hash_key: Option<&Bound<'_, PyAny>>,
        seen_keys: i64,
        header_slots: i64,
        scratch_pages: Option<i64>,
        staging_bytes: Option<i64>,
    ) -> PyResult<Self> {
        let group_pages: usize = non_negative("group_pages", group_pages)?;
        let host = HostLayout {
            page_base: non_negative("page_base", page_base)?,
            page_bytes: non_negative("page_bytes", page_bytes)?,
            state_base: non_negative("state_base", state_base)?,
            state_bytes: non_negative("state_bytes", state_bytes)?,
        };
        let scratch = match scratch_pages {
            Some(v) => non_negative("scratch_pages", v)?,
            None => 2 * group_pages,
        };
        let planner = Planner::new(
            fingerprint,
            &namespace_bytes(hash_key)?,
            group_pages,
            host,
            non_negative("seen_keys", seen_keys)?,
            non_negative("header_slots", header_slots)?,
            scratch,
            staging_bytes.map(|b| non_negative("staging_bytes", b)).transpose()?,
        )
        .map_err(to_py)?;
        Ok(Self { index, inner: Mutex::new(planner), group_pages })
    }

    #[getter]
    fn fingerprint(&self) -> String {
        self.lock().fingerprint().to_owned()
    }
    #[getter]
    fn group_pages(&self) -> usize {
        self.group_pages
    }
    /// `(address, bytes)` of the planner's buffers the Store must have registered: the staging buffers, or
    /// zero-copy its header and scratch buffers (and then the host pools too).
    fn buffers(&self) -> Vec<(usize, usize)> {
        self.lock().buffers()
    }
    /// Whether objects move straight from and into the host pools (the Store then registers them).
    #[getter]
    fn zero_copy(&self) -> bool {
        self.lock().zero_copy()
    }
    /// A new fingerprint (the model version changed); nothing is remembered as seen any more.
    fn set_fingerprint(&self, fingerprint: &str) -> PyResult<()> {
        self.lock().set_fingerprint(fingerprint).map_err(to_py)
    }
    /// The plan's objects in runs that one Store call moves: `(start, end)` indices.
    fn batches(&self, py: Python<'_>, plan: &Bound<'_, PyAny>) -> PyResult<Vec<(usize, usize)>> {
        let objects = with_objects(plan, <[Object]>::to_vec)?;
        // The planner's lock is only ever taken with the GIL released (a worker holds it without the GIL).
        Ok(py.detach(|| self.lock().batches(&objects)))
    }
    /// `(keys, ptrs_per_key, sizes_per_key)` of objects `start..end` of a plan for the Store: a put's are copied
    /// into the staging buffer first (GIL released); zero-copy, each object's header and payload pieces.
    fn wire(&self, py: Python<'_>, plan: &Bound<'_, PyAny>, start: usize, end: usize) -> PyResult<Request> {
        let dir = if plan.cast::<PyPutPlan>().is_ok() { Transfer::Put } else { Transfer::Get };
        let batch = with_objects(plan, |objects| batch_of(objects, start, end).map(<[Object]>::to_vec))??;
        let wire = py.detach(|| self.lock().wire(&batch, dir));
        let keys = batch.iter().map(|o| o.key.clone()).collect();
        let ptrs = wire.iter().map(|w| w.iter().map(|p| p.0).collect()).collect();
        let sizes = wire.iter().map(|w| w.iter().map(|p| p.1).collect()).collect();
        Ok((keys, ptrs, sizes))
    }
    /// The Store key of the group whose last page has this chain key.
    fn group_key(&self, last_page_key: u128) -> String {
        self.lock().group_key(last_page_key)
    }
    /// The Store key of the state after the page with this chain key.
    fn state_key(&self, page_key: u128) -> String {
        self.lock().state_key(page_key)
    }

    /// Plans (and seals) the put of what a store made ready; None when nothing is new.
    fn plan_put(&self, py: Python<'_>, ready: &PyReady) -> PyResult<Option<PyPutPlan>> {
        let index = self.index.get();
        let planned = py.detach(|| {
            let mut planner = self.lock();
            let plan = planner.plan_put(&mut index.lock(), &ready.inner)?;
            let format = planner.format().clone();
            drop(planner);
            if let Some(p) = &plan {
                l3plan::seal(&format, p);
            }
            Ok(plan)
        });
        Ok(planned.map_err(to_py)?.map(|p| PyPutPlan { inner: Mutex::new(p), finished: AtomicBool::new(false) }))
    }

    /// Leaves out the objects the Store has (`present[i] == 1`), without remembering them as seen; returns how
    /// many.
    fn drop_present(&self, plan: &PyPutPlan, present: Vec<i64>) -> usize {
        self.lock().drop_present(&mut locked(&plan.inner), &present)
    }

    /// The keys a fetch of this request asks about first; None when there is nothing to ask.
    fn probe(&self, py: Python<'_>, request_id: &str) -> Option<PyProbe> {
        let index = self.index.get();
        py.detach(|| self.lock().probe(&index.lock(), request_id)).map(|inner| PyProbe { inner })
    }

    /// Plans the fetch from the Store's exists() codes for the probe's keys; reserves its slots. None: a miss.
    fn plan_fetch(&self, py: Python<'_>, probe: &PyProbe, codes: Vec<i64>) -> PyResult<Option<PyFetchPlan>> {
        let index = self.index.get();
        let plan = py.detach(|| self.lock().plan_fetch(&mut index.lock(), &probe.inner, &codes)).map_err(to_py)?;
        Ok(plan.map(|inner| PyFetchPlan { inner, finished: AtomicBool::new(false) }))
    }

    /// Checks what a get of objects `start..start + len(got)` of a fetch got (`got[i]`: bytes read or the Store's
    /// code): each whole object is first copied out of the staging buffer, then its length, header and digest are
    /// checked there, with the GIL released.
    #[pyo3(signature = (plan, got, start=0))]
    fn verify(&self, py: Python<'_>, plan: &PyFetchPlan, got: Vec<i64>, start: usize) -> PyResult<PyVerdict> {
        let objects = batch_of(&plan.inner.objects, start, start + got.len())?;
        let v = py.detach(|| {
            let planner = self.lock();
            planner.unstage(objects, &got);
            l3plan::verify(planner.format(), objects, &got)
        });
        let key = |i: usize| objects[i].key.clone();
        Ok(PyVerdict {
            admitted: v.admitted(),
            rejected: v.rejected.iter().map(|(i, why)| (key(*i), why.to_string())).collect(),
            lost: v.lost.iter().map(|&(i, code)| (key(i), code)).collect(),
        })
    }

    /// Ends a plan's ticket once: a put's hold is released; a fetch's slots become ready (`admit`) or are
    /// freed. Returns False when the plan was finished already.
    #[pyo3(signature = (plan, admit=false))]
    fn finish(&self, plan: &Bound<'_, PyAny>, admit: bool) -> PyResult<bool> {
        let index = self.index.get();
        if let Ok(p) = plan.cast::<PyPutPlan>() {
            let p = p.get();
            if p.finished.swap(true, Ordering::SeqCst) {
                return Ok(false);
            }
            let ticket = locked(&p.inner).ticket;
            index.lock().complete(ticket).map_err(to_py)?;
        } else if let Ok(p) = plan.cast::<PyFetchPlan>() {
            let p = p.get();
            if p.finished.swap(true, Ordering::SeqCst) {
                return Ok(false);
            }
            let mut ix = index.lock();
            if admit { ix.complete(p.inner.ticket).map(drop) } else { ix.abort(p.inner.ticket) }.map_err(to_py)?;
        } else {
            return Err(PyTypeError::new_err(format!(
                "plan must be a PutPlan or FetchPlan, got {}",
                plan.get_type().name()?
            )));
        }
        Ok(true)
    }

    /// Forgets that these keys of a plan were put or seen (they failed: a later store may put them again).
    fn unsee(&self, plan: &Bound<'_, PyAny>, keys: Vec<String>) -> PyResult<()> {
        let objects = named(plan, &keys)?;
        self.lock().unsee(&objects.iter().collect::<Vec<_>>());
        Ok(())
    }

    /// These groups of a plan are in the Store now (a put stored them) or, `removed`, gone from it (removed, or
    /// found missing by a get): their pages become "STORAGE" KV events of the index.
    fn record_storage(&self, plan: &Bound<'_, PyAny>, keys: Vec<String>, removed: bool) -> PyResult<()> {
        let pages: Vec<u128> = named(plan, &keys)?.into_iter().flat_map(|o| o.pages).collect();
        self.index.get().lock().record_storage(removed, pages);
        Ok(())
    }
}

/// The objects of a put or fetch plan whose Store keys are among `keys`, in plan order.
fn named(plan: &Bound<'_, PyAny>, keys: &[String]) -> PyResult<Vec<Object>> {
    let pick =
        |objects: &[Object]| -> Vec<Object> { objects.iter().filter(|o| keys.contains(&o.key)).cloned().collect() };
    if let Ok(p) = plan.cast::<PyPutPlan>() {
        Ok(pick(&locked(&p.get().inner).objects))
    } else if let Ok(p) = plan.cast::<PyFetchPlan>() {
        Ok(pick(&p.get().inner.objects))
    } else {
        Err(PyTypeError::new_err(format!("plan must be a PutPlan or FetchPlan, got {}", plan.get_type().name()?)))
    }
}

/// Runs `f` on the objects of a put or fetch plan.
fn with_objects<R>(plan: &Bound<'_, PyAny>, f: impl FnOnce(&[Object]) -> R) -> PyResult<R> {
    if let Ok(p) = plan.cast::<PyPutPlan>() {
        return Ok(f(&locked(&p.get().inner).objects));
    }
    if let Ok(p) = plan.cast::<PyFetchPlan>() {
        return Ok(f(&p.get().inner.objects));
    }
    Err(PyTypeError::new_err(format!("plan must be a PutPlan or FetchPlan, got {}", plan.get_type().name()?)))
}

fn batch_of(objects: &[Object], start: usize, end: usize) -> PyResult<&[Object]> {
    objects.get(start..end).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "objects {start}..{end} are not a range of the plan's {}",
            objects.len()
        ))
    })
}
