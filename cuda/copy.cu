// kvtier's CUDA code: page copies between a GPU pool and pinned host memory through UVA pointers.
//
// The kernel sees a batch as one flat run of 16-byte vectors: page, then layer chunk, then vector. Each block
// takes tiles of threads * kUnroll vectors, each warp a contiguous run of 32 * kUnroll of them (4 KiB); each thread
// issues all kUnroll loads of a tile before its stores, so a few blocks keep enough PCIe requests in flight to
// reach the link's ceiling. Neighbouring lanes read
// neighbouring vectors whatever the chunk size: small layer chunks (a 16 KiB page over 61 layers is 272 bytes a
// chunk) still fill whole warps, since a warp simply runs on into the next chunk.
//
// Variants (KVTIER_COPY_VARIANT, read at each call; for the benchmark, see docs/PERFORMANCE.md "Page copies"):
//   0 the block's threads cover blockDim.x neighbouring vectors at each of the kUnroll steps (the kernel until
//     2026-12), loads with the streaming hint;
//   1 as 0, loads also asking L2 for 256-byte prefetches (ld.global.L2::256B);
//   2 as 0, but each warp's kUnroll loads cover one contiguous run of 32 * kUnroll vectors (4 KiB): the default,
//     as fast as 0 page-first and faster layer-first (device->host 93-94% of memcpy against 80-89%);
//   3 as 2 with the 256-byte prefetch hint;
//   4 whole (page, layer) chunks to warps: one layer-table lookup a chunk, 32 * kUnroll vectors a step;
//   5 Hopper bulk asynchronous copies (cp.async.bulk global -> shared with an mbarrier, shared -> global as a
//     bulk group), one issuing thread per warp, kStages buffers of kBulkBytes each; sm_90 only (else the default). Slower, and not
//     yet clean under compute-sanitizer memcheck (docs/PERFORMANCE.md): for measurements only.
//
// Ids travel by value in the kernel parameters (CUDA 12.1+ allows 32764 bytes on sm_70+), so nothing the caller
// owns has to outlive the call and no id buffer has to be fenced with events; batches larger than one launch's
// id capacity are split into several launches on the same stream.
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

