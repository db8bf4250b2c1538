// SM90 bulk-copy gather / scatter for layouts whose (block, entry) chunk is one contiguous run of
// bytes in the cache (NHD, any layout with one KV head, MLA): the chunk moves global -> shared ->
// global with `cp.async.bulk` (the copy engine of the SM, no per-thread loads), completion of each
// load on an mbarrier, stores in bulk async-groups. One thread per CTA issues everything, so a CTA
// costs one warp of registers and S * piece bytes of shared memory; the bandwidth per CTA comes from
// the bytes in flight (S / 2 pieces loading and S / 2 storing), not from threads.
//
// Same work items, id rules and persistent grid as paged_copy_kernel (csrc/kernels/paged_copy.cuh):
// item w = (region j, entry c, slot i), numbered (j * C + c) * n + i; each item is split into
// `pieces` units of at most `piece` bytes; CTA b handles units b, b + grid, b + 2 * grid, ...
// Ids outside [0, num_blocks) are padding: gather writes zeros (plain 16-byte stores), scatter skips;
// ids other than -1 among them are counted in *err once per slot.
//
// The bulk operations come from CuTe / CUTLASS (cute::SM90_BULK_COPY_G2S / _S2G, cute::tma_store_*,
// cutlass::arch::ClusterTransactionBarrier); they exist when the library is built with the CUTLASS
// headers (KVK_HAVE_CUTE, csrc/build.py) and compiled for sm_90 / sm_90a. Elsewhere the kernel body
// is empty and kvk_features() says the path is absent, so the host never launches it.
// KVK_EMULATE (csrc/tests/kernels_host.cpp) replaces the bulk operations with memcpy to check the
// indexing on the CPU.
#pragma once
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>

#include "paged_copy.cuh"

#if defined(KVK_HAVE_CUTE) && !defined(KVK_EMULATE)
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#endif

#if defined(KVK_EMULATE) || (defined(KVK_HAVE_CUTE) && defined(CUTE_ARCH_TMA_SM90_ENABLED))
#define KVK_BULK_BODY 1
#else
#define KVK_BULK_BODY 0
#endif
// CuTe enables its SM90 bulk copies for sm_90 / sm_90a (and the `a` / `f` targets of later GPUs),
// not for a plain sm_100 / sm_120 target: compiling one of those with CUTLASS would give an empty
// kernel that kvk_features() still advertises. Refuse instead (csrc/build.py embeds compute_90
// PTX, which later GPUs JIT with the body).
#if defined(KVK_HAVE_CUTE) && !defined(KVK_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && \
    !KVK_BULK_BODY
#error "bulk_copy.cuh: this target has no CuTe SM90 bulk copies; build sm_90 / sm_90a (build.py ARCHS)"
#endif

namespace kvk {

constexpr int kBulkThreads = 32;          // one warp; thread 0 issues the copies
constexpr int64_t kBulkPiece = 16384;     // largest unit (bytes); a multiple of 16, < 2^20 (mbarrier tx)
constexpr int64_t kBulkSmem = 65536;      // stages * piece <= this (dynamic shared memory per CTA)

namespace bulk {
#if defined(KVK_EMULATE)
// CPU stand-ins: each operation completes at once.
inline void init(uint64_t* bar) { *bar = 0; }
inline void fence_init() {}
inline void load(uint64_t*, void* smem, const void* gmem, int bytes) { std::memcpy(smem, gmem, bytes); }
inline void wait(uint64_t*, uint32_t) {}
inline void store(void* gmem, const void* smem, int bytes) { std::memcpy(gmem, smem, bytes); }
inline void commit() {}
template <int N>
inline void wait_read() {}
inline void wait_all() {}
#elif KVK_BULK_BODY
__device__ __forceinline__ void init(uint64_t* bar) { cutlass::arch::ClusterTransactionBarrier::init(bar, 1); }
// the barriers' initialisation visible to the async proxy that completes their transactions
__device__ __forceinline__ void fence_init() {
  cutlass::arch::fence_barrier_init();
  cutlass::arch::fence_view_async_shared();
}
// arrive (the one arrival the barrier expects) with `bytes` of transactions, then the bulk load
// that completes them
__device__ __forceinline__ void load(uint64_t* bar, void* smem, const void* gmem, int bytes) {
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, static_cast<uint32_t>(bytes));
  cute::SM90_BULK_COPY_G2S::copy(gmem, bar, smem, bytes);
}
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t phase) {
  cutlass::arch::ClusterTransactionBarrier::wait(bar, phase);
}
__device__ __forceinline__ void store(void* gmem, const void* smem, int bytes) {
  cute::SM90_BULK_COPY_S2G::copy(smem, gmem, bytes);
}
__device__ __forceinline__ void commit() { cute::tma_store_arrive(); }
// at most N committed store groups may still be reading shared memory
template <int N>
__device__ __forceinline__ void wait_read() {
  cute::tma_store_wait<N>();
}
// every store group complete (written, not only read) before the CTA exits
__device__ __forceinline__ void wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
#endif
}  // namespace bulk

