// Host-only wrappers around csrc/kernels/fp8.cuh, so the exact encode / decode / rounding code the
// kernels run (integer operations: same result on host and device) is checked on a GPU-less
// machine against torch (tests/test_csrc.py::test_fp8_host_*).
// Built with `nvcc -shared -Xcompiler -fPIC` (or g++ -x c++): no device code, no CUDA runtime call.
#include <cstdint>

#include "../kernels/fp8.cuh"

extern "C" {

void kvk_host_e4m3_encode(const float* x, uint8_t* out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) out[k] = kvk::e4m3_encode(x[k]);
}

void kvk_host_e4m3_decode(const uint8_t* q, float* out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) out[k] = kvk::e4m3_decode(q[k]);
}

// kind 0 bf16, 1 fp16: fp32 -> 16-bit bits, RNE (NaN -> 0x7FC0 / sign | 0x7E00; callers mask NaN)
void kvk_host_f32_to_16(const float* x, uint16_t* out, int64_t n, int kind) {
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t b = kvk::f32_bits(x[k]);
    out[k] = kind == 0 ? kvk::f32_to_bf16_bits(b) : kvk::f32_to_f16_bits(b);
  }
}

// The quantizing gather's per-row arithmetic (token granularity): x [rows, D] cache bits of
// `kind` (0 bf16, 1 fp16 as uint16; 2 fp32 as uint32) -> codes [rows, D], scales [rows].
// D <= 1024 (returns -1 otherwise, 0 when done).
int kvk_host_quantize_rows(const void* x, int kind, int64_t rows, int64_t D, uint8_t* q, float* s) {
  if (D > 1024) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    float v[1024];
    uint32_t amax = 0;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t k = r * D + d;
      if (kind == 0) v[d] = kvk::load_as_f32<0>(static_cast<const uint16_t*>(x)[k]);
      else if (kind == 1) v[d] = kvk::load_as_f32<1>(static_cast<const uint16_t*>(x)[k]);
      else v[d] = kvk::load_as_f32<2>(static_cast<const uint32_t*>(x)[k]);
      const uint32_t a = kvk::abs_finite_bits(v[d]);
      amax = a > amax ? a : amax;
    }
    s[r] = kvk::scale_from_amax_bits(amax);
    const kvk::Recip rs = kvk::recip_of_scale(s[r]);
    for (int64_t d = 0; d < D; ++d) q[r * D + d] = kvk::e4m3_encode(kvk::quotient(v[d], rs));
  }
  return 0;
}

// The dequantizing scatter's per-element arithmetic: codes [rows, D], scales [rows] -> cache bits.
void kvk_host_dequantize_rows(const uint8_t* q, const float* s, int kind, int64_t rows, int64_t D, void* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < D; ++d) {
      const int64_t k = r * D + d;
      if (kind == 0) static_cast<uint16_t*>(out)[k] = static_cast<uint16_t>(kvk::dequant_bits<0>(q[k], s[r]));
      else if (kind == 1) static_cast<uint16_t*>(out)[k] = static_cast<uint16_t>(kvk::dequant_bits<1>(q[k], s[r]));
      else static_cast<uint32_t*>(out)[k] = kvk::dequant_bits<2>(q[k], s[r]);
    }
  }
}

}  // extern "C"
