//! The CUDA runtime calls kvtier makes (through cuda/copy.h): build probes, host registration, the page-copy
//! launcher, the copy engine's batch copy, copy streams and events. Without CUDA compiled in, every call that needs it fails with
//! `Error::Copy("CUDA is not compiled in")` and the probes report nothing.
use std::ffi::c_void;

use crate::error::{Error, Result};

#[cfg(kvtier_cuda)]
mod ffi {
    use std::ffi::{c_char, c_void};

    #[repr(C)]
    pub struct CopyDesc {
        pub layers: *const super::Layer,
        pub num_layers: u32,
        pub segment_bytes: u64,
        pub host_base: u64,
        pub slot_bytes: u64,
        pub device: i32,
        pub ctas: u32,
        pub threads: u32,
        pub to_host: i32,
        pub debug_sync: i32,
    }

    extern "C" {
        pub fn kvtier_cuda_runtime_version() -> i32;
        pub fn kvtier_cuda_device_count() -> i32;
        pub fn kvtier_cuda_error_string(code: i32) -> *const c_char;
        pub fn kvtier_cuda_host_register(ptr: *mut c_void, bytes: usize) -> i32;
        pub fn kvtier_cuda_host_unregister(ptr: *mut c_void) -> i32;
        pub fn kvtier_host_vmm_granularity(granularity: *mut usize) -> i32;
        pub fn kvtier_host_vmm_reserve(bytes: usize, base: *mut u64) -> i32;
        pub fn kvtier_host_vmm_map(at: u64, bytes: usize) -> i32;
        pub fn kvtier_host_vmm_unmap(at: u64, bytes: usize) -> i32;
        pub fn kvtier_host_vmm_free(base: u64, bytes: usize) -> i32;
        pub fn kvtier_copy_pages(
            desc: *const CopyDesc,
            gpu_ids: *const i32,
            host_ids: *const i32,
            n: usize,
            stream: *mut c_void,
        ) -> i32;
        pub fn kvtier_cuda_event_create(device: i32, timing: i32, event: *mut *mut c_void) -> i32;
        pub fn kvtier_cuda_event_elapsed_ms(start: *mut c_void, end: *mut c_void, ms: *mut f32) -> i32;
        pub fn kvtier_cuda_event_record(event: *mut c_void, stream: *mut c_void) -> i32;
        pub fn kvtier_cuda_event_query(event: *mut c_void) -> i32;
        pub fn kvtier_cuda_event_synchronize(event: *mut c_void) -> i32;
        pub fn kvtier_cuda_event_destroy(event: *mut c_void) -> i32;
        pub fn kvtier_cuda_stream_wait_event(stream: *mut c_void, event: *mut c_void) -> i32;
        pub fn kvtier_cuda_stream_create(device: i32, stream: *mut *mut c_void) -> i32;
        pub fn kvtier_cuda_stream_destroy(stream: *mut c_void) -> i32;
        pub fn kvtier_cuda_dma_supported() -> i32;
        pub fn kvtier_cuda_allocation_base(ptr: u64, base: *mut u64) -> i32;
        pub fn kvtier_memcpy_2d_batch(
            device: i32,
            ops: *const super::Copy2d,
            n: usize,
            to_host: i32,
            stream: *mut c_void,
            debug_sync: i32,
        ) -> i32;
        pub fn kvtier_memcpy_batch(
            device: i32,
            dsts: *const *mut c_void,
            srcs: *const *const c_void,
            sizes: *const usize,
            n: usize,
            stream: *mut c_void,
            debug_sync: i32,
        ) -> i32;
    }
}

/// True when the copy kernel is compiled in.
pub const COMPILED: bool = cfg!(kvtier_cuda);

/// The version of the nvcc that compiled the kernel, and where the build found it (build.rs); None without it.
pub const NVCC_VERSION: Option<&str> = option_env!("KVTIER_NVCC_VERSION");
pub const NVCC_SOURCE: Option<&str> = option_env!("KVTIER_NVCC_SOURCE");