namespace {

constexpr int kUnroll = 8;  // 16-byte loads in flight per thread
constexpr int kParamBytes = 32764;

struct Head {
  uint64_t host_base;
  uint64_t slot_bytes;
  uint32_t chunk_vecs;  // 16-byte vectors in one layer chunk
  uint32_t layers;
  uint32_t to_host;
  uint32_t pad;
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
  const uint32_t c = g / p.h.chunk_vecs;
  const uint32_t v = g - c * p.h.chunk_vecs;
  const uint32_t page = L == 1 ? c : c / p.h.layers;
  const uint32_t l = L == 1 ? 0 : c - page * p.h.layers;
  const kvtier_layer& layer = p.layer[l];
  char* dev = reinterpret_cast<char*>(layer.base) + static_cast<uint64_t>(p.gpu_id[page]) * layer.stride +
              static_cast<uint64_t>(v) * 16;
  char* host = reinterpret_cast<char*>(p.h.host_base) + static_cast<uint64_t>(p.host_id[page]) * p.h.slot_bytes +
               (static_cast<uint64_t>(l) * p.h.chunk_vecs + v) * 16;
  src = reinterpret_cast<const uint4*>(p.h.to_host ? dev : host);
  dst = reinterpret_cast<uint4*>(p.h.to_host ? host : dev);
}

template <bool Hint>
__device__ __forceinline__ uint4 load_vec(const uint4* p) {
  if constexpr (Hint) {
    uint4 r;
    asm("ld.global.cs.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
  } else {
    return __ldcs(p);  // streaming: the pages are not read again soon, keep L2 for the model
  }
}

// Flat kernel. WarpSpan: a warp's kUnroll loads cover 32 * kUnroll neighbouring vectors (else the block's threads
// cover blockDim.x neighbouring vectors at each of the kUnroll steps).
template <int L, int N, bool Hint, bool WarpSpan>
__global__ void __launch_bounds__(1024) copy_pages_kernel(const __grid_constant__ Params<L, N> p, uint32_t total) {
  const uint32_t tile = blockDim.x * kUnroll;
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t base = WarpSpan ? (threadIdx.x - lane) * kUnroll + lane : threadIdx.x;
  const uint32_t step = WarpSpan ? 32 : blockDim.x;
  for (uint32_t t0 = blockIdx.x * tile; t0 < total; t0 += gridDim.x * tile) {
    uint4 v[kUnroll];
    uint4* dst[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t g = t0 + base + k * step;
      if (g < total) {
        const uint4* src;
        locate(p, g, src, dst[k]);
        v[k] = load_vec<Hint>(src);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (t0 + base + k * step < total) __stcs(dst[k], v[k]);
    }
  }
}

template <int L, int N>
__device__ __forceinline__ void chunk_ends(const Params<L, N>& p, uint32_t c, char*& src, char*& dst) {
  const uint32_t page = L == 1 ? c : c / p.h.layers;
  const uint32_t l = L == 1 ? 0 : c - page * p.h.layers;
  const kvtier_layer& layer = p.layer[l];
  char* dev = reinterpret_cast<char*>(layer.base) + static_cast<uint64_t>(p.gpu_id[page]) * layer.stride;
  char* host = reinterpret_cast<char*>(p.h.host_base) + static_cast<uint64_t>(p.host_id[page]) * p.h.slot_bytes +
               static_cast<uint64_t>(l) * p.h.chunk_vecs * 16;
  src = p.h.to_host ? dev : host;
  dst = p.h.to_host ? host : dev;
}

// Whole (page, layer) chunks to warps.
template <int L, int N>
__global__ void __launch_bounds__(1024) copy_chunks_kernel(const __grid_constant__ Params<L, N> p, uint32_t chunks) {
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  const uint32_t cv = p.h.chunk_vecs;
  for (uint32_t c = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; c < chunks; c += warps) {
    char* s;
    char* d;
    chunk_ends(p, c, s, d);
    const uint4* src = reinterpret_cast<const uint4*>(s);
    uint4* dst = reinterpret_cast<uint4*>(d);
    for (uint32_t v0 = lane; v0 < cv; v0 += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)
        if (v0 + k * 32 < cv) v[k] = __ldcs(src + v0 + k * 32);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)
        if (v0 + k * 32 < cv) __stcs(dst + v0 + k * 32, v[k]);
    }
  }
}

constexpr uint32_t kBulkBytes = 16384;
constexpr uint32_t kStages = 3;
constexpr uint32_t kIssuers = 4;  // warps a block, one issuing thread each
constexpr uint32_t kBulkSmem = kBulkBytes * kStages * kIssuers;

// Bulk asynchronous copies through shared memory. Work items are pieces of at most kBulkBytes of one chunk.
template <int L, int N>
__global__ void __launch_bounds__(32 * kIssuers) copy_bulk_kernel(const __grid_constant__ Params<L, N> p,
                                                                  uint32_t chunks, uint32_t pieces) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kIssuers * kStages];
  if ((threadIdx.x & 31) != 0) return;
  const uint32_t w = threadIdx.x / 32;
  const uint32_t buf = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + w * kStages * kBulkBytes;
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(bars)) + w * kStages * 8;
  for (uint32_t s = 0; s < kStages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar + s * 8) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const uint64_t items = static_cast<uint64_t>(chunks) * pieces;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * kIssuers + w;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kIssuers;
  const uint64_t chunk_bytes = static_cast<uint64_t>(p.h.chunk_vecs) * 16;
  auto span = [&](uint64_t it, char*& src, char*& dst) -> uint32_t {
    const uint32_t c = static_cast<uint32_t>(it / pieces);
    const uint64_t off = (it - static_cast<uint64_t>(c) * pieces) * kBulkBytes;
    chunk_ends(p, c, src, dst);
    src += off;
    dst += off;
    const uint64_t left = chunk_bytes - off;
    return static_cast<uint32_t>(left < kBulkBytes ? left : kBulkBytes);
  };
  auto issue_load = [&](uint64_t k) {
    const uint64_t it = first + k * stride;
    if (it >= items) return;
    char* src;
    char* dst;
    const uint32_t bytes = span(it, src, dst);
    const uint32_t s = static_cast<uint32_t>(k % kStages);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar + s * 8), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     buf + s * kBulkBytes),
                 "l"(src), "r"(bytes), "r"(bar + s * 8)
                 : "memory");
  };
  for (uint64_t k = 0; k < kStages; ++k) issue_load(k);
  for (uint64_t k = 0;; ++k) {
    const uint64_t it = first + k * stride;
    if (it >= items) break;
    const uint32_t s = static_cast<uint32_t>(k % kStages);
    const uint32_t parity = static_cast<uint32_t>((k / kStages) & 1);
    asm volatile(
        "{\n\t.reg .pred P1;\n\tLAB_WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
        "@P1 bra DONE;\n\tbra LAB_WAIT;\n\tDONE:\n\t}" ::"r"(bar + s * 8),
        "r"(parity)
        : "memory");
    char* src;
    char* dst;
    const uint32_t bytes = span(it, src, dst);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(buf + s * kBulkBytes),
                 "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k >= 1) {
      // The store of item k - 1 has read its buffer: refill that stage.
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      issue_load(k - 1 + kStages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

int device_major() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major;
}

template <int L, int N>
int launch(const kvtier_copy_desc* d, const int32_t* gpu_ids, const int32_t* host_ids, size_t n, cudaStream_t s,
           int variant) {
  Params<L, N> p;
  p.h.host_base = d->host_base;
  p.h.slot_bytes = d->slot_bytes;
  p.h.chunk_vecs = static_cast<uint32_t>(d->chunk_bytes / 16);
  p.h.layers = d->num_layers;
  p.h.to_host = d->to_host ? 1 : 0;
  p.h.pad = 0;
  std::memcpy(p.layer, d->layers, sizeof(kvtier_layer) * d->num_layers);
  const uint64_t page_vecs = static_cast<uint64_t>(p.h.chunk_vecs) * d->num_layers;
  // The kernel indexes vectors with 32 bits: keep each launch below 2^31 of them.
  const size_t per_launch = std::min<uint64_t>(N, (static_cast<uint64_t>(INT_MAX) - 1) / page_vecs);
  const uint32_t tile = d->threads * kUnroll;
  const uint32_t pieces = static_cast<uint32_t>((d->chunk_bytes + kBulkBytes - 1) / kBulkBytes);
  if (variant == 5) {
    static bool smem_set = false;  // per instantiation
    if (!smem_set) {
      const cudaError_t err =
          cudaFuncSetAttribute(copy_bulk_kernel<L, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmem);
      if (err != cudaSuccess) return err;
      smem_set = true;
    }
  }
  for (size_t off = 0; off < n; off += per_launch) {
    const size_t m = std::min(per_launch, n - off);
    std::memcpy(p.gpu_id, gpu_ids + off, m * sizeof(int32_t));
    std::memcpy(p.host_id, host_ids + off, m * sizeof(int32_t));
    const uint32_t total = static_cast<uint32_t>(m * page_vecs);
    const uint32_t chunks = static_cast<uint32_t>(m * d->num_layers);
    const uint32_t grid = std::min<uint32_t>(d->blocks, (total + tile - 1) / tile);
    switch (variant) {
      case 1:
        copy_pages_kernel<L, N, true, false><<<grid, d->threads, 0, s>>>(p, total);
        break;
      case 2:
        copy_pages_kernel<L, N, false, true><<<grid, d->threads, 0, s>>>(p, total);
        break;
      case 3:
        copy_pages_kernel<L, N, true, true><<<grid, d->threads, 0, s>>>(p, total);
        break;
      case 4: {
        const uint32_t warps = d->threads / 32;
        copy_chunks_kernel<L, N><<<std::min<uint32_t>(d->blocks, (chunks + warps - 1) / warps), d->threads, 0, s>>>(
            p, chunks);
        break;
      }
      case 5: {
        const uint64_t items = static_cast<uint64_t>(chunks) * pieces;
        const uint32_t g = static_cast<uint32_t>(std::min<uint64_t>(d->blocks, (items + kIssuers - 1) / kIssuers));
        copy_bulk_kernel<L, N><<<g, 32 * kIssuers, kBulkSmem, s>>>(p, chunks, pieces);
        break;
      }
      default:
        copy_pages_kernel<L, N, false, false><<<grid, d->threads, 0, s>>>(p, total);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// The kernel variant: KVTIER_COPY_VARIANT when set (the benchmark compares them), else kDefaultVariant.
constexpr int kDefaultVariant = 2;
int variant_for_call() {
  const char* env = std::getenv("KVTIER_COPY_VARIANT");
  int v = env && *env ? std::atoi(env) : kDefaultVariant;
  if (v < 0 || v > 5) v = kDefaultVariant;
  if (v == 5 && device_major() < 9) v = kDefaultVariant;
  return v;
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
  if (d->num_layers == 0 || d->num_layers > KVTIER_MAX_LAYERS || d->chunk_bytes == 0 || d->chunk_bytes % 16 != 0 ||
      d->chunk_bytes / 16 * d->num_layers >= INT_MAX || d->threads == 0 || d->threads > 1024 ||
      d->threads % 32 != 0 || d->blocks == 0)
    return cudaErrorInvalidValue;
  int err = set_device(d->device);
  if (err != cudaSuccess) return err;
  auto s = static_cast<cudaStream_t>(stream);
  const int v = variant_for_call();
  if (d->num_layers == 1)
    err = n <= kSmallIds ? launch<1, kSmallIds>(d, gpu_ids, host_ids, n, s, v)
                         : launch<1, kMaxIds<1>>(d, gpu_ids, host_ids, n, s, v);
  else
    err = n <= kSmallIds ? launch<KVTIER_MAX_LAYERS, kSmallIds>(d, gpu_ids, host_ids, n, s, v)
                         : launch<KVTIER_MAX_LAYERS, kMaxIds<KVTIER_MAX_LAYERS>>(d, gpu_ids, host_ids, n, s, v);
  if (err == cudaSuccess && d->debug_sync) err = cudaStreamSynchronize(s);
  return err;
}

extern "C" int kvtier_cuda_event_create(int device, void** event) {
  int err = set_device(device);
  if (err != cudaSuccess) return err;
  cudaEvent_t ev = nullptr;
  err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
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
