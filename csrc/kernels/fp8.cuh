// FP8 (e4m3fn) encode / decode and the fp32 -> bf16 / fp16 roundings of docs/quant.md, as
// __host__ __device__ functions on the fp32 bits (integer operations only, except the exact
// k * 2^-9 decode of subnormal codes and the two IEEE fp32 operations x / s and code * s).
// Integer arithmetic behaves identically on the host and the device, so the host test
// (csrc/tests/fp8_host.cu, tests/test_csrc.py) checks the very code the kernels run.
//
// The bytes must equal torch's `(x / s).clamp(-448, 448).to(torch.float8_e4m3fn)` and the Triton
// kernels (triton_ops/quant_gather.py `_e4m3_code`, dequant_scatter.py `_e4m3_decode`).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVK_HD __host__ __device__ __forceinline__
#else
#define KVK_HD inline
#endif

namespace kvk {

KVK_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
#endif
}

KVK_HD float bits_f32(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
#endif
}

// RNE of m * 2^-shift for 0 <= m < 2^24, shift >= 1 (0 when the value is below one half).
KVK_HD uint32_t rne_shift(uint32_t m, uint32_t shift) {
  if (shift >= 25) return 0;  // m / 2^25 < 1/2
  return (m + (1u << (shift - 1)) - 1u + ((m >> shift) & 1u)) >> shift;
}

// fp32 bits -> e4m3fn code: saturating round-to-nearest-even (|y| >= 448 and inf -> +-448 = 0x7E /
// 0xFE), signed zero kept, subnormals exact; every NaN -> 0x7F (docs/quant.md).
KVK_HD uint32_t e4m3_encode_bits(uint32_t b) {
  const uint32_t sign = (b >> 24) & 0x80u;
  uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7Fu;
  if (a > 0x43E00000u) a = 0x43E00000u;  // 448.0 (inf saturates)
  uint32_t code;
  if (a >= 0x3C800000u) {  // |y| >= 2^-6: normal e4m3, RNE on the 20 dropped mantissa bits
    code = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960u;
  } else {  // the grid is k * 2^-9: k = RNE(|y| * 2^9), |y| = m * 2^(e - 150)
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7FFFFFu) | (e ? 0x800000u : 0u);
    code = rne_shift(m, 141u - (e ? e : 1u));  // e <= 120 here: shift >= 21
  }
  return code | sign;
}

KVK_HD uint8_t e4m3_encode(float y) { return static_cast<uint8_t>(e4m3_encode_bits(f32_bits(y))); }

// e4m3 codes of two fp32 values (lo in bits 0-7, hi in bits 8-15). On sm_89+ one conversion
// instruction for both (cvt.rn.satfinite.e4m3x2.f32: round to nearest even, finite values and
// infinities saturate to +-448, as e4m3_encode; a NaN made 0x7F here as there). Elsewhere (sm_80,
// the host) e4m3_encode. The integer encode is ~15 operations per element: the H100's FP8 gather
// spent its time there (22-36 % of the copy bound on 2026-11-23, where Triton's gather with the
// conversion instruction reached 73-91 %).
KVK_HD uint32_t e4m3x2_encode(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  uint32_t c = r;
  if (lo != lo) c = (c & 0xFF00u) | 0x7Fu;
  if (hi != hi) c = (c & 0x00FFu) | 0x7F00u;
  return c;
#else
  return static_cast<uint32_t>(e4m3_encode(lo)) | (static_cast<uint32_t>(e4m3_encode(hi)) << 8);
#endif
}

// e4m3fn code -> fp32 (exact). 0x7F / 0xFF (NaN) decode to +-480 here: callers test
// e4m3_is_nan and write their canonical NaN.
KVK_HD float e4m3_decode(uint32_t q) {
  const uint32_t mag = q & 0x7Fu;
  const uint32_t sign = (q & 0x80u) << 24;
  if (mag < 8u) return bits_f32(f32_bits(static_cast<float>(mag) * 0.001953125f) | sign);  // k * 2^-9
  return bits_f32(((mag << 20) + (120u << 23)) | sign);  // exponent bias 7 -> 127
}

KVK_HD bool e4m3_is_nan(uint32_t q) { return (q & 0x7Fu) == 0x7Fu; }