/// Most layer tensors a GPU pool may have (`KVTIER_MAX_LAYERS` in cuda/copy.h).
pub const MAX_LAYERS: usize = 256;

/// One GPU layer tensor of a page pool: block b's segment of a page is at `base + b * stride` (bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layer {
    pub base: u64,
    pub stride: u64,
}

/// Where a batch of page copies goes and how it is launched (see `kvtier_copy_pages` in cuda/copy.h).
#[derive(Debug, Clone, Copy)]
pub struct Launch<'a> {
    pub layers: &'a [Layer],
    pub segment_bytes: u64,
    pub host_base: u64,
    pub slot_bytes: u64,
    pub device: i32,
    pub ctas: u32,
    pub threads: u32,
    pub to_host: bool,
    pub debug_sync: bool,
}

/// The CUDA runtime version compiled in (e.g. 13000), or None.
pub fn runtime_version() -> Option<i32> {
    #[cfg(kvtier_cuda)]
    // SAFETY: a pure query with no arguments.
    return Some(unsafe { ffi::kvtier_cuda_runtime_version() });
    #[cfg(not(kvtier_cuda))]
    None
}

/// Visible CUDA devices; 0 without CUDA compiled in, without a driver or without a device.
pub fn device_count() -> i32 {
    #[cfg(kvtier_cuda)]
    // SAFETY: a pure query; the launcher clears the error state a missing driver leaves.
    return unsafe { ffi::kvtier_cuda_device_count() };
    #[cfg(not(kvtier_cuda))]
    0
}

#[cfg(kvtier_cuda)]
fn check(code: i32, what: &str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: cudaGetErrorString returns a static NUL-terminated string for any code.
    let msg = unsafe { std::ffi::CStr::from_ptr(ffi::kvtier_cuda_error_string(code)) };
    Err(Error::Copy(format!("{what}: CUDA error {code}: {}", msg.to_string_lossy())))
}

#[cfg(not(kvtier_cuda))]
fn not_compiled<T>() -> Result<T> {
    Err(Error::Copy("CUDA is not compiled in".into()))
}

/// Page-lock and map `bytes` of host memory at `ptr` for every device.
///
/// # Safety
/// `ptr..ptr + bytes` must be mapped memory that stays mapped until `host_unregister(ptr)`.
pub unsafe fn host_register(ptr: *mut u8, bytes: usize) -> Result<()> {
    #[cfg(kvtier_cuda)]
    return check(ffi::kvtier_cuda_host_register(ptr.cast(), bytes), "cudaHostRegister");
    #[cfg(not(kvtier_cuda))]
    {
        let _ = (ptr, bytes);
        not_compiled()
    }
}

/// Undo `host_register(ptr, ..)`.
///
/// # Safety
/// No copy may still be reading or writing the range.
pub unsafe fn host_unregister(ptr: *mut u8) -> Result<()> {
    #[cfg(kvtier_cuda)]
    return check(ffi::kvtier_cuda_host_unregister(ptr.cast()), "cudaHostUnregister");
    #[cfg(not(kvtier_cuda))]
    {
        let _ = ptr;
        not_compiled()
    }
}

/// Host memory made by the driver (cuda/copy.h): the size its steps are multiples of, or None where the driver
/// or device has none (or CUDA is not compiled in).
pub fn host_vmm_granularity() -> Option<usize> {
    #[cfg(kvtier_cuda)]
    {
        let mut g = 0;
        // SAFETY: writes one usize.
        (unsafe { ffi::kvtier_host_vmm_granularity(&mut g) } == 0).then_some(g)
    }
    #[cfg(not(kvtier_cuda))]
    None
}

/// Reserve `bytes` of address space (a multiple of the granularity) for host memory made by the driver.
pub fn host_vmm_reserve(bytes: usize) -> Result<u64> {
    #[cfg(kvtier_cuda)]
    {
        let mut base = 0;
        // SAFETY: writes one u64.
        check(unsafe { ffi::kvtier_host_vmm_reserve(bytes, &mut base) }, "cuMemAddressReserve")?;
        Ok(base)
    }
    #[cfg(not(kvtier_cuda))]
    {
        let _ = bytes;
        not_compiled()
    }
}

