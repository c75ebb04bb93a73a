// kvtier's CUDA code: page copies between a GPU pool and pinned host memory through UVA pointers.
//
// The kernel sees a batch as one flat run of 16-byte vectors: page, then layer segment, then vector. Each CTA
// takes tiles of threads * kUnroll vectors, each warp a contiguous run of 32 * kUnroll of them (4 KiB); each thread
// issues all kUnroll loads of a tile before its stores, so a few CTAs keep enough PCIe requests in flight to
// reach the link's ceiling. Neighbouring lanes read neighbouring vectors whatever the segment size: small layer
// segments (a 16 KiB page over 61 layers is 272 bytes a segment) still fill whole warps, since a warp simply runs on
// into the next segment.
//
// The warp-span tiling was chosen over five other kernels (block-strided tiles, an L2 256-byte prefetch hint,
// whole segments to warps, Hopper bulk copies through shared memory) by measurement: docs/PERFORMANCE.md "Page
// copies"; those kernels are in the history at 96acb7e.
//
// Ids travel by value in the kernel parameters (CUDA 12.1+ allows 32764 bytes on sm_70+), so nothing the caller
// owns has to outlive the call and no id buffer has to be fenced with events; batches larger than one launch's
// id capacity are split into several launches on the same stream.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "copy.h"

extern "C" int kvtier_cuda_runtime_version(void) { return CUDART_VERSION; }

extern "C" int kvtier_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls start clean
    return 0;
  }
  return n;
}

extern "C" const char* kvtier_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

extern "C" int kvtier_cuda_host_register(void* ptr, size_t bytes) {
  return cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
}

extern "C" int kvtier_cuda_host_unregister(void* ptr) { return cudaHostUnregister(ptr); }

// The driver calls of host memory made by the driver, found through the runtime (no link against libcuda); their
// CUresult errors share cudaError_t's numbers.
namespace {

template <class F>
F driver_entry(const char* name) {
  void* fn = nullptr;
#if CUDART_VERSION >= 12050
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12020, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    fn = nullptr;
  }
#else
  (void)name;
#endif
  return reinterpret_cast<F>(fn);
}

struct HostVmm {
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  size_t granularity = 0;
  int numa = 0;
  int devices = 0;
  CUmemAllocationProp prop;
};

// Found once, for the device current at the first call; nullptr where not supported.
const HostVmm* host_vmm() {
  static const HostVmm* vmm = []() -> const HostVmm* {
    static HostVmm v;
    auto attribute = driver_entry<decltype(&cuDeviceGetAttribute)>("cuDeviceGetAttribute");
    auto granularity = driver_entry<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
    v.create = driver_entry<decltype(&cuMemCreate)>("cuMemCreate");
    v.release = driver_entry<decltype(&cuMemRelease)>("cuMemRelease");
    v.reserve = driver_entry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
    v.free = driver_entry<decltype(&cuMemAddressFree)>("cuMemAddressFree");
    v.map = driver_entry<decltype(&cuMemMap)>("cuMemMap");
    v.unmap = driver_entry<decltype(&cuMemUnmap)>("cuMemUnmap");
    v.set_access = driver_entry<decltype(&cuMemSetAccess)>("cuMemSetAccess");
    int device = 0, supported = 0;
    if (!attribute || !granularity || !v.create || !v.release || !v.reserve || !v.free || !v.map || !v.unmap ||
        !v.set_access || cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceCount(&v.devices) != cudaSuccess ||
        attribute(&supported, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device) != 0 ||
        !supported || attribute(&v.numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device) != 0) {
      cudaGetLastError();
      return nullptr;
    }
    if (v.numa < 0) v.numa = 0;  // no NUMA: node 0 is all of the host
    std::memset(&v.prop, 0, sizeof(v.prop));
    v.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    v.prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    v.prop.location.id = v.numa;
    if (granularity(&v.granularity, &v.prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != 0 || v.granularity == 0) {
      return nullptr;
    }
    return &v;
  }();
  return vmm;
}

}  // namespace

extern "C" int kvtier_host_vmm_granularity(size_t* granularity) {
  const HostVmm* v = host_vmm();
  if (v == nullptr) return cudaErrorNotSupported;
  *granularity = v->granularity;
  return cudaSuccess;
}

extern "C" int kvtier_host_vmm_reserve(size_t bytes, uint64_t* base) {
  const HostVmm* v = host_vmm();
  if (v == nullptr) return cudaErrorNotSupported;
  CUdeviceptr ptr = 0;
  const int err = v->reserve(&ptr, bytes, v->granularity, 0, 0);
  *base = ptr;
  return err;
}

