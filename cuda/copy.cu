// kvtier's CUDA code: page copies between a GPU pool and pinned host memory.
#include <cuda_runtime.h>

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