/// Back `at..at + bytes` of a reserved range with pinned host memory, readable and writable by the CPU and every
/// device.
///
/// # Safety
/// The range lies in a range of `host_vmm_reserve`, unmapped, its ends multiples of the granularity.
pub unsafe fn host_vmm_map(at: u64, bytes: usize) -> Result<()> {
    #[cfg(kvtier_cuda)]
    return check(ffi::kvtier_host_vmm_map(at, bytes), "cuMemCreate/cuMemMap/cuMemSetAccess");
    #[cfg(not(kvtier_cuda))]
    {
        let _ = (at, bytes);
        not_compiled()
    }
}

/// Undo `host_vmm_map(at, bytes)`, freeing the memory.
///
/// # Safety
/// No copy and no CPU access may still touch the range.
pub unsafe fn host_vmm_unmap(at: u64, bytes: usize) -> Result<()> {
    #[cfg(kvtier_cuda)]
    return check(ffi::kvtier_host_vmm_unmap(at, bytes), "cuMemUnmap");
    #[cfg(not(kvtier_cuda))]
    {
        let _ = (at, bytes);
        not_compiled()
    }
}

/// Give back a range of `host_vmm_reserve`, every step of it unmapped.
///
/// # Safety
/// Nothing in the range is mapped or used.
pub unsafe fn host_vmm_free(base: u64, bytes: usize) -> Result<()> {
    #[cfg(kvtier_cuda)]
    return check(ffi::kvtier_host_vmm_free(base, bytes), "cuMemAddressFree");
    #[cfg(not(kvtier_cuda))]
    {
        let _ = (base, bytes);
        not_compiled()
    }
}

/// Launch the page copies of a batch on `stream` without waiting for them.
///
/// # Safety
/// Every address the ids reach through `l` must be valid device-accessible memory (device memory or pinned host
/// memory) until the copies complete on the stream; `stream` must be a stream of `l.device` or 0.
pub unsafe fn copy_pages(l: &Launch<'_>, gpu_ids: &[i32], host_ids: &[i32], stream: u64) -> Result<()> {
    debug_assert_eq!(gpu_ids.len(), host_ids.len());
    #[cfg(kvtier_cuda)]
    {
        let desc = ffi::CopyDesc {
            layers: l.layers.as_ptr(),
            num_layers: u32::try_from(l.layers.len()).expect("layer count checked by the caller"),
            segment_bytes: l.segment_bytes,
            host_base: l.host_base,
            slot_bytes: l.slot_bytes,
            device: l.device,
            ctas: l.ctas,
            threads: l.threads,
            to_host: i32::from(l.to_host),
            debug_sync: i32::from(l.debug_sync),
        };
        let code =
            ffi::kvtier_copy_pages(&desc, gpu_ids.as_ptr(), host_ids.as_ptr(), gpu_ids.len(), stream as *mut c_void);
        check(code, "page copy kernel")
    }
    #[cfg(not(kvtier_cuda))]
    {
        let _ = (l, gpu_ids, host_ids, stream);
        not_compiled()
    }
}

/// Whether the copy engine's batch copy (cudaMemcpyBatchAsync) is compiled in and the driver has it.
pub fn dma_supported() -> bool {
    #[cfg(kvtier_cuda)]
    // SAFETY: a pure query.
    return unsafe { ffi::kvtier_cuda_dma_supported() } == 1;
    #[cfg(not(kvtier_cuda))]
    false
}

