// exp(x) for x ≤ 88 by one polynomial, the same operations one lane at a time (portable) and sixteen at once
// (AVX512), so both give the same bits: e = 2^k · p(x − k·ln 2) with ln 2 in two parts, k = nearest(x·log2 e),
// p a degree-6 Horner polynomial; 0 for x < −88. RaggedAttention's softmax and MatMulW4A8's swiglu use it.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace dspark_cpu {

constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[7] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 0.5f, 1.f,
                               1.f};

inline float exp_poly(float x) {
  if (x < -88.f) return 0.f;
  const float k = std::nearbyint(x * kLog2e);
  const float r = std::fma(k, -kLn2Lo, std::fma(k, -kLn2Hi, x));
  float y = kExpPoly[0];
  for (int i = 1; i < 7; ++i) y = std::fma(y, r, kExpPoly[i]);
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx512f"))) inline __m512 exp_poly16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.f), _CMP_GE_OQ);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(-kLn2Lo), _mm512_fmadd_ps(k, _mm512_set1_ps(-kLn2Hi), x));
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(bits));
}
#endif

}  // namespace dspark_cpu
