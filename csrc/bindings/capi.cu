// C ABI of the CUDA backend, loaded with ctypes by kvkernels/_cuda.py. Raw pointers, sizes and a
// stream handle in; an int status out (0 = ok); kvk_last_error() explains a non-zero status.
// No torch headers and no C++ types cross the boundary, so the library does not depend on the
// torch ABI of the process that loads it (docs/csrc.md).
#include <atomic>
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>

#include "../kernels/bulk_copy.cuh"
#include "../kernels/paged_copy.cuh"
#include "../kernels/quant_copy.cuh"

namespace {
thread_local char g_err[512] = "";

int fail(const char* msg) {
  std::snprintf(g_err, sizeof(g_err), "%s", msg);
  return -1;
}

// A failed runtime call: reported through kvk_last_error(), and cleared from the thread's last
// error, which the same runtime instance (one libcudart.so.13 per process) also shows torch's next
// launch check and every other library.
int cuda_fail(const char* what, cudaError_t e) {
  std::snprintf(g_err, sizeof(g_err), "%s: %s", what, cudaGetErrorString(e));
  (void)cudaGetLastError();
  return static_cast<int>(e);
}

// A product of non-negative sizes, or -1 when it does not fit in int64: the checks below compare a
// size against it, and a wrapped product (2^41 chunks of 2^23 bytes is 2^64 = 0) must not pass.
int64_t prod(int64_t a, int64_t b, int64_t c = 1, int64_t d = 1, int64_t e = 1) {
  int64_t r = 1;
  for (int64_t x : {a, b, c, d, e})
    if (x < 0 || __builtin_mul_overflow(r, x, &r)) return -1;
  return r;
}

// `size` holds `need` bytes (a product from prod(); -1, an overflow, never fits).
bool holds(int64_t size, int64_t need) { return need >= 0 && size >= need; }

// The launch status is read with cudaGetLastError(), which also returns an error left by an earlier
// runtime call of this thread (a failed cudaSetDevice, another library sharing the runtime): cleared
// right before each launch, so a launch reports its own status only.
void clear_last_error() { (void)cudaGetLastError(); }

template <typename Word>
cudaError_t launch(bool to_staging, const kvk::PagedCopyParams& p, int grid, cudaStream_t s) {
  clear_last_error();
  if (to_staging) {
    kvk::paged_copy_kernel<Word, true><<<grid, 256, 0, s>>>(p);
  } else {
    kvk::paged_copy_kernel<Word, false><<<grid, 256, 0, s>>>(p);
  }
  return cudaGetLastError();
}

// Device guard: set `device` for the scope (when it differs), restore the previous one on release().
struct DeviceGuard {
  int prev = 0;
  int device = 0;
  int status = 0;  // non-zero: construction failed, g_err holds why
  explicit DeviceGuard(int d) : device(d) {
    cudaError_t e = cudaGetDevice(&prev);
    if (e != cudaSuccess) {
      status = cuda_fail("cudaGetDevice", e);
      return;
    }
    if (prev != device && (e = cudaSetDevice(device)) != cudaSuccess) status = cuda_fail("cudaSetDevice", e);
  }
  // the launch status `e` (named `what`), then the restore: the first failure is reported
  int release(const char* what, cudaError_t e) {
    cudaError_t e2 = prev != device ? cudaSetDevice(prev) : cudaSuccess;
    if (e != cudaSuccess) return cuda_fail(what, e);
    if (e2 != cudaSuccess) return cuda_fail("cudaSetDevice (restore)", e2);
    return 0;
  }
};

int grid_size(int64_t items, int64_t max_ctas) {
  int64_t g = max_ctas > 0 && max_ctas < items ? max_ctas : items;
  return static_cast<int>(g > 2147483647LL ? 2147483647LL : g);
}

// Preconditions of every entry point on the pointers and the work-item counts; 0 or fail(...).
int check_items(const int64_t* ptr_tab, const void* block_ids, const uint8_t* staging, const int* err, int64_t n,
                int64_t C, int64_t num_regions) {
  if (ptr_tab == nullptr) return fail("ptr_tab: expected a device pointer, got NULL");
  if (block_ids == nullptr) return fail("block_ids: expected a device pointer, got NULL");
  if (staging == nullptr) return fail("staging: expected a pointer, got NULL");
  if (err == nullptr) return fail("err: expected a device pointer, got NULL");
  if (n <= 0 || num_regions <= 0) return fail("n, num_regions: expected > 0");
  if (C != 1 && C != 2) return fail("C: expected 1 or 2");
  // the work-item count num_regions * C * n: a wrapped product passed every size check and copied
  // a fraction of the regions
  if (prod(num_regions, C, n) < 0) return fail("num_regions * C * n: expected < 2^63 work items");
  return 0;
}

// Strides are byte offsets between blocks / tokens / heads in the cache: never negative here.
int check_strides(int64_t stride_b, int64_t stride_n, int64_t stride_h) {
  if (stride_b < 0 || stride_n < 0 || stride_h < 0) return fail("stride_b, stride_n, stride_h: expected >= 0");
  return 0;
}

// Preconditions shared by the fp8 and shuffle entry points; 0 or fail(...).
int check_common(const int64_t* ptr_tab, const void* block_ids, const uint8_t* staging, const int* err, int64_t n,
                 int64_t C, int64_t num_regions, int64_t H, int64_t block_size, int64_t head_dim, int64_t elem,
                 int64_t stride_b, int64_t stride_n, int64_t stride_h, int vec16, int64_t max_ctas) {
  if (int rc = check_items(ptr_tab, block_ids, staging, err, n, C, num_regions)) return rc;
  if (int rc = check_strides(stride_b, stride_n, stride_h)) return rc;
  if (H <= 0 || block_size <= 0 || head_dim <= 0) return fail("H, block_size, head_dim: expected > 0");
  constexpr int64_t kMax32 = (int64_t{1} << 31) - 1;  // the kernels index inside a block in 32 bits
  if (H > kMax32 || block_size > kMax32 || block_size * H > kMax32 || head_dim > kMax32 / (block_size * H))
    return fail("block_size * H * head_dim: expected < 2^31 elements in one block");
  if (stride_b % elem || stride_n % elem || stride_h % elem)
    return fail("stride_b, stride_n, stride_h: expected multiples of the element size");
  if (vec16 && (head_dim % 16 || stride_b % 16 || stride_n % 16 || stride_h % 16 ||
                reinterpret_cast<uintptr_t>(staging) % 16))
    return fail("vec16: head_dim, the strides and the staging address must be multiples of 16");
  if (max_ctas < 0) return fail("max_ctas: expected >= 0");
  return 0;
}

// fp8 staging sections: sizes hold their payload, scales 4-byte aligned, staging 16-byte aligned.
int check_fp8_format(const uint8_t* staging, int64_t n, int64_t C, int64_t H, int64_t block_size, int64_t head_dim,
                     int per_block, int64_t region_bytes, int64_t q_entry_bytes, int64_t scale_base_bytes,
                     int64_t scale_entry_bytes) {
  if (reinterpret_cast<uintptr_t>(staging) % 16) return fail("staging: expected a 16-byte aligned address");
  const int64_t rows = block_size * H;
  const int64_t scales = per_block ? H : rows;
  if (!holds(q_entry_bytes, prod(n, rows, head_dim)))
    return fail("q_entry_bytes: smaller than n * block_size * H * head_dim");
  if (!holds(scale_entry_bytes, prod(4, n, scales)))
    return fail("scale_entry_bytes: smaller than 4 * n * scales per block");
  if (!holds(scale_base_bytes, prod(C, q_entry_bytes))) return fail("scale_base_bytes: expected >= C * q_entry_bytes");
  int64_t payload = prod(C, scale_entry_bytes);
  if (payload < 0 || __builtin_add_overflow(payload, scale_base_bytes, &payload) || !holds(region_bytes, payload))
    return fail("region_bytes: smaller than the payload it must hold");
  if (q_entry_bytes % 16 || scale_base_bytes % 16 || scale_entry_bytes % 16 || region_bytes % 16)
    return fail("region_bytes, q_entry_bytes, scale_base_bytes, scale_entry_bytes: expected multiples of 16");
  return 0;
}

template <int kKind>
cudaError_t launch_fp8(bool gather, bool per_block, bool vec, const kvk::QuantCopyParams& p, int64_t max_ctas,
                       cudaStream_t s) {
  const int grid = grid_size(p.num_items, max_ctas);
  clear_last_error();
  if (gather) {
    if (per_block) {
      if (vec) {
        kvk::quant_gather_kernel<kKind, true, true><<<grid, kvk::kThreads, 0, s>>>(p);
      } else {
        kvk::quant_gather_kernel<kKind, true, false><<<grid, kvk::kThreads, 0, s>>>(p);
      }
    } else if (vec) {
      // the token path's instance: registers per lane by row length, and the row geometry fixed
      // at compile time for the common lengths (token_fixed_nv)
      // (those take token_items_per_cta items per CTA: the grid covers the items in that many fewer CTAs)
      const int64_t nv = p.head_dim / kvk::Elem<kKind>::kPerVec;
      const int64_t rows = p.block_size * p.H;
      const bool long_rows = kvk::token_reg_vecs(nv) == kvk::kRegVecsLong;
      const auto fixed_grid = [&](int ipc) { return grid_size((p.num_items + ipc - 1) / ipc, max_ctas); };
      switch (kvk::token_fixed_nv(nv)) {
        case 16:
          kvk::quant_gather_kernel<kKind, false, true, kvk::kRegVecs, 16>
              <<<fixed_grid(kvk::token_items_per_cta<kvk::kRegVecs>(16, rows)), kvk::kThreads, 0, s>>>(p);
          break;
        case 32:
          kvk::quant_gather_kernel<kKind, false, true, kvk::kRegVecs, 32>
              <<<fixed_grid(kvk::token_items_per_cta<kvk::kRegVecs>(32, rows)), kvk::kThreads, 0, s>>>(p);
          break;
        case 72:
          kvk::quant_gather_kernel<kKind, false, true, kvk::kRegVecsLong, 72>
              <<<fixed_grid(kvk::token_items_per_cta<kvk::kRegVecsLong>(72, rows)), kvk::kThreads, 0, s>>>(p);
          break;
        default:
          if (long_rows) {
            kvk::quant_gather_kernel<kKind, false, true, kvk::kRegVecsLong><<<grid, kvk::kThreads, 0, s>>>(p);
          } else {
            kvk::quant_gather_kernel<kKind, false, true><<<grid, kvk::kThreads, 0, s>>>(p);
          }
      }
    } else {
      kvk::quant_gather_kernel<kKind, false, false><<<grid, kvk::kThreads, 0, s>>>(p);
    }
  } else if (vec) {
    kvk::dequant_scatter_kernel<kKind, true><<<grid, kvk::kThreads, 0, s>>>(p);
  } else {
    kvk::dequant_scatter_kernel<kKind, false><<<grid, kvk::kThreads, 0, s>>>(p);
  }
  return cudaGetLastError();
}

int fp8_copy(bool gather, const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging, int* err,
             int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t block_size,
             int64_t head_dim, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
             int64_t q_entry_bytes, int64_t scale_base_bytes, int64_t scale_entry_bytes, int kind, int per_block,
             int vec16, int64_t max_ctas, int device, uintptr_t stream) {
  if (kind < 0 || kind > 2) return fail("kind: expected 0 (bfloat16), 1 (float16) or 2 (float32)");
  const int64_t elem = kind == 2 ? 4 : 2;
  int rc = check_common(ptr_tab, block_ids, staging, err, n, C, num_regions, H, block_size, head_dim, elem, stride_b,
                        stride_n, stride_h, vec16, max_ctas);
  if (rc) return rc;
  rc = check_fp8_format(staging, n, C, H, block_size, head_dim, per_block, region_bytes, q_entry_bytes,
                        scale_base_bytes, scale_entry_bytes);
  if (rc) return rc;
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  kvk::QuantCopyParams p{ptr_tab,  block_ids, staging,  err, n, num_blocks, num_regions * C * n,
                         stride_b, stride_n,  stride_h, C,   H, block_size, head_dim,
                         region_bytes, q_entry_bytes, scale_base_bytes, scale_entry_bytes, ids_64 != 0,
                         per_block != 0};
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t e;
  switch (kind) {
    case 0: e = launch_fp8<0>(gather, per_block != 0, vec16 != 0, p, max_ctas, s); break;
    case 1: e = launch_fp8<1>(gather, per_block != 0, vec16 != 0, p, max_ctas, s); break;
    default: e = launch_fp8<2>(gather, per_block != 0, vec16 != 0, p, max_ctas, s); break;
  }
  return guard.release(gather ? "quant_gather_kernel launch" : "dequant_scatter_kernel launch", e);
}
// Grid: max_ctas when given, else persistent — as many CTAs as fit on the device at once
// (occupancy x SMs), so that every CTA pipelines several pieces through its stages instead of one
// CTA per piece using one stage of its shared memory.
// Per (device, kernel): the shared-memory opt-in (set once, to the most any launch needs: S stages
// of kBulkPiece) and the persistent grid at that size, cached so a launch costs no extra runtime
// calls. Races between host threads only repeat the same idempotent set-up. Devices past the
// cache's size are set up on every launch (not refused); ``redo``: set up again whatever the cache
// says (a primary-context reset, cudaDeviceReset, drops the opt-in the cache remembers).
constexpr int kMaxDevices = 64;

template <int S, bool kGather>
cudaError_t bulk_setup(int device, int64_t* persistent_grid, bool redo) {
  static std::atomic<int64_t> grid[kMaxDevices];  // 0: not set up yet
  if (device < 0) return cudaErrorInvalidDevice;
  const bool cached = device < kMaxDevices;
  int64_t g = cached && !redo ? grid[device].load(std::memory_order_acquire) : 0;
  if (g == 0) {
    auto kernel = kvk::bulk_copy_kernel<S, kGather>;
    const int smem = static_cast<int>(kvk::kBulkSmem);  // S * piece never exceeds it (bulk_plan)
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    int per_sm = 0, sms = 0;
    if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kvk::kBulkThreads, smem)) != cudaSuccess)
      return e;
    if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return e;
    g = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * sms;
    if (cached) grid[device].store(g, std::memory_order_release);
  }
  *persistent_grid = g;
  return cudaSuccess;
}