/// One copy-engine batch: `dsts[i] <- srcs[i]`, `sizes[i]` bytes, on `stream` (not the legacy default stream).
///
/// # Safety
/// Every range must be valid device-accessible memory until the copies complete on the stream.
pub unsafe fn memcpy_batch(
    device: i32,
    dsts: &[u64],
    srcs: &[u64],
    sizes: &[usize],
    stream: u64,
    debug_sync: bool,
) -> Result<()> {
    debug_assert!(dsts.len() == srcs.len() && srcs.len() == sizes.len());
    #[cfg(kvtier_cuda)]
    {
        let code = ffi::kvtier_memcpy_batch(
            device,
            dsts.as_ptr().cast(),
            srcs.as_ptr().cast(),
            sizes.as_ptr(),
            sizes.len(),
            stream as *mut c_void,
            i32::from(debug_sync),
        );
        check(code, "cudaMemcpyBatchAsync")
    }
    #[cfg(not(kvtier_cuda))]
    {
        let _ = (device, dsts, srcs, sizes, stream, debug_sync);
        not_compiled()
    }
}

/// The base address of the CUDA allocation that holds device address `ptr`, or None (not a CUDA allocation, or no
/// driver entry point).
pub fn allocation_base(ptr: u64) -> Option<u64> {
    #[cfg(kvtier_cuda)]
    {
        let mut base = 0;
        // SAFETY: a pure query; `base` is a valid out-pointer.
        let code = unsafe { ffi::kvtier_cuda_allocation_base(ptr, &mut base) };
        (code == 0).then_some(base)
    }
    #[cfg(not(kvtier_cuda))]
    {
        let _ = ptr;
        None
    }
}

/// One 2D copy (`kvtier_copy2d` in cuda/copy.h): `height` rows of `width` bytes, `dev_pitch` bytes apart on the GPU
/// side and `host_pitch` apart on the host side (pitches unused for one row).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy2d {
    pub dev: u64,
    pub host: u64,
    pub width: u64,
    pub height: u64,
    pub dev_pitch: u64,
    pub host_pitch: u64,
}

/// One copy-engine batch of 2D copies (cudaMemcpy3DBatchAsync), device to host when `to_host`, on `stream` (not the
/// legacy default stream).
///
/// # Safety
/// Every row of every copy must be valid device-accessible memory until the copies complete on the stream.
pub unsafe fn memcpy_2d_batch(device: i32, ops: &[Copy2d], to_host: bool, stream: u64, debug_sync: bool) -> Result<()> {
    #[cfg(kvtier_cuda)]
    {
        let code = ffi::kvtier_memcpy_2d_batch(
            device,
            ops.as_ptr(),
            ops.len(),
            i32::from(to_host),
            stream as *mut c_void,
            i32::from(debug_sync),
        );
        check(code, "cudaMemcpy3DBatchAsync")
    }
    #[cfg(not(kvtier_cuda))]
    {
        let _ = (device, ops, to_host, stream, debug_sync);
        not_compiled()
    }
}

/// A non-blocking CUDA stream kvtier creates for its copies, destroyed on drop.
#[derive(Debug)]
pub struct Stream(#[cfg_attr(not(kvtier_cuda), allow(dead_code))] *mut c_void);

// SAFETY: a CUDA stream handle may be used from any host thread.
unsafe impl Send for Stream {}
// SAFETY: CUDA's stream calls are thread-safe; the handle itself is never mutated.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(device: i32) -> Result<Self> {
        #[cfg(kvtier_cuda)]
        {
            let mut s = std::ptr::null_mut();
            // SAFETY: `s` is a valid out-pointer.
            check(unsafe { ffi::kvtier_cuda_stream_create(device, &mut s) }, "cudaStreamCreateWithFlags")?;
            Ok(Self(s))
        }
        #[cfg(not(kvtier_cuda))]
        {
            let _ = device;
            not_compiled()
        }
    }

    /// The raw cudaStream_t.
    pub fn handle(&self) -> u64 {
        self.0 as u64
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        #[cfg(kvtier_cuda)]
        // SAFETY: created by kvtier_cuda_stream_create and destroyed once; CUDA lets queued work finish first.
        unsafe {
            ffi::kvtier_cuda_stream_destroy(self.0);
        }
    }
}

