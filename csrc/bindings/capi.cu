// C ABI of the CUDA backend, loaded with ctypes by kvkernels/_cuda.py. Raw pointers, sizes and a
// stream handle in; an int status out (0 = ok); kvk_last_error() explains a non-zero status.
// No torch headers and no C++ types cross the boundary, so the library does not depend on the
// torch ABI of the process that loads it (docs/csrc.md).
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>

#include "../kernels/paged_copy.cuh"

namespace {
thread_local char g_err[512] = "";

int fail(const char* msg) {
  std::snprintf(g_err, sizeof(g_err), "%s", msg);
  return -1;
}

int cuda_fail(const char* what, cudaError_t e) {
  std::snprintf(g_err, sizeof(g_err), "%s: %s", what, cudaGetErrorString(e));
  return static_cast<int>(e);
}

template <typename Word>
cudaError_t launch(bool to_staging, const kvk::PagedCopyParams& p, int grid, cudaStream_t s) {
  if (to_staging) {
    kvk::paged_copy_kernel<Word, true><<<grid, 256, 0, s>>>(p);
  } else {
    kvk::paged_copy_kernel<Word, false><<<grid, 256, 0, s>>>(p);
  }
  return cudaGetLastError();
}
}  // namespace

extern "C" {

int kvk_abi_version(void) { return 1; }

const char* kvk_last_error(void) { return g_err; }

// to_staging: 1 = gather (cache -> staging), 0 = scatter. word: access width in bytes (16, 8, 4,
// 2, 1), dividing row_bytes, every stride, every base address and the staging pointer.
int kvk_paged_copy(int to_staging, const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging,
                   int* err, int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t rows,
                   int64_t row_bytes, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
                   int64_t entry_bytes, int64_t word, int64_t max_ctas, int device, uintptr_t stream) {
  if (ptr_tab == nullptr) return fail("ptr_tab: expected a device pointer, got NULL");
  if (block_ids == nullptr) return fail("block_ids: expected a device pointer, got NULL");
  if (staging == nullptr) return fail("staging: expected a pointer, got NULL");
  if (err == nullptr) return fail("err: expected a device pointer, got NULL");
  if (n <= 0 || num_regions <= 0) return fail("n, num_regions: expected > 0");
  if (C != 1 && C != 2) return fail("C: expected 1 or 2");
  if (H <= 0 || rows <= 0 || rows % H != 0) return fail("rows: expected a positive multiple of H");
  if (row_bytes <= 0) return fail("row_bytes: expected > 0");
  if (word != 1 && word != 2 && word != 4 && word != 8 && word != 16) return fail("word: expected 1, 2, 4, 8 or 16");
  if (row_bytes % word || stride_b % word || stride_n % word || stride_h % word || region_bytes % word ||
      entry_bytes % word || reinterpret_cast<uintptr_t>(staging) % word)
    return fail("word: does not divide every stride, size and the staging address");
  if (entry_bytes < n * rows * row_bytes || region_bytes < C * entry_bytes)
    return fail("entry_bytes, region_bytes: smaller than the payload they must hold");
  if (max_ctas < 0) return fail("max_ctas: expected >= 0");

  int prev = 0;
  cudaError_t e = cudaGetDevice(&prev);
  if (e != cudaSuccess) return cuda_fail("cudaGetDevice", e);
  if (prev != device && (e = cudaSetDevice(device)) != cudaSuccess) return cuda_fail("cudaSetDevice", e);

  kvk::PagedCopyParams p{ptr_tab, block_ids, staging, err, n, num_blocks, num_regions * C * n,
                         stride_b, stride_n, stride_h, region_bytes, entry_bytes, C, H, rows, row_bytes, ids_64 != 0};
  int64_t items = p.num_items;
  int64_t g = max_ctas > 0 && max_ctas < items ? max_ctas : items;
  if (g > 2147483647LL) g = 2147483647LL;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  bool gather = to_staging != 0;
  switch (word) {
    case 16: e = launch<uint4>(gather, p, static_cast<int>(g), s); break;
    case 8: e = launch<uint2>(gather, p, static_cast<int>(g), s); break;
    case 4: e = launch<uint32_t>(gather, p, static_cast<int>(g), s); break;
    case 2: e = launch<uint16_t>(gather, p, static_cast<int>(g), s); break;
    default: e = launch<uint8_t>(gather, p, static_cast<int>(g), s); break;
  }
  cudaError_t e2 = prev != device ? cudaSetDevice(prev) : cudaSuccess;
  if (e != cudaSuccess) return cuda_fail("paged_copy_kernel launch", e);
  if (e2 != cudaSuccess) return cuda_fail("cudaSetDevice (restore)", e2);
  return 0;
}

}  // extern "C"
