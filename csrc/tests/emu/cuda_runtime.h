// Stand-in for <cuda_runtime.h> when csrc/tests/kernels_host.cpp compiles the kernels of
// csrc/kernels/quant_copy.cuh as plain C++ (g++): one std::thread per CUDA thread, warp shuffles
// through a per-warp barrier. Only what quant_copy.cuh uses. NOT a CUDA model beyond that: it checks
// indexing, id rules, padding and the vector / scalar paths on the CPU, not memory ordering,
// coalescing or anything about real hardware.
#pragma once
#include <cstdint>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct kvk_emu_dim {
  unsigned x;
};

extern thread_local kvk_emu_dim threadIdx;
extern thread_local kvk_emu_dim blockIdx;
extern kvk_emu_dim gridDim;
extern kvk_emu_dim blockDim;

unsigned __shfl_xor_sync(unsigned mask, unsigned v, int lane_mask);
int atomicAdd(int* p, int v);
[[noreturn]] void __trap();
// block-wide barrier of all kThreads threads; shared memory is one static instance per kernel
// instantiation (the threads run the blocks in order, kept in step by __syncthreads: a kernel
// must sync before it reuses shared memory for the next work item, as on a GPU)
void __syncthreads();
#define __shared__ static
