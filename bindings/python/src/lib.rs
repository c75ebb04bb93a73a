//! The Python module `kvtier._core`, a crate of its own over the core crate (`kvtier`, rust/): it only converts
//! Python objects into the core's arguments (token containers, tensors through DLPack, block tables) and the
//! core's results back, and maps `Error` to exceptions in one place (`to_py`). Every rule lives in the core, where
//! `cargo test` covers it; a conversion that fails names the value that was wrong. A caller's mistake is
//! `kvtier.BadArgument` (`bad_argument`), and so is an exception the caller's own object raised while it was read
//! (`raised_by`); kvtier's own failures are `kvtier.KvtierError` and its subclasses.
use std::ops::Range;
use std::sync::{Mutex, MutexGuard};

use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString, PyTuple, PyType};

use kvtier::cache::Prompt as CorePrompt;
use kvtier::error::Error;
use kvtier::index::chain::{bad_token, Check, TokenIds, Window, TOKEN_LIMIT};

mod cache;
mod copy;
mod dlpack;
mod index;
mod l3;
mod objects;

create_exception!(kvtier, KvtierError, PyRuntimeError, "Base class of kvtier's own errors (never the caller's).");
create_exception!(
    kvtier,
    StaleLookupError,
    KvtierError,
    "A lookup's pages or state left the host pool before the load began."
);
create_exception!(kvtier, CopyError, KvtierError, "A page copy could not be launched or failed.");
/// `kvtier.BadArgument`, the one exception of a caller's mistakes: a `ValueError` and a `TypeError`, so that callers
/// catching either keep catching it. PyO3 declares exceptions of one base, so it is made at module init.
static BAD_ARGUMENT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// `kvtier.PromptMismatchError`, a `BadArgument`.
static PROMPT_MISMATCH: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// An exception class of module `kvtier` with these bases.
fn exception_type(py: Python<'_>, name: &str, bases: &[Bound<'_, PyType>], doc: &str) -> PyResult<Py<PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "kvtier")?;
    namespace.set_item("__doc__", doc)?;
    let made = py.import("builtins")?.getattr("type")?.call1((name, PyTuple::new(py, bases)?, namespace))?;
    Ok(made.cast_into::<PyType>()?.unbind())
}

fn made_type<'py>(py: Python<'py>, cell: &PyOnceLock<Py<PyType>>) -> Bound<'py, PyType> {
    cell.get(py).expect("made at module init").bind(py).clone()
}

/// A caller's mistake (`msg` names the value that was wrong): `kvtier.BadArgument`.
pub(crate) fn bad_argument(msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| PyErr::from_type(made_type(py, &BAD_ARGUMENT), msg))
}

/// `e`, raised by the caller's own object `what` while kvtier read or called it (its `allocate()`, a block table
/// whose `__len__` or `__iter__` raised): the caller's, a `BadArgument` whose cause is `e`.
pub(crate) fn raised_by(py: Python<'_>, what: &str, e: PyErr) -> PyErr {
    if e.is_instance(py, &made_type(py, &BAD_ARGUMENT)) {
        return e;
    }
    let kind = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
    let out = bad_argument(format!("{what} raised {kind}: {}", e.value(py)));
    out.set_cause(py, Some(e));
    out
}

/// The type of `kvtier.NEVER`, what `allocate()` returns for "never": the sequence can never be allocated (a
/// miss). Its one value is made at module init.
#[pyclass(name = "NeverType", module = "kvtier", frozen)]
pub(crate) struct NeverType;

#[pymethods]
impl NeverType {
    fn __repr__(&self) -> &'static str {
        "kvtier.NEVER"
    }
}

pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidArgument(_) => bad_argument(msg),
        Error::PromptMismatch { .. } => Python::attach(|py| PyErr::from_type(made_type(py, &PROMPT_MISMATCH), msg)),
        Error::UnknownRequest(_) | Error::UnknownTicket(_) => PyKeyError::new_err(msg),
        Error::Stale(_) => StaleLookupError::new_err(msg),
        Error::Copy(_) => CopyError::new_err(msg),
        Error::State(_) | Error::Invariant(_) | Error::Hook(_) => KvtierError::new_err(msg),
    }
}

