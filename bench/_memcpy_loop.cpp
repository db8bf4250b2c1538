// Baseline for the benchmarks: one cudaMemcpyAsync per chunk, issued from a C++ loop on the
// caller's stream (what vLLM's swap_blocks does per block). Built on demand by
// bench/bench_gather.py with torch.utils.cpp_extension.load on a GPU machine; not part of the
// library. Every CUDA return code is checked.
#include <torch/extension.h>
#include <cuda_runtime_api.h>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("memcpy_chunks", &memcpy_chunks); }
