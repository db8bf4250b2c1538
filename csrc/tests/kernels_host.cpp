// The kernels of csrc/kernels/quant_copy.cuh, paged_copy.cuh and bulk_copy.cuh (its bulk operations
// replaced by memcpy: KVK_EMULATE) compiled as plain C++ against the stand-in
// csrc/tests/emu/cuda_runtime.h and run on the CPU (one std::thread per CUDA thread), so their
// indexing, id rules, padding, granularities and vector / scalar paths are compared byte for byte
// with the torch reference on a GPU-less machine (tests/test_csrc.py). Host pointers play the
// device pointers. Build: g++ -std=c++20 -O1 -shared -fPIC -pthread -Wno-unknown-pragmas
// -Icsrc/tests/emu. Exports the kernel entry points of the C ABI (below).
#include <cstdlib>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#define KVK_EMULATE 1
#include "../kernels/bulk_copy.cuh"
#include "../kernels/paged_copy.cuh"
#include "../kernels/quant_copy.cuh"

thread_local kvk_emu_dim threadIdx{0};
thread_local kvk_emu_dim blockIdx{0};
kvk_emu_dim gridDim{1};
kvk_emu_dim blockDim{kvk::kThreads};

namespace {
constexpr int kWarps = kvk::kThreads / 32;
unsigned g_lane_val[kWarps][32];
std::unique_ptr<std::barrier<>> g_bar[kWarps];
std::unique_ptr<std::barrier<>> g_block_bar;
std::mutex g_atomic;

// Run `kernel` for every block of a grid of `grid` blocks: kThreads threads, each walking the blocks
// in order (blocks are independent; within a block only warp shuffles synchronize).
void launch(const std::function<void()>& kernel, int grid) {
  gridDim.x = static_cast<unsigned>(grid);
  for (auto& b : g_bar) b = std::make_unique<std::barrier<>>(32);
  g_block_bar = std::make_unique<std::barrier<>>(kvk::kThreads);
  std::vector<std::thread> ts;
  for (int t = 0; t < kvk::kThreads; ++t) {
    ts.emplace_back([t, grid, &kernel] {
      threadIdx.x = static_cast<unsigned>(t);
      for (int b = 0; b < grid; ++b) {
        blockIdx.x = static_cast<unsigned>(b);
        kernel();
      }
    });
  }
  for (auto& t : ts) t.join();
}
}  // namespace

unsigned __shfl_xor_sync(unsigned, unsigned v, int lane_mask) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  g_lane_val[warp][lane] = v;
  g_bar[warp]->arrive_and_wait();
  const unsigned u = g_lane_val[warp][lane ^ lane_mask];
  g_bar[warp]->arrive_and_wait();
  return u;
}

void __syncthreads() { g_block_bar->arrive_and_wait(); }

void __trap() { std::abort(); }

int atomicAdd(int* p, int v) {
  std::lock_guard<std::mutex> lock(g_atomic);
  const int old = *p;
  *p = old + v;
  return old;
}