/// An integer type an argument may be read into (`int`).
pub(crate) trait IntArg: Sized {
    const RANGE: (i128, i128);
    fn read(obj: &Bound<'_, PyAny>) -> PyResult<Self>;
}

macro_rules! int_arg {
    ($($t:ty),*) => {$(
        impl IntArg for $t {
            const RANGE: (i128, i128) = (<$t>::MIN as i128, <$t>::MAX as i128);
            fn read(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
                obj.extract()
            }
        }
    )*};
}
int_arg!(i64, u64, u32, i32, usize);

/// `#[pyo3(from_py_with = int)]`: an integer argument, a Python int or an object with `__index__` (numpy's integers)
/// in `T`'s range. A bool, a float or an int out of range is a `BadArgument` naming the value, where Python's own
/// conversion raises an OverflowError or TypeError that names neither (PyO3 notes the argument's name either way).
pub(crate) fn int<T: IntArg>(obj: &Bound<'_, PyAny>) -> PyResult<T> {
    let failure = if obj.is_instance_of::<PyBool>() {
        None
    } else {
        match T::read(obj) {
            Ok(v) => return Ok(v),
            Err(e) => Some(e),
        }
    };
    let py = obj.py();
    let shown = obj.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
    if failure.as_ref().is_some_and(|e| e.is_instance_of::<PyOverflowError>(py)) {
        return Err(bad_argument(format!("{shown} is out of range: {} to {}", T::RANGE.0, T::RANGE.1)));
    }
    let kind = obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
    let err = bad_argument(format!("expected an int, got {kind} {shown}"));
    err.set_cause(py, failure);
    Err(err)
}

/// `int` for an optional argument: None stays None.
pub(crate) fn opt_int<T: IntArg>(obj: &Bound<'_, PyAny>) -> PyResult<Option<T>> {
    if obj.is_none() {
        Ok(None)
    } else {
        int(obj).map(Some)
    }
}

/// An int argument that must be >= 0 (and fit the target type).
pub(crate) fn non_negative<T: TryFrom<i64>>(name: &str, value: i64) -> PyResult<T> {
    if value < 0 {
        return Err(bad_argument(format!("{name} must be >= 0, got {value}")));
    }
    T::try_from(value).map_err(|_| bad_argument(format!("{name} is too large, got {value}")))
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
        let ro = arr.try_readonly().map_err(|e| bad_argument(format!("{what}: {e}")))?;
        if ro.as_slice().is_err() {
            return Err(bad_argument(format!("{what} must be a contiguous array, got strides {:?}", arr.strides())));
        }
        return Ok(Int32s::Array(ro));
    }
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        return Err(bad_argument(format!(
            "{what} must be a 1-D numpy int32 array, got dtype {} with {} dimension(s)",
            arr.dtype(),
            arr.ndim()
        )));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(bad_argument(format!("{what} must be int32 ids, got {}", obj.get_type().name()?)));
    }
    let not_ids = || {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        bad_argument(format!("{what} must be a numpy int32 array or a sequence of ints, got {ty}"))
    };
    let mut out = Vec::new();
    let seq = obj.cast::<pyo3::types::PySequence>().map_err(|_| not_ids())?;
    let raised = |e| raised_by(obj.py(), what, e);
    for (i, item) in seq.try_iter().map_err(raised)?.enumerate() {
        let item = item.map_err(raised)?;
        // A bool is an int to Python, but never an id.
        let v: i64 = if item.is_instance_of::<pyo3::types::PyBool>() { None } else { item.extract().ok() }
            .ok_or_else(|| bad_argument(format!("{what}[{i}] must be an int, got {item:?}")))?;
        out.push(i32::try_from(v).map_err(|_| bad_argument(format!("{what}[{i}] = {v} does not fit in int32")))?);
    }
    Ok(Int32s::Owned(out))
}