extern "C" int kvtier_host_vmm_map(uint64_t at, size_t bytes) {
  const HostVmm* v = host_vmm();
  if (v == nullptr) return cudaErrorNotSupported;
  CUmemGenericAllocationHandle handle;
  int err = v->create(&handle, bytes, &v->prop, 0);
  if (err != 0) return err;
  err = v->map(at, bytes, 0, handle, 0);
  v->release(handle);  // the mapping keeps the memory until it is unmapped
  if (err != 0) return err;
  // Read and write for the CPU and for every device, as cudaHostRegisterPortable gives.
  CUmemAccessDesc access[64];
  const int n = std::min(v->devices, 63);
  std::memset(access, 0, sizeof(access));
  for (int d = 0; d < n; ++d) {
    access[d].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[d].location.id = d;
    access[d].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  access[n].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  access[n].location.id = v->numa;
  access[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  err = v->set_access(at, bytes, access, n + 1);
  if (err != 0) v->unmap(at, bytes);
  return err;
}

extern "C" int kvtier_host_vmm_unmap(uint64_t at, size_t bytes) {
  const HostVmm* v = host_vmm();
  return v == nullptr ? cudaErrorNotSupported : v->unmap(at, bytes);
}

extern "C" int kvtier_host_vmm_free(uint64_t base, size_t bytes) {
  const HostVmm* v = host_vmm();
  return v == nullptr ? cudaErrorNotSupported : v->free(base, bytes);
}

namespace {

constexpr int kUnroll = 8;  // 16-byte loads in flight per thread
constexpr int kParamBytes = 32764;

// Division by a divisor fixed for a launch, without the ~20-instruction integer divide: a multiply-high and a
// shift (the round-up method of Granlund and Montgomery), exact for every dividend below 2^31, which the launch
// keeps (see `launch`).
struct Divisor {
  uint32_t d;
  uint32_t magic;
  uint32_t shift;

  __host__ void init(uint32_t divisor) {
    d = divisor;
    shift = 0;
    while ((1ull << shift) < divisor) ++shift;
    magic = static_cast<uint32_t>(((1ull << 32) * ((1ull << shift) - divisor)) / divisor + 1);
  }

  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(__umulhi(n, magic)) + n) >> shift);
  }
};

struct Head {
  uint64_t host_base;
  uint64_t slot_bytes;
  Divisor segment_vecs;  // 16-byte vectors in one layer segment
  Divisor layers;
  uint32_t to_host;
  uint32_t pad[3];
};

template <int L, int N>
struct Params {
  Head h;
  kvtier_layer layer[L];
  int32_t gpu_id[N];
  int32_t host_id[N];
};

// Id capacity of one launch: as many as fit in the parameter space beside the head and the layer table.
template <int L>
constexpr int kMaxIds = (kParamBytes - static_cast<int>(sizeof(Head)) - L * static_cast<int>(sizeof(kvtier_layer))) / 8 / 16 * 16;
constexpr int kSmallIds = 128;  // small batches (states, a few pages) copy a few hundred bytes of parameters only

static_assert(sizeof(Params<1, kMaxIds<1>>) <= kParamBytes, "parameter space");
static_assert(sizeof(Params<KVTIER_MAX_LAYERS, kMaxIds<KVTIER_MAX_LAYERS>>) <= kParamBytes, "parameter space");

template <int L, int N>
__device__ __forceinline__ void locate(const Params<L, N>& p, uint32_t g, const uint4*& src, uint4*& dst) {
  const uint32_t c = p.h.segment_vecs.div(g);
  const uint32_t v = g - c * p.h.segment_vecs.d;
  const uint32_t page = L == 1 ? c : p.h.layers.div(c);
  const uint32_t l = L == 1 ? 0 : c - page * p.h.layers.d;
  const kvtier_layer& layer = p.layer[l];
  char* dev = reinterpret_cast<char*>(layer.base) + static_cast<uint64_t>(p.gpu_id[page]) * layer.stride +
              static_cast<uint64_t>(v) * 16;
  char* host = reinterpret_cast<char*>(p.h.host_base) + static_cast<uint64_t>(p.host_id[page]) * p.h.slot_bytes +
               (static_cast<uint64_t>(l) * p.h.segment_vecs.d + v) * 16;
  src = reinterpret_cast<const uint4*>(p.h.to_host ? dev : host);
  dst = reinterpret_cast<uint4*>(p.h.to_host ? host : dev);
}