namespace {
// mode 0: fp8 gather, 1: fp8 scatter, 2: shuffle gather, 3: shuffle scatter.
int run(int mode, const kvk::QuantCopyParams& p, int kind, bool per_block, bool vec16, int64_t max_ctas) {
  int64_t items = p.num_items;  // the fixed-geometry token instances take several items per CTA (capi.cu)
  const int64_t nv = p.head_dim / (kind == 2 ? 4 : 8);
  if (mode == 0 && !per_block && vec16 && kvk::token_fixed_nv(nv) != 0) {
    const int ipc = kvk::token_fixed_nv(nv) == 72
                        ? kvk::token_items_per_cta<kvk::kRegVecsLong>(72, p.block_size * p.H)
                        : kvk::token_items_per_cta<kvk::kRegVecs>(static_cast<int>(nv), p.block_size * p.H);
    items = (items + ipc - 1) / ipc;
  }
  const int64_t g = max_ctas > 0 && max_ctas < items ? max_ctas : items;
  std::function<void()> k;
#define KVK_FP8(K)                                                                                    \
  if (kind == K) {                                                                                    \
    if (mode == 0 && per_block && vec16) k = [&] { kvk::quant_gather_kernel<K, true, true>(p); };     \
    if (mode == 0 && per_block && !vec16) k = [&] { kvk::quant_gather_kernel<K, true, false>(p); };   \
    if (mode == 0 && !per_block && vec16) k = [&] { kvk::quant_gather_kernel<K, false, true>(p); };   \
    if (mode == 0 && !per_block && vec16 &&                                                           \
        kvk::token_reg_vecs(p.head_dim / kvk::Elem<K>::kPerVec) == kvk::kRegVecsLong)                 \
      k = [&] { kvk::quant_gather_kernel<K, false, true, kvk::kRegVecsLong>(p); };                    \
    if (mode == 0 && !per_block && vec16) { /* capi.cu's fixed-geometry instances */                  \
      const int fixed = kvk::token_fixed_nv(p.head_dim / kvk::Elem<K>::kPerVec);                      \
      if (fixed == 16) k = [&] { kvk::quant_gather_kernel<K, false, true, kvk::kRegVecs, 16>(p); };   \
      if (fixed == 32) k = [&] { kvk::quant_gather_kernel<K, false, true, kvk::kRegVecs, 32>(p); };   \
      if (fixed == 72) k = [&] { kvk::quant_gather_kernel<K, false, true, kvk::kRegVecsLong, 72>(p); }; \
    }                                                                                                 \
    if (mode == 0 && !per_block && !vec16) k = [&] { kvk::quant_gather_kernel<K, false, false>(p); }; \
    if (mode == 1 && vec16) k = [&] { kvk::dequant_scatter_kernel<K, true>(p); };                     \
    if (mode == 1 && !vec16) k = [&] { kvk::dequant_scatter_kernel<K, false>(p); };                   \
  }
  KVK_FP8(0)
  KVK_FP8(1)
  KVK_FP8(2)
#undef KVK_FP8
  if (mode == 2 && vec16) k = [&] { kvk::shuffle_copy_kernel<true, true>(p); };
  if (mode == 2 && !vec16) k = [&] { kvk::shuffle_copy_kernel<true, false>(p); };
  if (mode == 3 && vec16) k = [&] { kvk::shuffle_copy_kernel<false, true>(p); };
  if (mode == 3 && !vec16) k = [&] { kvk::shuffle_copy_kernel<false, false>(p); };
  if (!k) return -1;
  launch(k, static_cast<int>(g));
  return 0;
}
}  // namespace