/// A prompt's token ids as the engine holds them, read without a conversion pass.
pub(crate) enum Prompt<'py> {
    /// A list or tuple of ints: only the items the index needs are read (`window`), under the GIL.
    Items(Bound<'py, PyAny>),
    /// A 1-D integer array read in place (numpy; array.array and CPU tensors through a numpy view of them).
    Array(ArrayIds<'py>),
}

macro_rules! array_ids {
    ($($variant:ident: $t:ty),*) => {
        /// A contiguous 1-D numpy array of one integer dtype.
        pub(crate) enum ArrayIds<'py> {
            $($variant(PyReadonlyArray1<'py, $t>),)*
        }

        impl<'py> ArrayIds<'py> {
            /// Calls `f` with the ids, read in place.
            pub(crate) fn with<R>(&self, f: impl FnOnce(&(dyn TokenIds + Sync)) -> R) -> R {
                match self {
                    $(Self::$variant(a) => f(&a.as_slice().expect("checked contiguous")),)*
                }
            }

            fn of(arr: &Bound<'py, PyUntypedArray>) -> PyResult<Option<Self>> {
                let busy = |e| bad_argument(format!("token_ids: {e}"));
                $(if let Ok(a) = arr.cast::<PyArray1<$t>>() {
                    return Ok(Some(Self::$variant(a.try_readonly().map_err(busy)?)));
                })*
                Ok(None)
            }
        }
    };
}
array_ids!(I32: i32, I64: i64, U32: u32, U64: u64, I16: i16, U16: u16, I8: i8, U8: u8);

impl<'py> Prompt<'py> {
    /// Lists and tuples are read item by item, numpy arrays in place; anything else (array.array, a CPU torch
    /// tensor) through `numpy.asarray`, a view that copies nothing. Shape, dtype and layout are checked here.
    pub(crate) fn of(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
            return Ok(Self::Items(obj.clone()));
        }
        if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
            return Err(bad_argument(format!("token_ids must be ints, got {}", obj.get_type().name()?)));
        }
        let not_ids = |why: String| {
            let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            bad_argument(format!("token_ids must be a list, tuple, integer array or CPU tensor, got {ty}{why}"))
        };
        let arr = match obj.cast::<PyUntypedArray>() {
            Ok(a) => a.clone(),
            Err(_) => {
                let view = obj.py().import("numpy")?.getattr("asarray")?.call1((obj,));
                let view = view.map_err(|e| not_ids(format!(" ({e})")))?;
                let view = view.cast_into::<PyUntypedArray>().map_err(|e| not_ids(format!(" ({e})")))?;
                if !matches!(view.dtype().kind(), b'i' | b'u') {
                    return Err(not_ids(format!(" (dtype {})", view.dtype())));
                }
                view
            }
        };
        let dtype = arr.dtype();
        if !matches!(dtype.kind(), b'i' | b'u') {
            return Err(bad_argument(format!("token_ids must be integers, got dtype {dtype}")));
        }
        if arr.ndim() != 1 {
            return Err(bad_argument(format!("token_ids must be 1-D, got shape {:?}", arr.shape())));
        }
        if !arr.is_contiguous() {
            return Err(bad_argument(format!("token_ids must be contiguous, got strides {:?}", arr.strides())));
        }
        match ArrayIds::of(&arr)? {
            Some(ids) => Ok(Self::Array(ids)),
            None => Err(bad_argument(format!("token_ids dtype {dtype} is not a native-order integer type"))),
        }
    }
}

/// Reads `ranges` of a list or tuple of ints, range-checking each id (the error names the value and where).
fn read_window(seq: &Bound<'_, PyAny>, ranges: &[Range<usize>]) -> PyResult<Window> {
    let is_list = seq.is_instance_of::<PyList>();
    Window::read(prompt_len(seq)?, ranges, |i| item(seq, is_list, i))
}

/// The first Python exception of a call, kept while the core unwinds (an `Error::Hook` stands for it there).
#[derive(Default)]
pub(crate) struct Raised(Option<PyErr>);