/// A CUDA event (a completion event without timing, or a timing one), destroyed on drop. (Without CUDA compiled in
/// none is ever made.)
#[derive(Debug)]
pub struct Event(#[cfg_attr(not(kvtier_cuda), allow(dead_code))] *mut c_void);

// SAFETY: a CUDA event handle may be used from any host thread.
unsafe impl Send for Event {}
// SAFETY: CUDA's event calls are thread-safe; the handle itself is never mutated.
unsafe impl Sync for Event {}

impl Event {
    /// A completion event (timing disabled: the cheapest to record and query).
    pub fn new(device: i32) -> Result<Self> {
        Self::create(device, false)
    }

    /// A timing event, for `elapsed_s`.
    pub fn timing(device: i32) -> Result<Self> {
        Self::create(device, true)
    }

    fn create(device: i32, timing: bool) -> Result<Self> {
        #[cfg(kvtier_cuda)]
        {
            let mut ev = std::ptr::null_mut();
            // SAFETY: `ev` is a valid out-pointer.
            check(unsafe { ffi::kvtier_cuda_event_create(device, i32::from(timing), &mut ev) }, "cudaEventCreate")?;
            Ok(Self(ev))
        }
        #[cfg(not(kvtier_cuda))]
        {
            let _ = (device, timing);
            not_compiled()
        }
    }

    /// Seconds from this timing event to `end`, both recorded and complete.
    pub fn elapsed_s(&self, end: &Event) -> Result<f64> {
        #[cfg(kvtier_cuda)]
        {
            let mut ms = 0f32;
            // SAFETY: both events are live; `ms` is a valid out-pointer.
            check(unsafe { ffi::kvtier_cuda_event_elapsed_ms(self.0, end.0, &mut ms) }, "cudaEventElapsedTime")?;
            Ok(f64::from(ms) / 1e3)
        }
        #[cfg(not(kvtier_cuda))]
        {
            let _ = end;
            not_compiled()
        }
    }

    /// Record the event on `stream` (a raw cudaStream_t of the event's device, or 0).
    pub fn record(&self, stream: u64) -> Result<()> {
        #[cfg(kvtier_cuda)]
        // SAFETY: the event is live; the stream handle comes from the caller's framework.
        return check(unsafe { ffi::kvtier_cuda_event_record(self.0, stream as *mut c_void) }, "cudaEventRecord");
        #[cfg(not(kvtier_cuda))]
        {
            let _ = stream;
            not_compiled()
        }
    }

    /// Make `stream` wait, on the GPU, for the work recorded before the event (the host does not wait).
    pub fn wait_in(&self, stream: u64) -> Result<()> {
        #[cfg(kvtier_cuda)]
        // SAFETY: the event is live; the stream handle comes from the caller.
        return check(
            unsafe { ffi::kvtier_cuda_stream_wait_event(stream as *mut c_void, self.0) },
            "cudaStreamWaitEvent",
        );
        #[cfg(not(kvtier_cuda))]
        {
            let _ = stream;
            not_compiled()
        }
    }

    /// Whether the work before the event has completed; never blocks.
    pub fn done(&self) -> Result<bool> {
        #[cfg(kvtier_cuda)]
        {
            // SAFETY: the event is live.
            let code = unsafe { ffi::kvtier_cuda_event_query(self.0) };
            if code == 1 {
                return Ok(false);
            }
            check(code, "cudaEventQuery").map(|()| true)
        }
        #[cfg(not(kvtier_cuda))]
        not_compiled()
    }

    /// Block until the work before the event has completed.
    pub fn wait(&self) -> Result<()> {
        #[cfg(kvtier_cuda)]
        // SAFETY: the event is live.
        return check(unsafe { ffi::kvtier_cuda_event_synchronize(self.0) }, "cudaEventSynchronize");
        #[cfg(not(kvtier_cuda))]
        not_compiled()
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        #[cfg(kvtier_cuda)]
        // SAFETY: the event was created by kvtier_cuda_event_create and is destroyed once.
        unsafe {
            ffi::kvtier_cuda_event_destroy(self.0);
        }
    }
}