// How a chunk of `chunk` bytes is cut (host side: capi.cu and the CPU emulation share it): pieces of
// equal size, a multiple of 16 and at most kBulkPiece; stages: 4, 8 or 16 so that
// stages * piece <= kBulkSmem.
struct BulkPlan {
  int64_t piece, pieces;
  int stages;
};

inline BulkPlan bulk_plan(int64_t chunk) {
  const int64_t n = (chunk + kBulkPiece - 1) / kBulkPiece;
  const int64_t piece = ((chunk + n - 1) / n + 15) / 16 * 16;
  const int stages = piece > kBulkSmem / 8 ? 4 : piece > kBulkSmem / 16 ? 8 : 16;
  return BulkPlan{piece, (chunk + piece - 1) / piece, stages};  // the kernel's own unit count
}

// One unit of the copy: where it comes from and goes to. kind 0: skip (scatter of padding),
// 1: bulk copy, 2: zero fill of dst (gather of padding).
struct BulkUnit {
  const uint8_t* src;
  uint8_t* dst;
  int bytes;
  int kind;
};

template <bool kToStaging>
__device__ __forceinline__ BulkUnit bulk_unit(const PagedCopyParams& p, int64_t u, int64_t pieces, int64_t piece,
                                              int64_t chunk, bool count) {
  const int64_t w = u / pieces;
  const int64_t off = (u - w * pieces) * piece;
  const PagedItem it = paged_item(p, w);
  const bool valid = it.valid;
  // counted once per slot: first piece of the first n work items (layer region 0, entry 0)
  if (count && !valid && it.bid != -1 && w < p.n && off == 0) atomicAdd(p.err, 1);
  uint8_t* cache = reinterpret_cast<uint8_t*>(p.ptr_tab[it.j * p.C + it.c]) + (valid ? it.bid : 0) * p.stride_b + off;
  uint8_t* stage = p.staging + it.j * p.region_bytes + it.c * p.entry_bytes + it.i * chunk + off;
  const int bytes = static_cast<int>(chunk - off < piece ? chunk - off : piece);
  if (kToStaging) return BulkUnit{cache, stage, bytes, valid ? 1 : 2};
  return BulkUnit{stage, cache, bytes, valid ? 1 : 0};
}

// S stages of `piece` bytes (dynamic shared memory S * piece). Loads run L = S / 2 units ahead of
// the stores; a stage is reloaded only when the store that read it has finished reading.
template <int S, bool kToStaging>
__global__ void __launch_bounds__(kBulkThreads) bulk_copy_kernel(PagedCopyParams p, int64_t piece) {
#if KVK_BULK_BODY
  constexpr int L = S / 2;
  if (threadIdx.x != 0) return;
#if defined(KVK_EMULATE)
  alignas(128) static thread_local uint8_t smem[kBulkSmem];
  static thread_local uint64_t bars[S];
  static thread_local BulkUnit staged[S];
#else
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[S];
  __shared__ BulkUnit staged[S];  // each stage's unit, decoded once when its load is issued
#endif
  for (int s = 0; s < S; ++s) bulk::init(&bars[s]);
  bulk::fence_init();
  const int64_t chunk = p.rows * p.row_bytes;
  const int64_t pieces = (chunk + piece - 1) / piece;
  const int64_t units = p.num_items * pieces;
  const int64_t first = blockIdx.x, step = gridDim.x;
  uint32_t phase = 0;  // bit s: parity of stage s's next completion
  // decode unit k (once: ids, pointer table, index divisions) into its stage's slot of staged[];
  // the previous unit of that stage was consumed S - L iterations ago
  auto decode = [&](int64_t k) {
    const int64_t u = first + k * step;
    staged[k % S] = u < units ? bulk_unit<kToStaging>(p, u, pieces, piece, chunk, true) : BulkUnit{nullptr, nullptr, 0, 0};
  };
  auto issue_load = [&](int64_t k) {
    const BulkUnit& x = staged[k % S];
    if (x.kind == 1) bulk::load(&bars[k % S], smem + (k % S) * piece, x.src, x.bytes);
  };
  for (int64_t k = 0; k < L; ++k) {
    decode(k);
    issue_load(k);
  }
  for (int64_t k = 0; first + k * step < units; ++k) {
    const int s = static_cast<int>(k % S);
    const BulkUnit x = staged[s];  // written by issue_load(k); the next write is issue_load(k + S)
    if (x.kind == 1) {
      bulk::wait(&bars[s], (phase >> s) & 1u);
      phase ^= 1u << s;
      bulk::store(x.dst, smem + s * piece, x.bytes);
    } else if (x.kind == 2) {
      uint4* d = reinterpret_cast<uint4*>(x.dst);
      for (int q = 0; q < x.bytes / 16; ++q) d[q] = uint4{0, 0, 0, 0};
    }
    bulk::commit();  // one group per unit (empty for padding), so the count below holds
    decode(k + L);   // its latency overlaps the stores still reading
    // unit k + L reuses the stage of unit k + L - S, whose store is S - L groups back
    bulk::wait_read<S - L>();
    issue_load(k + L);
  }
  bulk::wait_all();
#else
  (void)p;
  (void)piece;
#endif
}

}  // namespace kvk
