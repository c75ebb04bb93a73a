// Host memory made by the CUDA driver (cuMemCreate on the host NUMA node, chunks mapped into one range) against
// the process's pages registered with cudaHostRegister in steps, the two ways rust/executor/hostmem.rs pins a host pool:
// CPU access, copies across chunks (cudaMemcpyAsync, cudaMemcpy2DAsync, and the batch calls kvtier makes), their
// rates, and how long another thread's kernel launch and small copy take while each kind of memory is made (GIB GiB
// of it in each step size). docs/PERFORMANCE.md, "Host pool pinning", has the figures. Needs a GPU:
//
//   nvcc -std=c++17 -O2 -arch=sm_90 -cudart static benches/host_memory.cu -o host_memory -lpthread && ./host_memory 4
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <atomic>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      printf("FAIL %s:%d %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)
#define DK(x)                                                                         \
  do {                                                                                \
    CUresult r_ = (x);                                                                \
    if (r_ != CUDA_SUCCESS) {                                                         \
      printf("FAIL %s:%d %s -> CUresult %d\n", __FILE__, __LINE__, #x, (int)r_);   \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
static F entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12020, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    printf("no entry point %s\n", name);
    exit(1);
  }
  return reinterpret_cast<F>(fn);
}

static decltype(&cuMemCreate) pCreate;
static decltype(&cuMemAddressReserve) pReserve;
static decltype(&cuMemMap) pMap;
static decltype(&cuMemSetAccess) pSetAccess;
static decltype(&cuMemGetAllocationGranularity) pGran;
static decltype(&cuDeviceGetAttribute) pAttr;
static int loc_type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
static int numa_id = 0;

static CUmemAllocationProp prop() {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof(p));
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = (CUmemLocationType)loc_type;
  p.location.id = numa_id;
  return p;
}

// Reserve `total`, then create and map chunks of `chunk` bytes, access for device 0 and the host.
static char* vmm_make(size_t total, size_t chunk, std::vector<double>* times) {
  CUdeviceptr base = 0;
  DK(pReserve(&base, total, 0, 0, 0));
  CUmemAllocationProp p = prop();
  CUmemAccessDesc acc[2];
  memset(acc, 0, sizeof(acc));
  acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc[0].location.id = 0;
  acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  acc[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  acc[1].location.id = numa_id;
  acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (size_t off = 0; off < total; off += chunk) {
    double t0 = now();
    CUmemGenericAllocationHandle h;
    DK(pCreate(&h, chunk, &p, 0));
    DK(pMap(base + off, chunk, 0, h, 0));
    DK(pSetAccess(base + off, chunk, acc, 2));
    if (times) times->push_back(now() - t0);
  }
  return reinterpret_cast<char*>(base);
}

__global__ void nop() {}

struct Stall {
  double max_ms = 0, p99_ms = 0;
  size_t calls = 0;
};

// Thread A launches a kernel and a 4 KiB copy in a loop while `work` runs; the host time of each pair.
template <class W>
static Stall stall_test(W work, double* work_s) {
  std::atomic<bool> done{false};
  std::vector<double> lat;
  std::thread a([&] {
    CK(cudaSetDevice(0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void *d, *h;
    CK(cudaMalloc(&d, 4096));
    CK(cudaMallocHost(&h, 4096));
    while (!done.load()) {
      double t0 = now();
      nop<<<1, 1, 0, s>>>();
      CK(cudaMemcpyAsync(d, h, 4096, cudaMemcpyHostToDevice, s));
      lat.push_back(now() - t0);
      CK(cudaStreamSynchronize(s));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  double t0 = now();
  work();
  *work_s = now() - t0;
  done = true;
  a.join();
  Stall r;
  r.calls = lat.size();
  std::sort(lat.begin(), lat.end());
  r.max_ms = lat.back() * 1e3;
  r.p99_ms = lat[lat.size() * 99 / 100] * 1e3;
  return r;
}

int main(int argc, char** argv) {  // argv[1]: GiB made in each step size (default 4)
  size_t gib = argc > 1 ? atol(argv[1]) : 4;
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  pCreate = entry<decltype(&cuMemCreate)>("cuMemCreate");
  pReserve = entry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  pMap = entry<decltype(&cuMemMap)>("cuMemMap");
  pSetAccess = entry<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  pGran = entry<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
  pAttr = entry<decltype(&cuDeviceGetAttribute)>("cuDeviceGetAttribute");
  int drv = 0;
  CK(cudaDriverGetVersion(&drv));
  DK(pAttr(&numa_id, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, 0));
  printf("driver %d, device 0 host numa id %d\n", drv, numa_id);
  if (numa_id < 0) numa_id = 0;
  CUmemAllocationProp p = prop();
  size_t g_min = 0, g_rec = 0;
  DK(pGran(&g_min, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  DK(pGran(&g_rec, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  printf("host numa granularity min %zu rec %zu\n", g_min, g_rec);

  // 1. One GiB from 16 MiB chunks: CPU access, copies across chunks.
  const size_t G = 1ull << 30, M = 1ull << 20;
  std::vector<double> t;
  char* h = vmm_make(G, 16 * M, &t);
  double sum = 0, mx = 0;
  for (double x : t) sum += x, mx = std::max(mx, x);
  printf("vmm 1 GiB in 16 MiB chunks: %.1f ms (%.2f GiB/s), slowest chunk %.2f ms\n", sum * 1e3, 1.0 / sum, mx * 1e3);
  double t0 = now();
  memset(h, 0x5a, G);
  printf("cpu memset 1 GiB: %.1f ms\n", (now() - t0) * 1e3);
  t0 = now();
  memset(h, 0x5b, G);
  printf("cpu memset again: %.1f ms\n", (now() - t0) * 1e3);
  for (size_t i = 0; i < G; i += 8) *reinterpret_cast<uint64_t*>(h + i) = i * 0x9e3779b97f4a7c15ull;
  cudaPointerAttributes pa;
  CK(cudaPointerGetAttributes(&pa, h + 100 * M));
  printf("pointer attributes: type %d device %d devptr %p hostptr %p\n", (int)pa.type, pa.device, pa.devicePointer,
         pa.hostPointer);
  char* d;
  CK(cudaMalloc(&d, G));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // Across chunk boundaries: 256 MiB from 8 MiB + 12345.
  size_t off = 8 * M + 12345, n = 256 * M;
  CK(cudaMemcpyAsync(d, h + off, n, cudaMemcpyHostToDevice, s));
  CK(cudaMemcpyAsync(h + 600 * M, d, n, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  printf("1D round trip across chunks exact: %d\n", memcmp(h + off, h + 600 * M, n) == 0);
  // 1 GiB each way, `reps` times, between the device buffer and `host`.
  auto rates = [&](char* host, const char* name, int reps) {
    for (int dir = 0; dir < 2; ++dir) {
      for (int k = 0; k < reps; ++k) {
        CK(cudaEventRecord(e0, s));
        if (dir == 0)
          CK(cudaMemcpyAsync(d, host, G, cudaMemcpyHostToDevice, s));
        else
          CK(cudaMemcpyAsync(host, d, G, cudaMemcpyDeviceToHost, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        printf("%s 1 GiB %s host: %.2f ms = %.1f GB/s\n", dir == 0 ? "h2d" : "d2h", name, ms, G / ms / 1e6);
      }
    }
  };
  rates(h, "vmm", 3);
  // Same with a cudaHostRegister'd 1 GiB as the baseline.
  char* r = static_cast<char*>(mmap(nullptr, G, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  madvise(r, G, MADV_HUGEPAGE);
  memset(r, 1, G);
  CK(cudaHostRegister(r, G, cudaHostRegisterDefault));
  rates(r, "registered", 2);
  // 2D copy across chunks: 32 rows of 256 KiB, host pitch 8 MiB (rows in different chunks), device pitch 256 KiB.
  CK(cudaMemcpy2DAsync(d, 256 * 1024, h + 3 * M + 77, 8 * M, 256 * 1024, 32, cudaMemcpyHostToDevice, s));
  CK(cudaMemcpy2DAsync(h + 700 * M, 256 * 1024, d, 256 * 1024, 256 * 1024, 32, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  bool ok = true;
  for (int i = 0; i < 32; ++i) ok &= memcmp(h + 3 * M + 77 + i * 8 * M, h + 700 * M + i * 256 * 1024, 256 * 1024) == 0;
  printf("2D across chunks exact: %d\n", ok);
  // The batch calls, pieces inside one chunk and pieces across chunks.
  for (int cross = 0; cross < 2; ++cross) {
    std::vector<void*> dsts, srcs;
    std::vector<size_t> sizes;
    for (int i = 0; i < 32; ++i) {
      srcs.push_back(cross ? h + (i + 1) * 16 * M - M : h + i * 16 * M + 4096);
      dsts.push_back(d + i * 4 * M);
      sizes.push_back(4 * M);
    }
    cudaMemcpyAttributes attr;
    memset(&attr, 0, sizeof(attr));
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first = 0;
    cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), 32, &attr, &first, 1, s);
    if (e != cudaSuccess) {
      printf("batch 1D (%s chunks): %s\n", cross ? "across" : "inside", cudaGetErrorString(e));
      cudaGetLastError();
      continue;
    }
    CK(cudaMemcpyAsync(h + 600 * M, d, 128 * M, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    bool okb = true;
    for (int i = 0; i < 32; ++i) okb &= memcmp(srcs[i], h + 600 * M + i * 4 * M, 4 * M) == 0;
    printf("batch 1D (%s chunks) exact: %d\n", cross ? "across" : "inside", okb);
  }
  for (int cross = 0; cross < 2; ++cross) {
    // 8 2D copies of 32 rows of 256 KiB; host pitch 512 KiB (16 MiB a copy): inside one chunk or across two.
    std::vector<cudaMemcpy3DBatchOp> ops(8);
    for (int i = 0; i < 8; ++i) {
      cudaMemcpy3DOperand dev, host;
      memset(&dev, 0, sizeof(dev));
      memset(&host, 0, sizeof(host));
      dev.type = host.type = cudaMemcpyOperandTypePointer;
      dev.op.ptr.ptr = d + i * 8 * M;
      dev.op.ptr.rowLength = 256 * 1024;
      host.op.ptr.ptr = h + 32 * M * (i + 1) + (cross ? 8 * M : 0);
      host.op.ptr.rowLength = 512 * 1024;
      memset(&ops[i], 0, sizeof(ops[i]));
      ops[i].src = host;
      ops[i].dst = dev;
      ops[i].extent = make_cudaExtent(256 * 1024, 32, 1);
      ops[i].srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      ops[i].flags = cudaMemcpyFlagPreferOverlapWithCompute;
    }
    cudaError_t e = cudaMemcpy3DBatchAsync(8, ops.data(), 0, s);
    if (e != cudaSuccess) {
      printf("batch 2D (%s chunks): %s\n", cross ? "across" : "inside", cudaGetErrorString(e));
      cudaGetLastError();
      continue;
    }
    CK(cudaMemcpyAsync(h + 800 * M, d, 64 * M, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    bool okb = true;
    for (int i = 0; i < 8; ++i)
      for (int row = 0; row < 32; ++row)
        okb &= memcmp(h + 32 * M * (i + 1) + (cross ? 8 * M : 0) + row * 512 * 1024,
                      h + 800 * M + i * 8 * M + row * 256 * 1024, 256 * 1024) == 0;
    printf("batch 2D (%s chunks) exact: %d\n", cross ? "across" : "inside", okb);
  }

  // 2. Stalls: another thread's launch + copy while memory is made, gib GiB each.
  size_t total = gib * G;
  for (size_t step : {256 * M, 64 * M, 16 * M}) {
    char* m = static_cast<char*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    madvise(m, total, MADV_HUGEPAGE);
    double ws, populate = 0, reg = 0, regmax = 0;
    Stall st = stall_test(
        [&] {
          for (size_t o = 0; o < total; o += step) {
            double a = now();
            madvise(m + o, step, 23 /* MADV_POPULATE_WRITE */);
            double b = now();
            CK(cudaHostRegister(m + o, step, cudaHostRegisterDefault));
            double c = now();
            populate += b - a;
            reg += c - b;
            regmax = std::max(regmax, c - b);
          }
        },
        &ws);
    printf("register %zu MiB steps, %zu GiB: %.2f GiB/s (populate %.0f ms, register %.0f ms, slowest register %.1f ms); "
           "other thread max %.2f ms p99 %.3f ms (%zu calls)\n",
           step / M, gib, gib / ws, populate * 1e3, reg * 1e3, regmax * 1e3, st.max_ms, st.p99_ms, st.calls);
  }
  for (size_t step : {256 * M, 64 * M, 16 * M, 2 * M}) {
    std::vector<double> tt;
    double ws;
    Stall st = stall_test([&] { vmm_make(total, step, &tt); }, &ws);
    double mx2 = 0;
    for (double x : tt) mx2 = std::max(mx2, x);
    printf("vmm %zu MiB chunks, %zu GiB: %.2f GiB/s, slowest chunk %.1f ms; other thread max %.2f ms p99 %.3f ms "
           "(%zu calls)\n",
           step / M, gib, gib / ws, mx2 * 1e3, st.max_ms, st.p99_ms, st.calls);
  }
  printf("done\n");
  return 0;
}
