// Baseline for the benchmarks: one cudaMemcpyAsync per chunk, issued from a C++ loop on the
// caller's stream (what vLLM's swap_blocks does per block). Built on demand by
// bench/bench_gather.py with torch.utils.cpp_extension.load on a GPU machine; not part of the
// library. Every CUDA return code is checked.
#include <torch/extension.h>
#include <cuda_runtime_api.h>

#include <vector>

static void memcpy_chunks(torch::Tensor src_addrs, torch::Tensor dst_addrs, int64_t nbytes, int64_t stream) {
  TORCH_CHECK(src_addrs.device().is_cpu() && dst_addrs.device().is_cpu(), "address tables must be on the CPU");
  TORCH_CHECK(src_addrs.scalar_type() == torch::kInt64 && dst_addrs.scalar_type() == torch::kInt64, "int64 tables");
  TORCH_CHECK(src_addrs.numel() == dst_addrs.numel(), "tables differ in length");
  const int64_t* s = src_addrs.data_ptr<int64_t>();
  const int64_t* d = dst_addrs.data_ptr<int64_t>();
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < src_addrs.numel(); ++i) {
    cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(d[i]), reinterpret_cast<const void*>(s[i]),
                                      static_cast<size_t>(nbytes), cudaMemcpyDefault, st);
    TORCH_CHECK(err == cudaSuccess, "cudaMemcpyAsync failed: ", cudaGetErrorString(err));
  }
}

// Baseline: the same chunks as one cudaMemcpyBatchAsync (CUDA >= 12.8; the driver may merge and
// reorder the pieces). One attribute for all: sources read in stream order. It rejects the legacy
// default stream (field notes), so callers pass a side stream.
static void memcpy_batch(torch::Tensor src_addrs, torch::Tensor dst_addrs, int64_t nbytes, int64_t stream) {
  TORCH_CHECK(src_addrs.device().is_cpu() && dst_addrs.device().is_cpu(), "address tables must be on the CPU");
  TORCH_CHECK(src_addrs.scalar_type() == torch::kInt64 && dst_addrs.scalar_type() == torch::kInt64, "int64 tables");
  TORCH_CHECK(src_addrs.numel() == dst_addrs.numel(), "tables differ in length");
#if CUDART_VERSION >= 12080
  const size_t count = static_cast<size_t>(src_addrs.numel());
  if (count == 0) return;
  std::vector<void*> dsts(count);
  std::vector<const void*> srcs(count);
  std::vector<size_t> sizes(count, static_cast<size_t>(nbytes));
  const int64_t* s = src_addrs.data_ptr<int64_t>();
  const int64_t* d = dst_addrs.data_ptr<int64_t>();
  for (size_t i = 0; i < count; ++i) {
    dsts[i] = reinterpret_cast<void*>(d[i]);
    srcs[i] = reinterpret_cast<const void*>(s[i]);
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_idx = 0;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
#if CUDART_VERSION >= 13000
  cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), count, &attr, &attr_idx, 1, st);
#else
  size_t fail_idx = 0;
  cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(), count, &attr,
                                         &attr_idx, 1, &fail_idx, st);
#endif
  TORCH_CHECK(err == cudaSuccess, "cudaMemcpyBatchAsync failed: ", cudaGetErrorString(err));
#else
  TORCH_CHECK(false, "cudaMemcpyBatchAsync needs CUDA >= 12.8 (built with ", CUDART_VERSION, ")");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("memcpy_chunks", &memcpy_chunks);
  m.def("memcpy_batch", &memcpy_batch);
}