// A CTA takes tiles of blockDim.x * kUnroll vectors; a warp's kUnroll loads cover 32 * kUnroll neighbouring
// vectors (4 KiB), lane-interleaved, all issued before the stores.
template <int L, int N>
__global__ void __launch_bounds__(1024) copy_pages_kernel(const __grid_constant__ Params<L, N> p, uint32_t total) {
  const uint32_t tile = blockDim.x * kUnroll;
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t base = (threadIdx.x - lane) * kUnroll + lane;
  constexpr uint32_t step = 32;
  for (uint32_t t0 = blockIdx.x * tile; t0 < total; t0 += gridDim.x * tile) {
    uint4 v[kUnroll];
    uint4* dst[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t g = t0 + base + k * step;
      if (g < total) {
        const uint4* src;
        locate(p, g, src, dst[k]);
        v[k] = __ldcs(src);  // streaming: the pages are not read again soon, keep L2 for the model
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (t0 + base + k * step < total) __stcs(dst[k], v[k]);
    }
  }
}

template <int L, int N>
int launch(const kvtier_copy_desc* d, const int32_t* gpu_ids, const int32_t* host_ids, size_t n, cudaStream_t s) {
  Params<L, N> p;
  p.h.host_base = d->host_base;
  p.h.slot_bytes = d->slot_bytes;
  p.h.segment_vecs.init(static_cast<uint32_t>(d->segment_bytes / 16));
  p.h.layers.init(d->num_layers);
  p.h.to_host = d->to_host ? 1 : 0;
  std::memset(p.h.pad, 0, sizeof(p.h.pad));
  std::memcpy(p.layer, d->layers, sizeof(kvtier_layer) * d->num_layers);
  const uint64_t page_vecs = static_cast<uint64_t>(p.h.segment_vecs.d) * d->num_layers;
  // The kernel indexes vectors with 32 bits: keep each launch below 2^31 of them.
  const size_t per_launch = std::min<uint64_t>(N, (static_cast<uint64_t>(INT_MAX) - 1) / page_vecs);
  const uint32_t tile = d->threads * kUnroll;
  for (size_t off = 0; off < n; off += per_launch) {
    const size_t m = std::min(per_launch, n - off);
    std::memcpy(p.gpu_id, gpu_ids + off, m * sizeof(int32_t));
    std::memcpy(p.host_id, host_ids + off, m * sizeof(int32_t));
    const uint32_t total = static_cast<uint32_t>(m * page_vecs);
    const uint32_t grid = std::min<uint32_t>(d->ctas, (total + tile - 1) / tile);
    copy_pages_kernel<L, N><<<grid, d->threads, 0, s>>>(p, total);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

int set_device(int device) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  return err;
}

}  // namespace

extern "C" int kvtier_copy_pages(const kvtier_copy_desc* d, const int32_t* gpu_ids, const int32_t* host_ids,
                                 size_t n, void* stream) {
  if (n == 0) return cudaSuccess;
  if (d->num_layers == 0 || d->num_layers > KVTIER_MAX_LAYERS || d->segment_bytes == 0 || d->segment_bytes % 16 != 0 ||
      d->segment_bytes / 16 * d->num_layers >= INT_MAX || d->threads == 0 || d->threads > 1024 ||
      d->threads % 32 != 0 || d->ctas == 0)
    return cudaErrorInvalidValue;
  int err = set_device(d->device);
  if (err != cudaSuccess) return err;
  auto s = static_cast<cudaStream_t>(stream);
  if (d->num_layers == 1)
    err = n <= kSmallIds ? launch<1, kSmallIds>(d, gpu_ids, host_ids, n, s)
                         : launch<1, kMaxIds<1>>(d, gpu_ids, host_ids, n, s);
  else
    err = n <= kSmallIds ? launch<KVTIER_MAX_LAYERS, kSmallIds>(d, gpu_ids, host_ids, n, s)
                         : launch<KVTIER_MAX_LAYERS, kMaxIds<KVTIER_MAX_LAYERS>>(d, gpu_ids, host_ids, n, s);
  if (err == cudaSuccess && d->debug_sync) err = cudaStreamSynchronize(s);
  return err;
}

extern "C" int kvtier_cuda_event_create(int device, int timing, void** event) {
  int err = set_device(device);
  if (err != cudaSuccess) return err;
  cudaEvent_t ev = nullptr;
  err = cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming);
  *event = ev;
  return err;
}

extern "C" int kvtier_cuda_event_record(void* event, void* stream) {
  return cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream));
}

extern "C" int kvtier_cuda_event_query(void* event) {
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();  // "not ready" is an answer, not an error: keep it out of the next launch's check
    return 1;
  }
  return err;
}

extern "C" int kvtier_cuda_event_synchronize(void* event) {
  return cudaEventSynchronize(static_cast<cudaEvent_t>(event));
}

