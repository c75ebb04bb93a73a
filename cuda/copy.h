// C interface of kvtier's CUDA code, called from Rust (rust/executor/cuda.rs). Every function that can fail returns a
// cudaError_t value (0 = success); kvtier_cuda_error_string turns it into CUDA's message.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// CUDA runtime version this object was built against (e.g. 13000).
int kvtier_cuda_runtime_version(void);

// Number of visible CUDA devices; 0 when there is no driver or device (never fails).
int kvtier_cuda_device_count(void);

// CUDA's name and description of an error code.
const char* kvtier_cuda_error_string(int code);

// Page-lock (pin) and map host memory for every device (cudaHostRegister, portable + mapped), and undo it.
int kvtier_cuda_host_register(void* ptr, size_t bytes);
int kvtier_cuda_host_unregister(void* ptr);

// Pinned host memory made by the driver (cuMemCreate on the host NUMA node nearest the device current at the first
// of these calls), mapped into one reserved range a step at a time, readable and writable by the CPU and every
// device. Copies may span the steps, and making a step does not hold up other threads' launches (cudaHostRegister
// does, for its whole time). kvtier_host_vmm_granularity gives the size steps must be multiples of, or
// cudaErrorNotSupported where the driver or device has no host allocations of this kind.
int kvtier_host_vmm_granularity(size_t* granularity);
int kvtier_host_vmm_reserve(size_t bytes, uint64_t* base);
int kvtier_host_vmm_map(uint64_t at, size_t bytes);
int kvtier_host_vmm_unmap(uint64_t at, size_t bytes);
int kvtier_host_vmm_free(uint64_t base, size_t bytes);

// One GPU layer tensor of a page pool: block b's segment of the page is at base + b * stride.
typedef struct {
  uint64_t base;
  uint64_t stride;
} kvtier_layer;

// Most layer tensors a pool may have (one for page-first pools).
#define KVTIER_MAX_LAYERS 256

// A batch of page copies between a GPU pool (num_layers tensors, segment_bytes a page per tensor) and a host pool
// (slot s at host_base + s * slot_bytes, the layer segments back to back). Page i moves between GPU block
// gpu_ids[i] and host slot host_ids[i]; to_host says which way. Ids are read on the host and passed to the kernel
// by value, so the arrays may be freed as soon as this returns. Launches on `stream` of `device` with at most
// `ctas` CUDA thread blocks of `threads` threads and never synchronizes, unless debug_sync (then it waits for the
// stream and reports the kernel's own error). Arguments are validated by the caller. A copy of some layers only
// passes those layers' tensors and host_base advanced by the first one's offset in the host page.
typedef struct {
  const kvtier_layer* layers;
  uint32_t num_layers;
  uint64_t segment_bytes;
  uint64_t host_base;
  uint64_t slot_bytes;
  int device;
  uint32_t ctas;
  uint32_t threads;
  int to_host;
  int debug_sync;
} kvtier_copy_desc;

int kvtier_copy_pages(const kvtier_copy_desc* desc, const int32_t* gpu_ids, const int32_t* host_ids, size_t n,
                      void* stream);

// Events: completion events (timing 0: timing disabled) or timing ones (timing 1, for
// kvtier_cuda_event_elapsed_ms). kvtier_cuda_event_query returns 0 when complete, 1 while pending, and a CUDA error
// code otherwise; it never blocks.
int kvtier_cuda_event_create(int device, int timing, void** event);
int kvtier_cuda_event_record(void* event, void* stream);
int kvtier_cuda_event_query(void* event);
int kvtier_cuda_event_synchronize(void* event);
int kvtier_cuda_event_destroy(void* event);
// Milliseconds between two completed timing events.
int kvtier_cuda_event_elapsed_ms(void* start, void* end, float* ms);
// Make `stream` wait (on the GPU, not the host) for the work recorded before `event`.
int kvtier_cuda_stream_wait_event(void* stream, void* event);

// kvtier's own copy streams: non-blocking (no implicit order with the legacy default stream).
int kvtier_cuda_stream_create(int device, void** stream);
int kvtier_cuda_stream_destroy(void* stream);

// Whether the copy engine path (cudaMemcpyBatchAsync) can run: built against CUDA 12.8+ and a driver that has it.
int kvtier_cuda_dma_supported(void);

// One cudaMemcpyBatchAsync of n pieces (dsts[i] <- srcs[i], sizes[i] bytes) on `stream` of `device`, in stream order,
// with the hint to overlap with compute. The arrays may be freed as soon as this returns. `stream` must not be the
// legacy default stream. debug_sync as for kvtier_copy_pages.
int kvtier_memcpy_batch(int device, void* const* dsts, const void* const* srcs, const size_t* sizes, size_t n,
                        void* stream, int debug_sync);

// The base address of the CUDA allocation that holds device address `ptr` (a 2D copy may not span two).
int kvtier_cuda_allocation_base(uint64_t ptr, uint64_t* base);

// One 2D copy between a GPU pool and host pages: `height` rows of `width` bytes, a row `dev_pitch` bytes after the
// previous one on the GPU side and `host_pitch` bytes after it on the host side (a page's segments of evenly spaced
// layers, rows back to back on the host; or one layer's segments of consecutive blocks and slots).
typedef struct {
  uint64_t dev;
  uint64_t host;
  uint64_t width;
  uint64_t height;
  uint64_t dev_pitch;
  uint64_t host_pitch;
} kvtier_copy2d;

// One cudaMemcpy3DBatchAsync of n 2D copies, device to host when to_host, on `stream` of `device` in stream order,
// with the hint to overlap with compute; otherwise as kvtier_memcpy_batch.
int kvtier_memcpy_2d_batch(int device, const kvtier_copy2d* ops, size_t n, int to_host, void* stream, int debug_sync);

#ifdef __cplusplus
}
#endif
