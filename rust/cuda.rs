//! What the build compiled in: the CUDA runtime version and the devices visible now.

#[cfg(kvtier_cuda)]
mod ffi {
    extern "C" {
        pub fn kvtier_cuda_runtime_version() -> i32;
        pub fn kvtier_cuda_device_count() -> i32;
    }
}

/// True when the copy kernel is compiled in.
pub const COMPILED: bool = cfg!(kvtier_cuda);

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