extern "C" int kvtier_cuda_event_destroy(void* event) { return cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

extern "C" int kvtier_cuda_event_elapsed_ms(void* start, void* end, float* ms) {
  return cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end));
}

extern "C" int kvtier_cuda_stream_wait_event(void* stream, void* event) {
  return cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0);
}

extern "C" int kvtier_cuda_stream_create(int device, void** stream) {
  int err = set_device(device);
  if (err != cudaSuccess) return err;
  cudaStream_t s = nullptr;
  err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  *stream = s;
  return err;
}

extern "C" int kvtier_cuda_stream_destroy(void* stream) { return cudaStreamDestroy(static_cast<cudaStream_t>(stream)); }

extern "C" int kvtier_cuda_dma_supported(void) {
#if CUDART_VERSION >= 12080
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return driver >= 12080 ? 1 : 0;
#else
  return 0;
#endif
}

extern "C" int kvtier_memcpy_batch(int device, void* const* dsts, const void* const* srcs, const size_t* sizes,
                                   size_t n, void* stream, int debug_sync) {
  if (n == 0) return cudaSuccess;
#if CUDART_VERSION >= 12080
  int err = set_device(device);
  if (err != cudaSuccess) return err;
  auto s = static_cast<cudaStream_t>(stream);
  cudaMemcpyAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t first = 0;
#if CUDART_VERSION >= 13000
  err = cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &first, 1, s);
#else
  size_t fail = 0;
  err = cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs), const_cast<size_t*>(sizes), n,
                             &attr, &first, 1, &fail, s);
#endif
  if (err == cudaSuccess && debug_sync) err = cudaStreamSynchronize(s);
  return err;
#else
  (void)device; (void)dsts; (void)srcs; (void)sizes; (void)stream; (void)debug_sync;
  return cudaErrorNotSupported;
#endif
}

extern "C" int kvtier_cuda_allocation_base(uint64_t ptr, uint64_t* base) {
  static const auto range = driver_entry<decltype(&cuMemGetAddressRange)>("cuMemGetAddressRange");
  if (range == nullptr) return cudaErrorNotSupported;
  CUdeviceptr b = 0;
  size_t size = 0;
  const int err = range(&b, &size, ptr);
  *base = b;
  return err;
}

extern "C" int kvtier_memcpy_2d_batch(int device, const kvtier_copy2d* ops, size_t n, int to_host, void* stream,
                                      int debug_sync) {
  if (n == 0) return cudaSuccess;
#if CUDART_VERSION >= 12080
  int err = set_device(device);
  if (err != cudaSuccess) return err;
  auto s = static_cast<cudaStream_t>(stream);
  // malloc, not std::vector: the distributable wheel links no C++ standard library beyond the runtime's needs.
  if (n > SIZE_MAX / sizeof(cudaMemcpy3DBatchOp)) return cudaErrorInvalidValue;
  auto* list = static_cast<cudaMemcpy3DBatchOp*>(std::malloc(n * sizeof(cudaMemcpy3DBatchOp)));
  if (list == nullptr) return cudaErrorMemoryAllocation;
  for (size_t i = 0; i < n; ++i) {
    const kvtier_copy2d& c = ops[i];
    cudaMemcpy3DOperand dev, host;
    std::memset(&dev, 0, sizeof(dev));
    std::memset(&host, 0, sizeof(host));
    dev.type = host.type = cudaMemcpyOperandTypePointer;
    dev.op.ptr.ptr = reinterpret_cast<void*>(c.dev);
    dev.op.ptr.rowLength = c.height > 1 ? c.dev_pitch : 0;  // elements of one byte; 0: rows packed
    host.op.ptr.ptr = reinterpret_cast<void*>(c.host);
    host.op.ptr.rowLength = c.height > 1 ? c.host_pitch : 0;
    cudaMemcpy3DBatchOp& op = list[i];
    std::memset(&op, 0, sizeof(op));
    op.src = to_host ? dev : host;
    op.dst = to_host ? host : dev;
    op.extent = make_cudaExtent(c.width, c.height, 1);
    op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    op.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  }
#if CUDART_VERSION >= 13000
  err = cudaMemcpy3DBatchAsync(n, list, 0, s);
#else
  size_t fail = 0;
  err = cudaMemcpy3DBatchAsync(n, list, &fail, 0, s);
#endif
  std::free(list);
  if (err == cudaSuccess && debug_sync) err = cudaStreamSynchronize(s);
  return err;
#else
  (void)device; (void)ops; (void)to_host; (void)stream; (void)debug_sync;
  return cudaErrorNotSupported;
#endif
}
