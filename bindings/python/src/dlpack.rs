//! Layer tensors of a GPU pool through DLPack: the object's `__dlpack__` capsule is read for the memory's address,
//! shape, strides, dtype and device, and the capsule is kept unconsumed for as long as the copier lives, so the
//! producer (torch) keeps the memory alive. No address crosses the Python API as an int.
use std::ffi::{c_void, CStr};

use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::bad_argument;

use kvtier::executor::copy::LayerTensor;
use kvtier::executor::cuda::Layer;

/// The structs of the DLPack ABI (dlpack.h, unversioned `dltensor` capsules), as far as they are read here.
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    _manager_ctx: *mut c_void,
    _deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

const DLTENSOR: &CStr = c"dltensor";
const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_UINT: u8 = 1;

/// What a DLPack capsule says of a tensor's memory.
struct Tensor {
    /// The first element's address (`data + byte_offset`).
    addr: u64,
    shape: Vec<i64>,
    /// In elements (DLPack's unit), row-major when the producer gave none.
    strides: Vec<i64>,
    dtype: (u8, u8, u16),
    device: Option<i32>,
    /// The unconsumed capsule: while it lives, so does the memory.
    owner: Py<PyAny>,
}

/// Reads `obj` (anything with `__dlpack__`: a torch tensor, a numpy array); `name` names it in errors. The largest
/// function of the bindings, and conversion only, as all of them are: it turns a capsule into the numbers the core
/// checks (`GpuPool::of_layers`, the copier's block ids, `l3::path::Regions`); no rule lives here.
fn tensor(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Tensor> {
    let ty = || obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    if !obj.hasattr("__dlpack__")? {
        return Err(bad_argument(format!("{name} must be a tensor with __dlpack__, got {}", ty())));
    }
    let (device_type, _): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
    // No stream synchronization: the capsule is only read for where the memory is, never for its contents.
    let capsule = if device_type == KDL_CUDA {
        let kw = pyo3::types::PyDict::new(obj.py());
        kw.set_item("stream", -1)?;
        obj.call_method("__dlpack__", (), Some(&kw))?
    } else {
        obj.call_method0("__dlpack__")?
    };
    let cap = capsule.cast::<PyCapsule>().map_err(|_| bad_argument(format!("{name}.__dlpack__() is not a capsule")))?;
    let ptr = cap.pointer_checked(Some(DLTENSOR))?;
    // SAFETY: a live `dltensor` capsule points at a DLManagedTensor its producer keeps valid until the capsule's
    // deleter runs; the capsule is held (unconsumed) in the result, and the fields are read before any Python code
    // runs.
    let t = unsafe { &ptr.cast::<DLManagedTensor>().as_ref().dl_tensor };
    let ndim = usize::try_from(t.ndim).map_err(|_| bad_argument(format!("{name}: ndim {}", t.ndim)))?;
    // SAFETY: `shape` holds `ndim` values; `strides` too, or is null for a compact row-major tensor.
    let shape = if ndim == 0 { Vec::new() } else { unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec() };
    let strides = if t.strides.is_null() {
        let mut st = vec![1i64; ndim];
        for d in (0..ndim.saturating_sub(1)).rev() {
            st[d] = st[d + 1] * shape[d + 1];
        }
        st
    } else {
        unsafe { std::slice::from_raw_parts(t.strides, ndim) }.to_vec()
    };
    let device = match t.device.device_type {
        KDL_CPU => None,
        KDL_CUDA => Some(t.device.device_id),
        other => {
            return Err(bad_argument(format!(
                "{name} must be on the CPU or a CUDA device, got DLPack device type {other}"
            )))
        }
    };
    Ok(Tensor {
        addr: t.data as u64 + t.byte_offset,
        shape,
        strides,
        dtype: (t.dtype.code, t.dtype.bits, t.dtype.lanes),
        device,
        owner: capsule.unbind(),
    })
}

/// Reads `obj` as a layer tensor of a GPU pool (uint8 `[num_blocks, segment_bytes]`, rows contiguous), and the
/// capsule that keeps its memory alive; `name` names it in errors.
pub(crate) fn layer_tensor(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<(LayerTensor, Py<PyAny>)> {
    let t = tensor(obj, name)?;
    let (code, bits, lanes) = t.dtype;
    if (code, bits, lanes) != (KDL_UINT, 8, 1) {
        return Err(bad_argument(format!(
            "{name} must have dtype uint8 (view other dtypes as bytes), got DLPack dtype code {code} bits {bits} \
             lanes {lanes}"
        )));
    }
    if t.shape.len() != 2 {
        return Err(bad_argument(format!(
            "{name} must be 2-D [num_blocks, bytes per block], got {} dimension(s)",
            t.shape.len()
        )));
    }
    if t.strides[1] != 1 && t.shape[1] > 1 {
        return Err(bad_argument(format!(
            "{name} must have contiguous rows (stride 1 within a block), got strides {:?}",
            t.strides
        )));
    }
    let non_negative =
        |v: i64, what: &str| u64::try_from(v).map_err(|_| bad_argument(format!("{name} has a negative {what}: {v}")));
    let layer = LayerTensor {
        layer: Layer { base: t.addr, stride: non_negative(t.strides[0], "block stride")? },
        num_blocks: non_negative(t.shape[0], "shape")?,
        segment_bytes: non_negative(t.shape[1], "shape")?,
        device: t.device,
    };
    Ok((layer, t.owner))
}

/// Host memory an object path may move objects from and into: `(address, bytes)` of a CPU tensor's elements, and
/// its capsule, which keeps the memory alive while held.
pub(crate) fn host_region(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<((usize, usize), Py<PyAny>)> {
    let t = tensor(obj, name)?;
    if t.device.is_some() {
        return Err(bad_argument(format!("{name} must be CPU memory, got a CUDA tensor")));
    }
    let (_, bits, lanes) = t.dtype;
    let item = (usize::from(bits) * usize::from(lanes)).div_ceil(8);
    let mut last = 0usize; // offset of the last element, in elements
    for (&n, &st) in t.shape.iter().zip(&t.strides) {
        if n == 0 {
            return Ok(((t.addr as usize, 0), t.owner));
        }
        let st =
            usize::try_from(st).map_err(|_| bad_argument(format!("{name} has a negative stride: {:?}", t.strides)))?;
        last += (n as usize - 1) * st;
    }
    Ok(((t.addr as usize, (last + 1) * item), t.owner))
}