impl Raised {
    pub(crate) fn keep(&mut self, e: PyErr) -> Error {
        let msg = e.to_string();
        self.0.get_or_insert(e);
        Error::Hook(msg)
    }

    /// The call's outcome for Python: the kept exception, else the core's error mapped.
    fn result<T>(self, r: kvtier::error::Result<T>) -> PyResult<T> {
        match (r, self.0) {
            (Ok(v), _) => Ok(v),
            (Err(_), Some(e)) => Err(e),
            (Err(e), None) => Err(to_py(e)),
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A prompt's ids for the core: an array read in place, or a list or tuple of which the core's `Check::ranges`
/// are read when a call asks for them (taking the GIL for the read).
pub(crate) enum Ids<'a> {
    Array(&'a (dyn TokenIds + Sync)),
    Items { seq: Py<PyAny>, block_size: usize, window: Option<(Check, Window)>, raised: &'a Mutex<Raised> },
}

impl CorePrompt for Ids<'_> {
    fn ids(&mut self, check: Check, hashed: usize) -> kvtier::error::Result<&dyn TokenIds> {
        match self {
            Ids::Array(a) => Ok(*a),
            Ids::Items { seq, block_size, window, raised } => {
                if !matches!(window, Some((Check::Full, _))) && window.as_ref().is_none_or(|w| w.0 != check) {
                    let read = Python::attach(|py| {
                        let seq = seq.bind(py);
                        read_window(seq, &check.ranges(hashed, prompt_len(seq)?, *block_size))
                    });
                    let w = read.map_err(|e| lock(raised).keep(e))?;
                    *window = Some((check, w));
                }
                Ok(&window.as_ref().expect("read above").1)
            }
        }
    }
}

/// Runs `f` with the GIL released on the prompt's ids (`token_ids`, read as `Prompt::of` says) and a keeper of
/// the first Python exception raised meanwhile, which is the call's exception.
pub(crate) fn with_prompt<R: Send>(
    py: Python<'_>,
    token_ids: &Bound<'_, PyAny>,
    block_size: usize,
    f: impl for<'a> FnOnce(&mut Ids<'a>, &'a Mutex<Raised>) -> kvtier::error::Result<R> + Send,
) -> PyResult<R> {
    let raised = Mutex::new(Raised::default());
    let out = match Prompt::of(token_ids)? {
        Prompt::Array(a) => a.with(|ids| py.detach(|| f(&mut Ids::Array(ids), &raised))),
        Prompt::Items(seq) => {
            let mut ids = Ids::Items { seq: seq.unbind(), block_size, window: None, raised: &raised };
            py.detach(|| f(&mut ids, &raised))
        }
    };
    raised.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner).result(out)
}

/// The length of a prompt held as a list or tuple (a subclass's own `__len__` raising is the caller's).
pub(crate) fn prompt_len(seq: &Bound<'_, PyAny>) -> PyResult<usize> {
    seq.len().map_err(|e| raised_by(seq.py(), "token_ids", e))
}

/// Item `i` of a list or tuple as a token id. The common case (an exact int in range) is inlined into the read's
/// loop; anything else goes to `item_slow`.
#[inline(always)]
fn item(seq: &Bound<'_, PyAny>, is_list: bool, i: usize) -> PyResult<i32> {
    let at = i as pyo3::ffi::Py_ssize_t;
    // SAFETY: `seq` is a live list or tuple and the GIL is held. The item is a borrowed reference, used only while
    // no Python code can run (an exact int converts without calling back into Python); anything else is read
    // through an owned reference in `item_slow`.
    unsafe {
        let p = if is_list {
            pyo3::ffi::PyList_GetItem(seq.as_ptr(), at)
        } else {
            pyo3::ffi::PyTuple_GetItem(seq.as_ptr(), at)
        };
        if !p.is_null() && pyo3::ffi::PyLong_CheckExact(p) != 0 {
            let v = pyo3::ffi::PyLong_AsLongLong(p);
            if (0..TOKEN_LIMIT).contains(&v) {
                return Ok(v as i32);
            }
        }
    }
    item_slow(seq, i)
}

/// `item` for what is not an exact int in range: the error that names it (or the value of an int subclass).
#[cold]
#[inline(never)]
fn item_slow(seq: &Bound<'_, PyAny>, i: usize) -> PyResult<i32> {
    let py = seq.py();
    if let Some(e) = PyErr::take(py) {
        // PyList_GetItem's IndexError (the list shrank meanwhile) or PyLong_AsLongLong's OverflowError.
        if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py) {
            return Err(bad_argument(bad_token(i, "an int beyond 64 bits").to_string()));
        }
        return Err(e);
    }
    let obj = seq.get_item(i).map_err(|e| raised_by(py, "token_ids", e))?;
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(bad_argument(format!("token_ids[{i}] must be an int, got bool {obj:?}")));
    }
    let v: i64 = obj.extract().map_err(|_| {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        bad_argument(format!("token_ids[{i}] must be an int, got {ty}"))
    })?;
    if !(0..TOKEN_LIMIT).contains(&v) {
        return Err(bad_argument(bad_token(i, v).to_string()));
    }
    Ok(v as i32)
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
                Err(bad_argument(format!("namespace must be str, bytes or None, got {}", o.get_type().name()?)))
            }
        }
    }
}

