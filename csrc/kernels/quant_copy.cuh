// Fused FP8 gather (quantize) / scatter (dequantize) and byte-plane shuffle gather / scatter on raw
// pointers (no torch headers). Formats: docs/quant.md. Same work decomposition and id rules as
// paged_copy.cuh and the Triton kernels (triton_ops/quant_gather.py, dequant_scatter.py,
// shuffle_gather.py, unshuffle_scatter.py): a work item is one (region j, entry c, staging slot i)
// chunk, items are numbered (j * C + c) * n + i, a persistent grid of min(items, max_ctas) blocks of
// kThreads threads strides over them. Ids outside [0, num_blocks) are padding: gather writes zero
// codes and zero scales (the torch reference and Triton do the same), scatter skips; ids other
// than -1 among them are counted in *err.
//
// kVec: every cache base address, byte stride and row, the staging pointer and head_dim are
// multiples of 16 bytes / elements (checked on the host): a thread moves 16 bytes of cache per
// access (8 16-bit or 4 fp32 elements). Otherwise one element per access (still coalesced).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "fp8.cuh"

namespace kvk {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct QuantCopyParams {
  const int64_t* ptr_tab;  // [R, C] byte address of block 0 of (requested layer j, entry c)
  const void* block_ids;   // [n] int32 or int64 (ids_64)
  uint8_t* staging;        // [R * region_bytes], 16-byte aligned
  int* err;                // [1] invalid-id counter
  int64_t n, num_blocks, num_items;
  int64_t stride_b, stride_n, stride_h;  // cache byte strides: block, token, head
  int64_t C, H, block_size, head_dim;    // entries per layer, heads, tokens per block, D
  int64_t region_bytes;                  // staging: bytes per region
  int64_t q_entry_bytes;                 // fp8: codes section of one entry; shuffle: the entry (2 planes)
  int64_t scale_base_bytes;              // fp8: offset of the scales in a region (C * q_entry_bytes)
  int64_t scale_entry_bytes;             // fp8: scales section of one entry
  int ids_64;
  int per_block;  // fp8 scatter: scale per (block, head) instead of per (token, head)
};

template <int kKind>
struct Elem {
  using T = uint16_t;                 // bf16 / fp16 bits
  using Vec = uint4;                  // 16 bytes = 8 elements
  using Codes = uint2;                // their 8 codes
  static constexpr int kPerVec = 8;
};
template <>
struct Elem<2> {
  using T = uint32_t;                 // fp32 bits
  using Vec = uint4;                  // 16 bytes = 4 elements
  using Codes = uint32_t;             // their 4 codes
  static constexpr int kPerVec = 4;
};

struct Item {
  int64_t i, j, c, bid;
  bool valid;
};

// leader: the one thread of the item's threads that counts an invalid id (the CTA's first thread,
// or the first of the warps that share a CTA's item, see quant_token_fixed_items)
__device__ __forceinline__ Item item_coords(const QuantCopyParams& p, int64_t w, bool leader) {
  Item it;
  if (p.num_items <= 0xFFFFFFFFll) {  // always, in practice: 32-bit divisions (a 64-bit one is a call)
    const uint32_t wu = static_cast<uint32_t>(w), nu = static_cast<uint32_t>(p.n), cu = static_cast<uint32_t>(p.C);
    const uint32_t jc = wu / nu;
    it.i = wu - jc * nu;
    it.j = jc / cu;
    it.c = jc - static_cast<uint32_t>(it.j) * cu;
  } else {
    const int64_t jc = w / p.n;
    it.i = w - jc * p.n;
    it.j = jc / p.C;
    it.c = jc - it.j * p.C;
  }
  it.bid = p.ids_64 ? static_cast<const int64_t*>(p.block_ids)[it.i]
                    : static_cast<int64_t>(static_cast<const int32_t*>(p.block_ids)[it.i]);
  it.valid = it.bid >= 0 && it.bid < p.num_blocks;
  // counted once per slot: in the first n work items (layer region 0, entry 0)
  if (!it.valid && it.bid != -1 && leader && w < p.n) atomicAdd(p.err, 1);
  return it;
}

// Quotient and remainder inside one work item (indices below block_size * H * head_dim < 2^31,
// checked by the bindings): 32-bit unsigned division. A 64-bit division is a long instruction
// sequence on the GPU, and these run per 16-byte vector in the FP8 and shuffle kernels.
struct QR {
  uint32_t q, r;
};
__device__ __forceinline__ QR divmod32(int64_t a, int64_t b) {
  const uint32_t au = static_cast<uint32_t>(a), bu = static_cast<uint32_t>(b);
  const uint32_t q = au / bu;
  return QR{q, au - q * bu};
}

// Byte offset of row r = t * H + h of a chunk: r * stride when rows are evenly spaced (NHD: stride_n
// == H * stride_h; one head: stride_n), else through (t, h) = divmod(r, H). row_stride() is 0 in
// the second case. The division cost ~27 instructions per 16-byte vector in the FP8 gather's
// register path (static SASS, sm_90, 2026-11-23), where NHD caches never need it.
__device__ __forceinline__ int64_t row_stride(const QuantCopyParams& p) {
  if (p.H == 1) return p.stride_n;
  return p.stride_n == p.H * p.stride_h ? p.stride_h : 0;
}
__device__ __forceinline__ int64_t row_offset(const QuantCopyParams& p, int64_t r, int64_t stride) {
  if (stride != 0) return r * stride;
  const QR th = divmod32(r, p.H);
  return static_cast<int64_t>(th.q) * p.stride_n + static_cast<int64_t>(th.r) * p.stride_h;
}

// Unsigned max (one VIMNMX on the GPU rather than a compare and a select).
__device__ __forceinline__ uint32_t umax32(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return max(a, b);
#else
  return a > b ? a : b;
#endif
}

// A 16-byte read of the cache through the read-only path (LDG.CONSTANT: the kernels never write
// the cache they read; the pointer comes from a table, so the compiler emitted generic loads).
template <class V>
__device__ __forceinline__ V load_ro(const V* ptr) {
#ifdef __CUDA_ARCH__
  return __ldg(ptr);
#else
  return *ptr;
#endif
}

__device__ __forceinline__ const uint8_t* cache_block(const QuantCopyParams& p, const Item& it) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(p.ptr_tab[it.j * p.C + it.c]);
  return base + (it.valid ? it.bid : 0) * p.stride_b;
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t u = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

// amax bits of one cache row of D elements (all lanes of the warp get it).
template <int kKind, bool kVec>
__device__ __forceinline__ uint32_t row_amax(const uint8_t* row, int64_t D, int lane) {
  using E = Elem<kKind>;
  uint32_t m = 0;
  if (kVec) {
    const int64_t nv = D / E::kPerVec;
    for (int64_t k = lane; k < nv; k += 32) {
      const typename E::Vec v = reinterpret_cast<const typename E::Vec*>(row)[k];
      const typename E::T* e = reinterpret_cast<const typename E::T*>(&v);
#pragma unroll
      for (int x = 0; x < E::kPerVec; ++x) {
        const uint32_t a = abs_finite_bits(load_as_f32<kKind>(e[x]));
        m = a > m ? a : m;
      }
    }
  } else {
    for (int64_t d = lane; d < D; d += 32) {
      const uint32_t a = abs_finite_bits(load_as_f32<kKind>(reinterpret_cast<const typename E::T*>(row)[d]));
      m = a > m ? a : m;
    }
  }
  return warp_max(m);
}

// Quantize one cache row (D elements) with scale s into D codes at q (valid = false: zero codes).
template <int kKind, bool kVec>
__device__ __forceinline__ void quantize_row(const uint8_t* row, uint8_t* q, int64_t D, Recip rs, bool valid,
                                             int lane) {
  using E = Elem<kKind>;
  if (kVec) {
    const int64_t nv = D / E::kPerVec;
    for (int64_t k = lane; k < nv; k += 32) {
      typename E::Codes out{};
      if (valid) {
        const typename E::Vec v = reinterpret_cast<const typename E::Vec*>(row)[k];
        const typename E::T* e = reinterpret_cast<const typename E::T*>(&v);
        uint8_t* o = reinterpret_cast<uint8_t*>(&out);
        static_assert(E::kPerVec % 2 == 0, "codes are converted in pairs");
#pragma unroll
        for (int x = 0; x < E::kPerVec; x += 2) {  // kPerVec is 8 or 4: pairs for the conversion
          const uint32_t c2 = e4m3x2_encode(quotient(load_as_f32<kKind>(e[x]), rs),
                                            quotient(load_as_f32<kKind>(e[x + 1]), rs));
          o[x] = static_cast<uint8_t>(c2);
          o[x + 1] = static_cast<uint8_t>(c2 >> 8);
        }
      }
      reinterpret_cast<typename E::Codes*>(q)[k] = out;
    }
  } else {
    for (int64_t d = lane; d < D; d += 32) {
      uint8_t code = 0;
      if (valid)
        code = static_cast<uint8_t>(
            e4m3x2_encode(quotient(load_as_f32<kKind>(reinterpret_cast<const typename E::T*>(row)[d]), rs), 0.0f));
      q[d] = code;
    }
  }
}

// Token granularity with 16-byte vectors, rows held in registers: a row of nv = D / kPerVec vectors
// belongs to a group of g lanes (g = nv rounded up to a power of two, at most 32), so a warp works
// on 32 / g rows at once and a lane holds up to kRegVecs vectors: the 32 / g rows of up to
// kRegVecs / ceil(nv / g) row steps are loaded before any reduction (bytes in flight), reduced
// within their group (xor shuffles below g stay in the group), then quantized from the registers
// (one read of the cache). The first version (one warp per row, rows read twice) left half the lanes
// idle for D = 128 and one row in flight per warp: 6-19 % of the copy peak on the H100 (2026-11-23).
constexpr int kRegVecs = 2;
// Rows of 65-96 vectors (MLA's 576 bf16: 72) get their own kernel instance with 3 vectors per lane
// (one row step, one read): 72 registers, where the same code in the kRegVecs = 2 kernel would
// have cost every shape a quarter of its occupancy (60 -> 72 registers).
constexpr int kRegVecsLong = 3;

// Vectors per lane of the token path's kernel instance for rows of nv 16-byte vectors (longer rows
// take the warp-per-row loop of the kRegVecs instance, at its occupancy).
__host__ __device__ constexpr int token_reg_vecs(int64_t nv) {
  return nv > 32 * kRegVecs && nv <= 32 * kRegVecsLong ? kRegVecsLong : kRegVecs;
}

__host__ __device__ constexpr int group_lanes(int64_t nv) {
  int g = 1;
  while (g < nv && g < 32) g <<= 1;
  return g;
}

// Rows of these many vectors get kernel instances with the row geometry known at compile time
// (kNV): bf16/fp16 head_dim 128 (16), fp32 128 / 16-bit 256 (32), MLA's 576 bf16 (72). With nv
// a run-time value the group size, lanes per row and row steps are too, so the amax shuffle is
// a loop and every vector carries bounds checks: 38.6 instructions per element against
// Triton's 22.4 in the static SASS of the D = 128 instance (sm_90, 2026-11-23), where Triton's
// kernel ran 1.6x faster on the H100. 0: the run-time instance (any other nv).
__host__ __device__ constexpr int token_fixed_nv(int64_t nv) { return nv == 16 || nv == 32 || nv == 72 ? static_cast<int>(nv) : 0; }

// Element y of a 16-byte vector, through its 32-bit words (register extraction, no address taken).
template <int kKind>
__device__ __forceinline__ uint32_t vec_elem(const uint4& v, int y) {
  constexpr int kPerWord = Elem<kKind>::kPerVec / 4;  // 2 for 16-bit kinds, 1 for fp32
  const int wi = y / kPerWord;
  const uint32_t w = wi == 0 ? v.x : wi == 1 ? v.y : wi == 2 ? v.z : v.w;
  if (kPerWord == 1) return w;
  return (y % kPerWord) ? (w >> 16) : (w & 0xFFFFu);
}

template <int kKind, int kRegVecs, int kNV = 0>
__device__ __forceinline__ void quant_rows_token_vec(const QuantCopyParams& p, const Item& it, const uint8_t* cache,
                                                     uint8_t* q_out, float* s_out, int warp, int lane,
                                                     int nwarps = kWarps) {
  using E = Elem<kKind>;
  // kNV > 0: the row geometry below is compile-time (shuffles unrolled with constant offsets,
  // bounds checks folded); kNV == 0: the same values at run time
  constexpr bool kFixed = kNV > 0;
  constexpr int kG = kFixed ? group_lanes(kNV) : 32;
  constexpr int kPerLane = kFixed ? (kNV + kG - 1) / kG : 1;
  constexpr bool kFull = kFixed && kPerLane * kG == kNV;  // every lane's vectors exist: no k < nv check
  static_assert(!kFixed || kPerLane <= kRegVecs, "a fixed row must fit the lane's registers");
  const int64_t D = p.head_dim;
  const int64_t rows = p.block_size * p.H;
  const int64_t nv = kFixed ? kNV : D / E::kPerVec;
  const int g = kFixed ? kG : group_lanes(nv);
  const int per_lane = kFixed ? kPerLane : static_cast<int>((nv + g - 1) / g);  // vectors of one row per lane (<= kRegVecs)
  const int steps = kRegVecs / per_lane;                      // row steps held at once (>= 1)
  const int rpw = 32 / g;                                     // rows per warp per step
  const int sub = lane / g, gl = lane - sub * g;
  const int64_t tile = static_cast<int64_t>(rpw) * steps;     // rows of one warp iteration
  const int64_t rstride = row_stride(p);
  for (int64_t r0 = warp * tile; r0 < rows; r0 += nwarps * tile) {  // warp-uniform: shuffles see all lanes
    typename E::Vec v[kRegVecs];
    uint32_t m[kRegVecs];
#pragma unroll
    for (int x = 0; x < kRegVecs; ++x) {
      const int u = x / per_lane;
      const int64_t r = r0 + static_cast<int64_t>(u) * rpw + sub;
      const int64_t k = gl + static_cast<int64_t>(x - u * per_lane) * g;
      m[x] = 0;
      v[x] = typename E::Vec{};
      if (u < steps && r < rows && (kFull || k < nv) && it.valid)
        v[x] = load_ro(reinterpret_cast<const typename E::Vec*>(cache + row_offset(p, r, rstride)) + k);
    }
#pragma unroll
    for (int x = 0; x < kRegVecs; ++x) {
#pragma unroll
      for (int y = 0; y < E::kPerVec; ++y)
        m[x] = umax32(m[x], abs_finite_bits(load_as_f32<kKind>(vec_elem<kKind>(v[x], y))));
    }
    // every array index below is a compile-time constant after unrolling (registers, no local memory)
#pragma unroll
    for (int u = 0; u < kRegVecs; ++u) {
      if (u >= steps) break;  // warp-uniform
      uint32_t a = 0;
#pragma unroll
      for (int x = 0; x < kRegVecs; ++x)
        if (x / per_lane == u) a = umax32(a, m[x]);
      if constexpr (kFixed) {
#pragma unroll
        for (int o = kG >> 1; o > 0; o >>= 1) a = umax32(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
      } else {
        for (int o = g >> 1; o > 0; o >>= 1) a = umax32(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
      }
      const int64_t r = r0 + static_cast<int64_t>(u) * rpw + sub;
      const float s = scale_from_amax_bits(a);
      if (gl == 0 && r < rows) s_out[r] = it.valid ? s : 0.0f;
      const Recip rs = recip_of_scale(s);
#pragma unroll
      for (int x = 0; x < kRegVecs; ++x) {
        if (x / per_lane != u) continue;
        const int64_t k = gl + static_cast<int64_t>(x - u * per_lane) * g;
        if (r >= rows || !(kFull || k < nv)) continue;
        typename E::Codes out{};
        if (it.valid) {
          uint8_t* o8 = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
          for (int y = 0; y < E::kPerVec; y += 2) {
            const uint32_t c2 = e4m3x2_encode(quotient(load_as_f32<kKind>(vec_elem<kKind>(v[x], y)), rs),
                                              quotient(load_as_f32<kKind>(vec_elem<kKind>(v[x], y + 1)), rs));
            o8[y] = static_cast<uint8_t>(c2);
            o8[y + 1] = static_cast<uint8_t>(c2 >> 8);
          }
        }
        reinterpret_cast<typename E::Codes*>(q_out + r * D)[k] = out;
      }
    }
  }
}

// Block granularity with 16-byte vectors: the (token, vector) pairs of head h's tokens t0, t0 +
// tstep, ... spread over the warp's 32 lanes, the amax reduced across the warp once per head. Row by
// row (row_amax), a D = 128 bf16 row of 16 vectors left half the lanes idle and paid a 5-shuffle
// reduction per row: the CUDA per-block gather ran at 22-57 % of its bound on the H100
// (2026-11-23) against Triton's 73-91 %.
template <int kKind>
__device__ __forceinline__ uint32_t head_amax_vec(const QuantCopyParams& p, const uint8_t* cache, int64_t h,
                                                  int64_t t0, int64_t tstep, int lane) {
  using E = Elem<kKind>;
  const int64_t nv = p.head_dim / E::kPerVec;
  const int64_t ntok = t0 < p.block_size ? (p.block_size - t0 + tstep - 1) / tstep : 0;
  uint32_t m = 0;
  for (int64_t idx = lane; idx < ntok * nv; idx += 32) {
    const QR tk = divmod32(idx, nv);  // (token step, vector)
    const int64_t t = t0 + static_cast<int64_t>(tk.q) * tstep;
    const typename E::Vec v =
        load_ro(reinterpret_cast<const typename E::Vec*>(cache + t * p.stride_n + h * p.stride_h) + tk.r);
#pragma unroll
    for (int y = 0; y < E::kPerVec; ++y) m = umax32(m, abs_finite_bits(load_as_f32<kKind>(vec_elem<kKind>(v, y))));
  }
  return warp_max(m);
}

// The codes of the same pairs with the head's scale (valid = false: zero codes, nothing read);
// q_item: the item's codes (rows t * H + h of D codes each).
template <int kKind>
__device__ __forceinline__ void head_quantize_vec(const QuantCopyParams& p, const uint8_t* cache, uint8_t* q_item,
                                                  int64_t h, int64_t t0, int64_t tstep, Recip rs, bool valid,
                                                  int lane) {
  using E = Elem<kKind>;
  const int64_t D = p.head_dim;
  const int64_t nv = D / E::kPerVec;
  const int64_t ntok = t0 < p.block_size ? (p.block_size - t0 + tstep - 1) / tstep : 0;
  for (int64_t idx = lane; idx < ntok * nv; idx += 32) {
    const QR tk = divmod32(idx, nv);
    const int64_t t = t0 + static_cast<int64_t>(tk.q) * tstep;
    typename E::Codes out{};
    if (valid) {
      const typename E::Vec v =
          load_ro(reinterpret_cast<const typename E::Vec*>(cache + t * p.stride_n + h * p.stride_h) + tk.r);
      uint8_t* o8 = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
      for (int y = 0; y < E::kPerVec; y += 2) {
        const uint32_t c2 = e4m3x2_encode(quotient(load_as_f32<kKind>(vec_elem<kKind>(v, y)), rs),
                                          quotient(load_as_f32<kKind>(vec_elem<kKind>(v, y + 1)), rs));
        o8[y] = static_cast<uint8_t>(c2);
        o8[y + 1] = static_cast<uint8_t>(c2 >> 8);
      }
    }
    reinterpret_cast<typename E::Codes*>(q_item + (t * p.H + h) * D)[tk.r] = out;
  }
}

// Rows one warp iteration of quant_rows_token_vec covers for rows of kNV vectors (kRV per lane).
template <int kRV>
__host__ __device__ constexpr int64_t token_tile_rows(int nv) {
  return static_cast<int64_t>(32 / group_lanes(nv)) * (kRV / ((nv + group_lanes(nv) - 1) / group_lanes(nv)));
}

// Work items one CTA takes at once in the fixed-geometry token instances: an item of `rows` rows
// needs ceil(rows / tile) warp iterations; when that is fewer than half the CTA's warps, the
// warps split into groups (a power of two of them) that take one item each. 4 KB chunks (16 rows
// of 16 vectors: 4 tiles) left half of every CTA idle with one item per CTA (static SASS, sm_90,
// 2026-11-23). The host sizes the grid with the same function (capi.cu).
template <int kRV>
__host__ __device__ constexpr int token_items_per_cta(int nv, int64_t rows) {
  const int64_t tiles = (rows + token_tile_rows<kRV>(nv) - 1) / token_tile_rows<kRV>(nv);
  int ipc = 1;
  while (ipc < kWarps && tiles * (2 * ipc) <= kWarps) ipc *= 2;
  return ipc;
}

// The fixed-geometry token path (kNV > 0): token_items_per_cta items per CTA, each on its own group
// of warps (warp shuffles only: the groups never wait for each other).
template <int kKind, int kRV, int kNV>
__device__ __forceinline__ void quant_token_fixed_items(const QuantCopyParams& p, int warp, int lane) {
  static_assert((kWarps & (kWarps - 1)) == 0, "warp groups of a CTA must be whole: kWarps a power of two");
  static_assert(kRV == token_reg_vecs(kNV), "the register count capi.cu launches this row length with");
  // the geometry comes from kNV alone: a launch for another head_dim would write past its rows
  if (p.head_dim != static_cast<int64_t>(kNV) * Elem<kKind>::kPerVec) __trap();
  const int64_t rows = p.block_size * p.H;
  const int ipc = token_items_per_cta<kRV>(kNV, rows);
  const int wpi = kWarps / ipc;
  const int slot = warp / wpi, wwarp = warp - slot * wpi;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * ipc + slot; w < p.num_items;
       w += static_cast<int64_t>(gridDim.x) * ipc) {
    const Item it = item_coords(p, w, wwarp == 0 && lane == 0);
    const uint8_t* cache = cache_block(p, it);
    uint8_t* region = p.staging + it.j * p.region_bytes;
    uint8_t* q_out = region + it.c * p.q_entry_bytes + it.i * rows * p.head_dim;
    float* s_out = reinterpret_cast<float*>(region + p.scale_base_bytes + it.c * p.scale_entry_bytes);
    quant_rows_token_vec<kKind, kRV, kNV>(p, it, cache, q_out, s_out + it.i * rows, wwarp, lane, wpi);
  }
}

// FP8 gather. kPerBlock = false: token granularity; with 16-byte vectors and rows of at most 32 *
// kRegVecs vectors, quant_rows_token_vec; otherwise one warp per (token, head) row (warp-shuffle
// amax, scale, codes; the row re-read for the codes hits L1). kPerBlock = true: one warp per head
// of the block (kWarps / H warps per head when H < kWarps, through shared memory): amax over the
// block's tokens, then a second pass quantizes (the re-read hits L1/L2).
template <int kKind, bool kPerBlock, bool kVec, int kRV = kRegVecs, int kNV = 0>
__global__ void __launch_bounds__(kThreads) quant_gather_kernel(QuantCopyParams p) {
  // grid: (min(num_items, max_ctas),); block: kThreads threads = kWarps warps over the rows
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if constexpr (!kPerBlock && kVec && kNV > 0) {
    quant_token_fixed_items<kKind, kRV, kNV>(p, warp, lane);
    return;
  }
  const int64_t D = p.head_dim;
  const int64_t rows = p.block_size * p.H;
  for (int64_t w = blockIdx.x; w < p.num_items; w += gridDim.x) {
    const Item it = item_coords(p, w, threadIdx.x == 0);
    const uint8_t* cache = cache_block(p, it);
    uint8_t* region = p.staging + it.j * p.region_bytes;
    uint8_t* q_out = region + it.c * p.q_entry_bytes + it.i * rows * D;
    float* s_out = reinterpret_cast<float*>(region + p.scale_base_bytes + it.c * p.scale_entry_bytes);
    if (kPerBlock && p.H < kWarps) {
      // fewer heads than warps (MLA: one): kWarps / H warps share a head, each taking every
      // (kWarps / H)-th token, and their partial maxima meet in shared memory (one warp per head
      // left 7 of 8 warps idle for MLA). Warps past H * (kWarps / H) only pass the barriers.
      __shared__ uint32_t part[kWarps];
      const int wph = kWarps / static_cast<int>(p.H);
      const int64_t h = warp / wph;
      const int sub = warp - static_cast<int>(h) * wph;
      const bool mine = h < p.H;
      uint32_t amax = 0;
      if (mine && it.valid) {
        if constexpr (kVec) {
          amax = head_amax_vec<kKind>(p, cache, h, sub, wph, lane);
        } else {
          for (int64_t t = sub; t < p.block_size; t += wph) {
            const uint32_t a = row_amax<kKind, kVec>(cache + t * p.stride_n + h * p.stride_h, D, lane);
            amax = a > amax ? a : amax;
          }
        }
      }
      if (lane == 0) part[warp] = amax;
      __syncthreads();
      uint32_t m = 0;
      if (mine)
        for (int k = 0; k < wph; ++k) m = part[h * wph + k] > m ? part[h * wph + k] : m;
      __syncthreads();  // part[] is rewritten by the next work item
      if (mine) {
        const float s = scale_from_amax_bits(m);
        if (sub == 0 && lane == 0) s_out[it.i * p.H + h] = it.valid ? s : 0.0f;
        const Recip rs = recip_of_scale(s);
        if constexpr (kVec) {
          head_quantize_vec<kKind>(p, cache, q_out, h, sub, wph, rs, it.valid, lane);
        } else {
          for (int64_t t = sub; t < p.block_size; t += wph)
            quantize_row<kKind, kVec>(cache + t * p.stride_n + h * p.stride_h, q_out + (t * p.H + h) * D, D, rs,
                                      it.valid, lane);
        }
      }
    } else if (kPerBlock) {
      s_out += it.i * p.H;
      for (int64_t h = warp; h < p.H; h += kWarps) {
        uint32_t amax = 0;
        if (it.valid) {
          if constexpr (kVec) {
            amax = head_amax_vec<kKind>(p, cache, h, 0, 1, lane);
          } else {
            for (int64_t t = 0; t < p.block_size; ++t) {
              const uint32_t a = row_amax<kKind, kVec>(cache + t * p.stride_n + h * p.stride_h, D, lane);
              amax = a > amax ? a : amax;
            }
          }
        }
        const float s = scale_from_amax_bits(amax);
        if (lane == 0) s_out[h] = it.valid ? s : 0.0f;
        const Recip rs = recip_of_scale(s);
        if constexpr (kVec) {
          head_quantize_vec<kKind>(p, cache, q_out, h, 0, 1, rs, it.valid, lane);
        } else {
          for (int64_t t = 0; t < p.block_size; ++t)
            quantize_row<kKind, kVec>(cache + t * p.stride_n + h * p.stride_h, q_out + (t * p.H + h) * D, D, rs,
                                      it.valid, lane);
        }
      }
    } else if (kVec && D / Elem<kKind>::kPerVec <= 32 * kRV) {
      quant_rows_token_vec<kKind, kRV, kNV>(p, it, cache, q_out, s_out + it.i * rows, warp, lane);
    } else {
      s_out += it.i * rows;
      for (int64_t r = warp; r < rows; r += kWarps) {
        const int64_t t = r / p.H;
        const int64_t h = r - t * p.H;
        const uint8_t* row = cache + t * p.stride_n + h * p.stride_h;
        const uint32_t amax = it.valid ? row_amax<kKind, kVec>(row, D, lane) : 0u;
        const float s = scale_from_amax_bits(amax);
        if (lane == 0) s_out[r] = it.valid ? s : 0.0f;
        quantize_row<kKind, kVec>(row, q_out + r * D, D, recip_of_scale(s), it.valid, lane);
      }
    }
  }
}

// Code y of a vector's codes (8 codes in a uint2, 4 in a uint32_t), by shifts (registers).
__device__ __forceinline__ uint32_t code_at(const uint2& c, int y) { return ((y < 4 ? c.x : c.y) >> (8 * (y & 3))) & 0xFFu; }
__device__ __forceinline__ uint32_t code_at(uint32_t c, int y) { return (c >> (8 * y)) & 0xFFu; }

// FP8 scatter: threads over (row, vector) pairs of the chunk, kScatterUnroll pairs per thread loaded
// before any is converted (bytes in flight; v1 had one 8-byte load per thread in flight: 47-72 % of
// the copy peak on the H100 against Triton's 58-94 %); y = code * scale (fp32, IEEE), RNE into the
// cache kind; NaN codes -> the kind's canonical NaN. Padding / invalid ids: nothing written.
constexpr int kScatterUnroll = 2;

template <int kKind, bool kVec>
__global__ void __launch_bounds__(kThreads) dequant_scatter_kernel(QuantCopyParams p) {
  using E = Elem<kKind>;
  constexpr int kPer = kVec ? E::kPerVec : 1;
  constexpr int kU = kScatterUnroll;
  const int64_t D = p.head_dim;
  const int64_t rows = p.block_size * p.H;
  const int64_t per_row = D / kPer;
  const int64_t total = rows * per_row;
  const int64_t stride = static_cast<int64_t>(blockDim.x);
  // (row, vector) of pair k: a shift and a mask when the row's vector count is a power of two (every
  // common head dim), else a division; the row's offset without a division when rows are evenly
  // spaced (row_stride) and the scales are per row (per-block scales need the row's head)
  int shift = 0;
  while ((int64_t{1} << shift) < per_row) ++shift;
  const bool pow2 = (int64_t{1} << shift) == per_row;
  const int64_t rstride = p.per_block ? 0 : row_stride(p);
  for (int64_t w = blockIdx.x; w < p.num_items; w += gridDim.x) {
    const Item it = item_coords(p, w, threadIdx.x == 0);
    if (!it.valid) continue;
    uint8_t* cache = const_cast<uint8_t*>(cache_block(p, it));
    const uint8_t* region = p.staging + it.j * p.region_bytes;
    const uint8_t* q_in = region + it.c * p.q_entry_bytes + it.i * rows * D;
    const float* s_in = reinterpret_cast<const float*>(region + p.scale_base_bytes + it.c * p.scale_entry_bytes) +
                        it.i * (p.per_block ? p.H : rows);
    for (int64_t k0 = threadIdx.x; k0 < total; k0 += stride * kU) {
      typename E::Codes codes[kU];
      uint32_t one[kU];
      float sc[kU];
      int64_t dst_off[kU];  // the pair's byte offset in the cache block (index math once per pair)
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t k = k0 + u * stride;
        codes[u] = typename E::Codes{};
        one[u] = 0;
        sc[u] = 0.0f;
        dst_off[u] = 0;
        if (k < total) {
          const QR rx = pow2 ? QR{static_cast<uint32_t>(k >> shift), static_cast<uint32_t>(k & (per_row - 1))}
                             : divmod32(k, per_row);  // (row, vector in the row)
          const uint8_t* src = q_in + static_cast<int64_t>(rx.q) * D + static_cast<int64_t>(rx.r) * kPer;
          if (kVec) codes[u] = *reinterpret_cast<const typename E::Codes*>(src);
          else one[u] = *src;
          int64_t roff;
          if (rstride != 0) {
            roff = static_cast<int64_t>(rx.q) * rstride;
            sc[u] = s_in[rx.q];
          } else {
            const QR th = divmod32(rx.q, p.H);  // (token, head) of the row
            roff = static_cast<int64_t>(th.q) * p.stride_n + static_cast<int64_t>(th.r) * p.stride_h;
            sc[u] = s_in[p.per_block ? th.r : rx.q];
          }
          dst_off[u] = roff + static_cast<int64_t>(rx.r) * kPer * static_cast<int64_t>(sizeof(typename E::T));
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t k = k0 + u * stride;
        if (k >= total) continue;
        typename E::T* dst = reinterpret_cast<typename E::T*>(cache + dst_off[u]);
        if (kVec) {
          uint32_t wv[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            if (kKind == 2) {
              wv[q] = dequant_bits<kKind>(code_at(codes[u], q), sc[u]);
            } else {
              wv[q] = dequant_bits<kKind>(code_at(codes[u], 2 * q), sc[u]) |
                      (dequant_bits<kKind>(code_at(codes[u], 2 * q + 1), sc[u]) << 16);
            }
          }
          *reinterpret_cast<uint4*>(dst) = uint4{wv[0], wv[1], wv[2], wv[3]};
        } else {
          *dst = static_cast<typename E::T>(dequant_bits<kKind>(one[u], sc[u]));
        }
      }
    }
  }
}

// Byte-plane shuffle (16-bit caches): entry = high-byte plane (N bytes) | low-byte plane (N bytes),
// N = n * block_size * H * D, element k = ((i * block_size + t) * H + h) * D + d. kToStaging:
// gather (padding writes zeros to both planes), else scatter (padding skipped).
template <bool kToStaging, bool kVec>
__global__ void __launch_bounds__(kThreads) shuffle_copy_kernel(QuantCopyParams p) {
  constexpr int kPer = kVec ? 8 : 1;
  const int64_t D = p.head_dim;
  const int64_t rows = p.block_size * p.H;
  const int64_t per_row = D / kPer;
  const int64_t total = rows * per_row;
  const int64_t plane = p.n * rows * D;
  for (int64_t w = blockIdx.x; w < p.num_items; w += gridDim.x) {
    const Item it = item_coords(p, w, threadIdx.x == 0);
    if (!kToStaging && !it.valid) continue;
    uint8_t* cache = const_cast<uint8_t*>(cache_block(p, it));
    uint8_t* hi = p.staging + it.j * p.region_bytes + it.c * p.q_entry_bytes + it.i * rows * D;
    for (int64_t k = threadIdx.x; k < total; k += blockDim.x) {
      const QR rx = divmod32(k, per_row);  // (row, vector in the row)
      const QR th = divmod32(rx.q, p.H);   // (token, head) of the row
      const int64_t r = rx.q, x = rx.r;
      uint16_t* ce = reinterpret_cast<uint16_t*>(cache + static_cast<int64_t>(th.q) * p.stride_n +
                                                 static_cast<int64_t>(th.r) * p.stride_h) + x * kPer;
      uint8_t* hp = hi + r * D + x * kPer;
      uint8_t* lp = hp + plane;
      if (kVec) {
        if (kToStaging) {
          uint4 v{};
          if (it.valid) v = *reinterpret_cast<const uint4*>(ce);
          const uint16_t* e = reinterpret_cast<const uint16_t*>(&v);
          uint2 hv, lv;
          uint8_t* hb = reinterpret_cast<uint8_t*>(&hv);
          uint8_t* lb = reinterpret_cast<uint8_t*>(&lv);
#pragma unroll
          for (int y = 0; y < 8; ++y) {
            hb[y] = static_cast<uint8_t>(e[y] >> 8);
            lb[y] = static_cast<uint8_t>(e[y] & 0xFFu);
          }
          *reinterpret_cast<uint2*>(hp) = hv;
          *reinterpret_cast<uint2*>(lp) = lv;
        } else {
          const uint2 hv = *reinterpret_cast<const uint2*>(hp);
          const uint2 lv = *reinterpret_cast<const uint2*>(lp);
          const uint8_t* hb = reinterpret_cast<const uint8_t*>(&hv);
          const uint8_t* lb = reinterpret_cast<const uint8_t*>(&lv);
          uint4 v;
          uint16_t* e = reinterpret_cast<uint16_t*>(&v);
#pragma unroll
          for (int y = 0; y < 8; ++y) e[y] = static_cast<uint16_t>((static_cast<uint32_t>(hb[y]) << 8) | lb[y]);
          *reinterpret_cast<uint4*>(ce) = v;
        }
      } else if (kToStaging) {
        const uint16_t v = it.valid ? *ce : static_cast<uint16_t>(0);
        *hp = static_cast<uint8_t>(v >> 8);
        *lp = static_cast<uint8_t>(v & 0xFFu);
      } else {
        *ce = static_cast<uint16_t>((static_cast<uint32_t>(*hp) << 8) | *lp);
      }
    }
  }
}

}  // namespace kvk
