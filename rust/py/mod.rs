//! The Python module `kvtier._core`. Errors become exceptions in one place (`to_py`); every argument is checked
//! here, at the boundary, and the message names the value that was wrong.
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::error::Error;

mod copy;
mod index;
mod l3;

create_exception!(kvtier, KvtierError, PyException, "Base class of kvtier's own errors.");
create_exception!(
    kvtier,
    StaleLookupError,
    KvtierError,
    "A lookup's pages or state left the host pool before the load began."
);
create_exception!(kvtier, CopyError, KvtierError, "A page copy could not be launched or failed.");

pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::UnknownRequest(_) | Error::UnknownTicket(_) => PyKeyError::new_err(msg),
        Error::Stale(_) => StaleLookupError::new_err(msg),
        Error::Copy(_) => CopyError::new_err(msg),
        Error::Invariant(_) => KvtierError::new_err(msg),
    }
}

/// An int argument that must be >= 0 (and fit the target type).
pub(crate) fn non_negative<T: TryFrom<i64>>(name: &str, value: i64) -> PyResult<T> {
    if value < 0 {
        return Err(PyValueError::new_err(format!("{name} must be >= 0, got {value}")));
    }
    T::try_from(value).map_err(|_| PyValueError::new_err(format!("{name} is too large, got {value}")))
}

/// A 1-D run of int32 ids: a contiguous numpy int32 array is read in place; a sequence of ints is copied.
pub(crate) enum Int32s<'py> {
    Array(PyReadonlyArray1<'py, i32>),
    Owned(Vec<i32>),
}

impl Int32s<'_> {
    pub(crate) fn as_slice(&self) -> &[i32] {
        match self {
            Self::Array(a) => a.as_slice().expect("checked contiguous on extraction"),
            Self::Owned(v) => v,
        }
    }
}

pub(crate) fn int32s<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Int32s<'py>> {
    if let Ok(arr) = obj.cast::<PyArray1<i32>>() {
        let ro = arr.try_readonly().map_err(|e| PyValueError::new_err(format!("{what}: {e}")))?;
        if ro.as_slice().is_err() {
            return Err(PyValueError::new_err(format!("{what} must be a contiguous array, got strides {:?}", arr.strides())));
        }
        return Ok(Int32s::Array(ro));
    }
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a 1-D numpy int32 array, got dtype {} with {} dimension(s)",
            arr.dtype(),
            arr.ndim()
        )));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(PyTypeError::new_err(format!("{what} must be int32 ids, got {}", obj.get_type().name()?)));
    }
    let values: Vec<i64> = obj.extract().map_err(|_| {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        PyTypeError::new_err(format!("{what} must be a numpy int32 array or a sequence of ints, got {ty}"))
    })?;
    let out = values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            i32::try_from(v).map_err(|_| PyValueError::new_err(format!("{what}[{i}] = {v} does not fit in int32")))
        })
        .collect::<PyResult<Vec<i32>>>()?;
    Ok(Int32s::Owned(out))
}

/// A namespace (tenant salt): None, str (UTF-8) or bytes.
pub(crate) fn namespace_bytes(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u8>> {
    match obj {
        None => Ok(Vec::new()),
        Some(o) if o.is_none() => Ok(Vec::new()),
        Some(o) => {
            if let Ok(s) = o.extract::<String>() {
                Ok(s.into_bytes())
            } else if let Ok(b) = o.extract::<Vec<u8>>() {
                Ok(b)
            } else {
                Err(PyTypeError::new_err(format!("namespace must be str, bytes or None, got {}", o.get_type().name()?)))
            }
        }
    }
}

/// What this build of kvtier has: its version, whether the CUDA copy kernel is compiled in, the CUDA runtime
/// version, and the CUDA devices visible now (0 without a driver).
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("cuda", crate::cuda::COMPILED)?;
    d.set_item("cuda_runtime_version", crate::cuda::runtime_version())?;
    d.set_item("cuda_devices", py.detach(crate::cuda::device_count))?;
    d.set_item("nvcc", option_env!("KVTIER_NVCC"))?;
    Ok(d)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("StaleLookupError", py.get_type::<StaleLookupError>())?;
    m.add("CopyError", py.get_type::<CopyError>())?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    index::register(m)?;
    l3::register(m)?;
    copy::register(m)?;
    Ok(())
}

/// A numpy int32 array from u32 slots (slot counts are bounded by u32 -> i32 checks at construction).
pub(crate) fn slots_array<'py>(py: Python<'py>, slots: &[u32]) -> Bound<'py, PyArray1<i32>> {
    PyArray1::from_iter(py, slots.iter().map(|&s| s as i32))
}