// Grid: max_ctas when given, else persistent — as many CTAs as fit on the device at once
// (occupancy x SMs at the largest stage set), so that every CTA pipelines several pieces through
// its stages instead of one CTA per piece using one stage of its shared memory.
template <int S>
cudaError_t launch_bulk(bool gather, const kvk::PagedCopyParams& p, int64_t piece, int64_t units, int64_t max_ctas,
                        int device, cudaStream_t s) {
  const size_t smem = static_cast<size_t>(S * piece);
  for (int attempt = 0;; ++attempt) {
    int64_t persistent = 0;
    const bool redo = attempt > 0;
    cudaError_t e = gather ? bulk_setup<S, true>(device, &persistent, redo)
                           : bulk_setup<S, false>(device, &persistent, redo);
    if (e != cudaSuccess) return e;
    const int grid = grid_size(units, max_ctas > 0 ? max_ctas : persistent);
    clear_last_error();
    if (gather) {
      kvk::bulk_copy_kernel<S, true><<<grid, kvk::kBulkThreads, smem, s>>>(p, piece);
    } else {
      kvk::bulk_copy_kernel<S, false><<<grid, kvk::kBulkThreads, smem, s>>>(p, piece);
    }
    e = cudaGetLastError();
    // a launch above the default 48 KiB refused as an invalid argument: the opt-in the cache
    // remembers may be gone (cudaDeviceReset); set up again and launch once more (nothing ran:
    // a refused launch configuration is not a sticky error)
    if (e == cudaErrorInvalidValue && !redo && smem > 48 * 1024) continue;
    return e;
  }
}
}  // namespace

