// Paged gather / scatter on raw pointers (no torch headers). Same work decomposition and id rules
// as triton_ops/_paged.py: a work item is one (region j, entry c, staging slot i) chunk of
// block_size * H rows of row_bytes; items are numbered (j * C + c) * n + i; a persistent grid of
// min(items, max_ctas) blocks strides over them. Ids outside [0, num_blocks) are padding: gather
// writes zeros, scatter skips; ids other than -1 among them are counted in *err.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace kvk {

struct PagedCopyParams {
  const int64_t* ptr_tab;  // [R, C] byte address of block 0 of (requested layer j, entry c)
  const void* block_ids;   // [n] int32 or int64 (ids_64)
  uint8_t* staging;        // [R * region_bytes] staging buffer
  int* err;                // [1] invalid-id counter
  int64_t n, num_blocks, num_items;
  int64_t stride_b, stride_n, stride_h;  // cache byte strides: block, token, head
  int64_t region_bytes, entry_bytes;     // staging: bytes per region, per entry
  int64_t C, H, rows, row_bytes;         // entries per layer, heads, block_size * H, head_dim * e
  int ids_64;
};

// Work item w = (j * C + c) * n + i: region j, entry c, staging slot i, and the slot's block id.
struct PagedItem {
  int64_t j, c, i, bid;
  bool valid;  // bid in [0, num_blocks)
};

__device__ __forceinline__ PagedItem paged_item(const PagedCopyParams& p, int64_t w) {
  const int64_t jc = w / p.n;
  const int64_t i = w - jc * p.n;
  const int64_t j = jc / p.C;
  const int64_t bid = p.ids_64 ? static_cast<const int64_t*>(p.block_ids)[i]
                               : static_cast<int64_t>(static_cast<const int32_t*>(p.block_ids)[i]);
  return PagedItem{j, jc - j * p.C, i, bid, bid >= 0 && bid < p.num_blocks};
}

// Word: the access width (uint4 = 16 bytes, uint2, uint32_t, uint16_t, uint8_t), chosen on the
// host so that every address, stride and row is a multiple of sizeof(Word).
template <typename Word, bool kToStaging>
__global__ void paged_copy_kernel(PagedCopyParams p) {
  // grid: (min(num_items, max_ctas),); block: 256 threads cover (row, word) pairs of one chunk
  const int64_t wpr = p.row_bytes / static_cast<int64_t>(sizeof(Word));  // words per row
  const int64_t words = p.rows * wpr;
  for (int64_t w = blockIdx.x; w < p.num_items; w += gridDim.x) {
    const PagedItem it = paged_item(p, w);
    const bool valid = it.valid;
    // counted once per slot: in the first n work items (layer region 0, entry 0)
    if (!valid && it.bid != -1 && threadIdx.x == 0 && w < p.n) atomicAdd(p.err, 1);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(p.ptr_tab[it.j * p.C + it.c]);
    uint8_t* cache = const_cast<uint8_t*>(base) + (valid ? it.bid : 0) * p.stride_b;
    uint8_t* stage = p.staging + it.j * p.region_bytes + it.c * p.entry_bytes + it.i * p.rows * p.row_bytes;
    for (int64_t k = threadIdx.x; k < words; k += blockDim.x) {
      const int64_t r = k / wpr;
      const int64_t x = k - r * wpr;
      const int64_t t = r / p.H;
      const int64_t h = r - t * p.H;
      Word* cp = reinterpret_cast<Word*>(cache + t * p.stride_n + h * p.stride_h) + x;
      Word* sp = reinterpret_cast<Word*>(stage + r * p.row_bytes) + x;
      if (kToStaging) {
        Word v;
        if (valid) {
          v = *cp;
        } else {
          v = Word{};
        }
        *sp = v;
      } else if (valid) {
        *cp = *sp;
      }
    }
  }
}

}  // namespace kvk