// The C ABI of csrc/bindings/capi.cu (same signatures, so kvkernels/_cuda.py's launchers drive it
// unchanged), minus its precondition checks and device / stream handling.
extern "C" {

int kvk_abi_version(void) { return 4; }

int kvk_probe(void) { return 0; }

int kvk_features(void) { return 1; }

const char* kvk_last_error(void) { return "emulated kernel: bad kind / mode"; }

int kvk_paged_copy(int to_staging, const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging,
                   int* err, int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t rows,
                   int64_t row_bytes, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
                   int64_t entry_bytes, int64_t word, int64_t max_ctas, int, uintptr_t) {
  kvk::PagedCopyParams p{ptr_tab,      block_ids,   staging, err, n,    num_blocks, num_regions * C * n, stride_b,
                         stride_n,     stride_h,    region_bytes, entry_bytes, C, H, rows, row_bytes, ids_64 != 0};
  std::function<void()> k;
#define KVK_WORD(W, T)                                                        \
  if (word == W) {                                                            \
    if (to_staging) k = [&] { kvk::paged_copy_kernel<T, true>(p); };          \
    if (!to_staging) k = [&] { kvk::paged_copy_kernel<T, false>(p); };        \
  }
  KVK_WORD(16, uint4)
  KVK_WORD(8, uint2)
  KVK_WORD(4, uint32_t)
  KVK_WORD(2, uint16_t)
  KVK_WORD(1, uint8_t)
#undef KVK_WORD
  if (!k) return -1;
  launch(k, static_cast<int>(max_ctas > 0 && max_ctas < p.num_items ? max_ctas : p.num_items));
  return 0;
}

int kvk_bulk_copy(int to_staging, const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging,
                  int* err, int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t rows,
                  int64_t row_bytes, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
                  int64_t entry_bytes, int64_t max_ctas, int, uintptr_t) {
  kvk::PagedCopyParams p{ptr_tab,      block_ids,   staging, err, n,    num_blocks, num_regions * C * n, stride_b,
                         stride_n,     stride_h,    region_bytes, entry_bytes, C, H, rows, row_bytes, ids_64 != 0};
  const kvk::BulkPlan plan = kvk::bulk_plan(rows * row_bytes);
  std::function<void()> k;
#define KVK_STAGES(S)                                                                         \
  if (plan.stages == S) {                                                                     \
    if (to_staging) k = [&] { kvk::bulk_copy_kernel<S, true>(p, plan.piece); };               \
    if (!to_staging) k = [&] { kvk::bulk_copy_kernel<S, false>(p, plan.piece); };             \
  }
  KVK_STAGES(4)
  KVK_STAGES(8)
  KVK_STAGES(16)
#undef KVK_STAGES
  if (!k) return -1;
  const int64_t units = p.num_items * plan.pieces;
  launch(k, static_cast<int>(max_ctas > 0 && max_ctas < units ? max_ctas : units));
  return 0;
}

int kvk_quant_gather(const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging, int* err, int64_t n,
                     int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t block_size,
                     int64_t head_dim, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
                     int64_t q_entry_bytes, int64_t scale_base_bytes, int64_t scale_entry_bytes, int kind,
                     int per_block, int vec16, int64_t max_ctas, int, uintptr_t) {
  kvk::QuantCopyParams p{ptr_tab, block_ids, staging, err, n, num_blocks, num_regions * C * n, stride_b, stride_n,
                         stride_h, C, H, block_size, head_dim, region_bytes, q_entry_bytes, scale_base_bytes,
                         scale_entry_bytes, ids_64 != 0, per_block != 0};
  return run(0, p, kind, per_block != 0, vec16 != 0, max_ctas);
}

int kvk_dequant_scatter(const int64_t* ptr_tab, const void* block_ids, int ids_64, const uint8_t* staging, int* err,
                        int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H, int64_t block_size,
                        int64_t head_dim, int64_t stride_b, int64_t stride_n, int64_t stride_h, int64_t region_bytes,
                        int64_t q_entry_bytes, int64_t scale_base_bytes, int64_t scale_entry_bytes, int kind,
                        int per_block, int vec16, int64_t max_ctas, int, uintptr_t) {
  kvk::QuantCopyParams p{ptr_tab, block_ids, const_cast<uint8_t*>(staging), err, n, num_blocks, num_regions * C * n,
                         stride_b, stride_n, stride_h, C, H, block_size, head_dim, region_bytes, q_entry_bytes,
                         scale_base_bytes, scale_entry_bytes, ids_64 != 0, per_block != 0};
  return run(1, p, kind, per_block != 0, vec16 != 0, max_ctas);
}

int kvk_shuffle_copy(int to_staging, const int64_t* ptr_tab, const void* block_ids, int ids_64, uint8_t* staging,
                     int* err, int64_t n, int64_t num_blocks, int64_t C, int64_t num_regions, int64_t H,
                     int64_t block_size, int64_t head_dim, int64_t stride_b, int64_t stride_n, int64_t stride_h,
                     int64_t region_bytes, int64_t entry_bytes, int vec16, int64_t max_ctas, int, uintptr_t) {
  kvk::QuantCopyParams p{ptr_tab, block_ids, staging, err, n, num_blocks, num_regions * C * n, stride_b, stride_n,
                         stride_h, C, H, block_size, head_dim, region_bytes, entry_bytes, 0, 0, ids_64 != 0, 0};
  return run(to_staging ? 2 : 3, p, 0, false, vec16 != 0, max_ctas);
}

}  // extern "C"