extern "C" {

// 3: kvk_bulk_copy, kvk_features; 4: kvk_probe
int kvk_abi_version(void) { return 4; }

// 0 when the CUDA runtime this library links can run here (a driver new enough, a device); else
// its status, with kvk_last_error() saying why. The loader calls it once: a library built with a
// newer toolkit than the driver supports is refused at load, not at every call.
int kvk_probe(void) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return cuda_fail("cudaGetDeviceCount", e);
  if (count == 0) return fail("no CUDA device");
  return 0;
}

// Bit 0: the SM90 bulk-copy path is compiled in (built with the CUTLASS headers).
int kvk_features(void) {
#if defined(KVK_HAVE_CUTE)
  return 1;
#else
  return 0;
#endif
}

const char* kvk_last_error(void) { return g_err; }

// to_staging: 1 = gather (cache -> staging), 0 = scatter. word: access width in bytes (16, 8, 4,
// 2, 1), dividing row_bytes, every stride, every base address and the staging pointer.
int kvk_paged_copy(int to_staging, const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging,
                   int* err, int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t rows,
                   int64_t row_bytes, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
                   int64_t entry_bytes, int64_t word, int64_t max_ctas, int device, uintptr_t stream) {
  if (int rc = check_items(ptr_tab, block_ids, staging, err, n, C, num_regions)) return rc;
  if (H <= 0 || rows <= 0 || rows % H != 0) return fail("rows: expected a positive multiple of H");
  if (int rc = check_strides(stride_b, stride_n, stride_h)) return rc;
  if (row_bytes <= 0) return fail("row_bytes: expected > 0");
  if (word != 1 && word != 2 && word != 4 && word != 8 && word != 16) return fail("word: expected 1, 2, 4, 8 or 16");
  if (row_bytes % word || stride_b % word || stride_n % word || stride_h % word || region_bytes % word ||
      entry_bytes % word || reinterpret_cast<uintptr_t>(staging) % word)
    return fail("word: does not divide every stride, size and the staging address");
  if (!holds(entry_bytes, prod(n, rows, row_bytes)) || !holds(region_bytes, prod(C, entry_bytes)))
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

// FP8 gather (docs/quant.md): quantize the chunks of block_ids into e4m3 codes + fp32 scales.
// Byte strides; kind 0 bf16, 1 fp16, 2 fp32; per_block: scale per (block, head) instead of per
// (token, head); vec16: every cache base address, stride and row, head_dim and the staging address
// are multiples of 16 (the caller checks the base addresses: they live in the device table).
// Writes codes and scales only: section gaps and region padding are the caller's to zero.
int kvk_quant_gather(const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging, int* err, int64_t n,
                     int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t block_size,
                     int64_t head_dim, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
                     int64_t q_entry_bytes, int64_t scale_base_bytes, int64_t scale_entry_bytes, int kind,
                     int per_block, int vec16, int64_t max_ctas, int device, uintptr_t stream) {
  return fp8_copy(true, ptr_tab, block_ids, ids_64, staging, err, n, num_blocks, C, num_regions, H, block_size,
                  head_dim, stride_b, stride_n, stride_h, region_bytes, q_entry_bytes, scale_base_bytes,
                  scale_entry_bytes, kind, per_block, vec16, max_ctas, device, stream);
}

// FP8 scatter: dequantize staging (same arguments as kvk_quant_gather) into block_ids of the cache.
int kvk_dequant_scatter(const int64_t* ptr_tab, const void* block_ids, int ids_64, const uint8_t* staging, int* err,
                        int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t block_size,
                        int64_t head_dim, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
                        int64_t q_entry_bytes, int64_t scale_base_bytes, int64_t scale_entry_bytes, int kind,
                        int per_block, int vec16, int64_t max_ctas, int device, uintptr_t stream) {
  return fp8_copy(false, ptr_tab, block_ids, ids_64, const_cast<uint8_t*>(staging), err, n, num_blocks, C,
                  num_regions, H, block_size, head_dim, stride_b, stride_n, stride_h, region_bytes, q_entry_bytes,
                  scale_base_bytes, scale_entry_bytes, kind, per_block, vec16, max_ctas, device, stream);
}

// Byte-plane shuffle of a 16-bit cache (docs/quant.md): to_staging 1 = gather, 0 = scatter.
// entry_bytes = 2 * n * block_size * H * head_dim (the two planes); vec16 as in kvk_quant_gather.
// Region padding is the caller's to zero.
int kvk_shuffle_copy(int to_staging, const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging,
                     int* err, int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H,
                     int64_t block_size, int64_t head_dim, int64_t stride_b, int64_t stride_n, int64_t stride_h,
                     int64_t region_bytes, int64_t entry_bytes, int vec16, int64_t max_ctas, int device,
                     uintptr_t stream) {
  int rc = check_common(ptr_tab, block_ids, staging, err, n, C, num_regions, H, block_size, head_dim, 2, stride_b,
                        stride_n, stride_h, vec16, max_ctas);
  if (rc) return rc;
  if (entry_bytes != prod(2, n, block_size, H, head_dim))
    return fail("entry_bytes: expected 2 * n * block_size * H * head_dim (two byte planes)");
  if (!holds(region_bytes, prod(C, entry_bytes))) return fail("region_bytes: smaller than C * entry_bytes");
  if (vec16 && (region_bytes % 16 || entry_bytes % 32))
    return fail("vec16: region_bytes and entry_bytes / 2 must be multiples of 16");
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  kvk::QuantCopyParams p{ptr_tab,  block_ids, staging,  err, n, num_blocks, num_regions * C * n,
                         stride_b, stride_n,  stride_h, C,   H, block_size, head_dim,
                         region_bytes, entry_bytes, 0, 0, ids_64 != 0, 0};
  const int g = grid_size(p.num_items, max_ctas);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  clear_last_error();
  if (to_staging) {
    if (vec16) {
      kvk::shuffle_copy_kernel<true, true><<<g, kvk::kThreads, 0, s>>>(p);
    } else {
      kvk::shuffle_copy_kernel<true, false><<<g, kvk::kThreads, 0, s>>>(p);
    }
  } else if (vec16) {
    kvk::shuffle_copy_kernel<false, true><<<g, kvk::kThreads, 0, s>>>(p);
  } else {
    kvk::shuffle_copy_kernel<false, false><<<g, kvk::kThreads, 0, s>>>(p);
  }
  return guard.release("shuffle_copy_kernel launch", cudaGetLastError());
}

// SM90 bulk-copy gather / scatter (csrc/kernels/bulk_copy.cuh), same arguments as kvk_paged_copy
// minus `word`: every (block, entry) chunk must be one contiguous run of rows * row_bytes bytes in
// the cache (stride_h == row_bytes or H == 1; stride_n == H * row_bytes or one token per block),
// every address, stride and size a multiple of 16 (the caller checks the cache base addresses: they
// live in the device table), staging in device memory, a device of compute capability >= 9.0.
int kvk_bulk_copy(int to_staging, const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging,
                  int* err, int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t rows,
                  int64_t row_bytes, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
                  int64_t entry_bytes, int64_t max_ctas, int device, uintptr_t stream) {
  if (!kvk_features()) return fail("bulk copy: this build has no CUTLASS headers (csrc/build.py, docs/csrc.md)");
  if (int rc = check_items(ptr_tab, block_ids, staging, err, n, C, num_regions)) return rc;
  if (H <= 0 || rows <= 0 || rows % H != 0) return fail("rows: expected a positive multiple of H");
  if (int rc = check_strides(stride_b, stride_n, stride_h)) return rc;
  if (row_bytes <= 0) return fail("row_bytes: expected > 0");
  if (row_bytes % 16 || stride_b % 16 || region_bytes % 16 || entry_bytes % 16 ||
      reinterpret_cast<uintptr_t>(staging) % 16)
    return fail("row_bytes, stride_b, region_bytes, entry_bytes, staging: expected multiples of 16");
  if ((H > 1 && stride_h != row_bytes) || (rows > H && stride_n != prod(H, row_bytes)))  // prod: no wrap-around
    return fail("stride_n, stride_h: a (block, entry) chunk is not contiguous in the cache");
  if (!holds(entry_bytes, prod(n, rows, row_bytes)) || !holds(region_bytes, prod(C, entry_bytes)))
    return fail("entry_bytes, region_bytes: smaller than the payload they must hold");
  if (max_ctas < 0) return fail("max_ctas: expected >= 0");
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  int major = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e != cudaSuccess) return guard.release("cudaDeviceGetAttribute", e);
  if (major < 9) {
    if (int rc = guard.release("", cudaSuccess)) return rc;  // a failed restore is reported first
    return fail("bulk copy: needs a device of compute capability >= 9.0 (cp.async.bulk)");
  }
  cudaPointerAttributes attr;
  e = cudaPointerGetAttributes(&attr, staging);
  if (e != cudaSuccess) return guard.release("cudaPointerGetAttributes", e);
  if (attr.type != cudaMemoryTypeDevice) {
    if (int rc = guard.release("", cudaSuccess)) return rc;
    return fail("staging: bulk copy needs device memory (use kvk_paged_copy for host staging)");
  }
  if (attr.device != device) {  // cp.async.bulk on a peer's memory faults (or runs unordered)
    if (int rc = guard.release("", cudaSuccess)) return rc;
    return fail("staging: expected memory of the launch's device (bulk copy)");
  }
  kvk::PagedCopyParams p{ptr_tab, block_ids, staging, err, n, num_blocks, num_regions * C * n,
                         stride_b, stride_n, stride_h, region_bytes, entry_bytes, C, H, rows, row_bytes, ids_64 != 0};
  const kvk::BulkPlan plan = kvk::bulk_plan(rows * row_bytes);
  const int64_t units = prod(p.num_items, plan.pieces);
  if (units < 0) {
    if (int rc = guard.release("", cudaSuccess)) return rc;
    return fail("bulk copy: num_items * pieces: expected < 2^63 copy units");
  }
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const bool gather = to_staging != 0;
  switch (plan.stages) {
    case 4: e = launch_bulk<4>(gather, p, plan.piece, units, max_ctas, device, s); break;
    case 8: e = launch_bulk<8>(gather, p, plan.piece, units, max_ctas, device, s); break;
    default: e = launch_bulk<16>(gather, p, plan.piece, units, max_ctas, device, s); break;
  }
  return guard.release("bulk_copy_kernel launch", e);
}

}  // extern "C"
