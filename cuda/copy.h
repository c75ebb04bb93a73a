// C interface of kvtier's CUDA code, called from Rust (rust/cuda.rs).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// CUDA runtime version this object was built against (e.g. 13000).
int kvtier_cuda_runtime_version(void);

// Number of visible CUDA devices; 0 when there is no driver or device (never fails).
int kvtier_cuda_device_count(void);

#ifdef __cplusplus
}
#endif