// fp32 -> bf16 bits, RNE (overflow -> inf). NaN is the caller's business.
KVK_HD uint16_t f32_to_bf16_bits(uint32_t b) {
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// fp32 -> fp16 bits, RNE with fp16 subnormals and overflow to inf. NaN is the caller's business.
KVK_HD uint16_t f32_to_f16_bits(uint32_t b) {
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                                                // >= 2^-14: normal fp16
    const uint32_t r = (a + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    return static_cast<uint16_t>(sign | (r - (112u << 10)));
  }
  const uint32_t e = a >> 23;  // fp16 subnormal grid k * 2^-24: k = RNE(m * 2^(e - 126))
  const uint32_t m = (a & 0x7FFFFFu) | (e ? 0x800000u : 0u);
  return static_cast<uint16_t>(sign | rne_shift(m, 126u - (e ? e : 1u)));  // e <= 112: shift >= 14
}

// fp16 bits -> fp32 (exact).
KVK_HD float f16_to_f32(uint32_t h) {
#if defined(__CUDA_ARCH__)
  float f;  // cvt.f32.f16 is exact for every input (the software path below is the host's)
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(h)));
  return f;
#else  // (not a fall-through after the return: older front-ends warn "statement is unreachable")
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu) return bits_f32(sign | 0x7F800000u | (m << 13));
  if (e != 0u) return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
  return bits_f32(f32_bits(static_cast<float>(m) * 5.9604644775390625e-8f) | sign);  // m * 2^-24, exact
#endif
}

// |x| bits with non-finite values as 0: the amax of docs/quant.md is the integer max of these
// (for non-negative floats the bit order is the value order; no float min/max, no FTZ questions).
KVK_HD uint32_t abs_finite_bits(float x) {
  const uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
  return a < 0x7F800000u ? a : 0u;
}

// IEEE fp32 division / multiplication (never the approximate device division, never contracted).
KVK_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

KVK_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

KVK_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);  // correctly rounded (one rounding), as the device instruction
#endif
}

// x / s correctly rounded (the format's quotient, docs/quant.md) without a division per element:
// one IEEE reciprocal per row / tile, then per element a multiply and two FMAs (Markstein's
// correction: with r = RN(1/s) and q0 = RN(x * r) within one ulp of x/s, the residual
// e = x - q0 * s is exact in an FMA and RN(q0 + e * r) = RN(x / s), barring underflow). Scales
// below 2^-64 are pre-scaled with x by 2^64 (exact; the quotient is the same real number) so that r
// stays finite and no step underflows wherever the quotient can reach a nonzero e4m3 code
// (|x/s| >= 2^-11; below, x or e may be subnormal and the fp32 quotient off by an ulp, but the code
// is +-0 either way, sign included). e == 0 (exact quotients, +-0) and non-finite q0 (x = +-inf,
// NaN) keep q0. Per-element div.rn.f32 ran the H100's FP8 gather at 22-30 % of its bound.
struct Recip {
  float f, sf, r;  // pre-scale (1 or 2^64), s * f, RN(1 / (s * f))
};

KVK_HD Recip recip_of_scale(float s) {
  const float f = s < bits_f32(0x1F800000u) ? bits_f32(0x5F800000u) : 1.0f;  // s < 2^-64: f = 2^64
  const float sf = mul_rn(s, f);
  return Recip{f, sf, div_rn(1.0f, sf)};
}

KVK_HD float quotient(float x, Recip q) {
  const float xs = mul_rn(x, q.f);
  const float q0 = mul_rn(xs, q.r);
  const float e = fma_rn(-q0, q.sf, xs);
  return (e != 0.0f && (f32_bits(q0) & 0x7FFFFFFFu) < 0x7F800000u) ? fma_rn(e, q.r, q0) : q0;
}

// amax / 448 (IEEE), 1.0 where that is 0 (the zero rule).
KVK_HD float scale_from_amax_bits(uint32_t amax_bits) {
  const float s = div_rn(bits_f32(amax_bits), 448.0f);
  return s > 0.0f ? s : 1.0f;
}

// Cache element kinds: 0 bf16, 1 fp16, 2 fp32.
template <int kKind>
KVK_HD float load_as_f32(uint32_t v) {
  if (kKind == 0) return bits_f32(v << 16);
  if (kKind == 1) return f16_to_f32(v);
  return bits_f32(v);
}

// code * scale rounded (RNE) into the cache kind's bits; a NaN code or product -> canonical NaN
// (0x7FC0 bf16, 0x7E00 fp16, 0x7FC00000 fp32).
template <int kKind>
KVK_HD uint32_t dequant_bits(uint32_t q, float s) {
  const float y = mul_rn(e4m3_decode(q), s);
  const uint32_t yb = f32_bits(y);
  const bool nan = e4m3_is_nan(q) || (yb & 0x7FFFFFFFu) > 0x7F800000u;
  if (kKind == 0) return nan ? 0x7FC0u : f32_to_bf16_bits(yb);
  if (kKind == 1) return nan ? 0x7E00u : f32_to_f16_bits(yb);
  return nan ? 0x7FC00000u : yb;
}

}  // namespace kvk