/// What this build of kvtier has: its version, whether the CUDA copy kernel is compiled in, the CUDA runtime
/// version, the CUDA devices visible now (0 without a driver), and the nvcc that compiled the kernel: its version
/// and where the build found it (None without the kernel).
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("cuda", kvtier::executor::cuda::COMPILED)?;
    d.set_item("cuda_runtime_version", kvtier::executor::cuda::runtime_version())?;
    d.set_item("cuda_devices", py.detach(kvtier::executor::cuda::device_count))?;
    d.set_item("nvcc", kvtier::executor::cuda::NVCC_VERSION)?;
    d.set_item("nvcc_source", kvtier::executor::cuda::NVCC_SOURCE)?;
    Ok(d)
}

/// The statistics a cache reports: `(name, kind, help)` for each, kind "counter" or "gauge" (rust/index/stats.rs).
#[pyfunction]
fn stat_table() -> Vec<(&'static str, &'static str, &'static str)> {
    kvtier::index::stats::TABLE.iter().map(|s| (s.name, s.kind.name(), s.help)).collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("KEY_SCHEME", kvtier::index::chain::KEY_SCHEME)?;
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("StaleLookupError", py.get_type::<StaleLookupError>())?;
    m.add("CopyError", py.get_type::<CopyError>())?;
    let bad = BAD_ARGUMENT.get_or_try_init(py, || {
        let bases = [py.get_type::<PyValueError>(), py.get_type::<PyTypeError>()];
        let doc = "A caller's mistake: a bad argument, or an exception the caller's own object raised while kvtier \
                   read it (then its __cause__).";
        exception_type(py, "BadArgument", &bases, doc)
    })?;
    m.add("BadArgument", bad.bind(py))?;
    let mismatch = PROMPT_MISMATCH.get_or_try_init(py, || {
        let doc = "A request id was used for a prompt that does not extend the tokens already hashed for it (a \
                   request's tokens only grow until forget()).";
        exception_type(py, "PromptMismatchError", &[bad.bind(py).clone()], doc)
    })?;
    m.add("PromptMismatchError", mismatch.bind(py))?;
    m.add_class::<NeverType>()?;
    m.add("NEVER", Py::new(py, NeverType)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(stat_table, m)?)?;
    index::register(m)?;
    l3::register(m)?;
    objects::register(m)?;
    copy::register(m)?;
    cache::register(m)?;
    Ok(())
}

/// A numpy int32 array from u32 slots (slot counts are bounded by u32 -> i32 checks at construction).
pub(crate) fn slots_array<'py>(py: Python<'py>, slots: &[u32]) -> Bound<'py, PyArray1<i32>> {
    PyArray1::from_iter(py, slots.iter().map(|&s| s as i32))
}
