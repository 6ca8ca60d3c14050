#pragma once
// bfloat16 <-> float as torch does it: widening is exact (a 16-bit shift), narrowing rounds to nearest
// even and keeps NaN quiet. Rows are float or bf16 (raw bits) by a flag, the dtypes our kernels take.
// The 8-lane forms (AVX2, the baseline every build targets) give the same bits as the scalar ones.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace deepinfer {

inline float from_bf16(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// An element of an fp32 or a bf16 array, as fp32 (for kernels templated on the element type).
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return from_bf16(v); }

inline float round_to(float f, bool bf16) { return bf16 ? from_bf16(to_bf16(f)) : f; }

// to_bf16 of 8 lanes, left in the high halves of 32-bit lanes (the low halves zero): the rounded fp32 value.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256i quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x400000));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
}

inline __m256 round_to8(__m256 v, bool bf16) { return bf16 ? _mm256_castsi256_ps(bf16_bits8(v)) : v; }

// 8 values of p (float, or bf16 when bf16) from element i on, as fp32.
inline __m256 load8(const void* p, int64_t i, bool bf16) {
  if (!bf16) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline void store8(void* p, int64_t i, __m256 v, bool bf16) {
  if (!bf16) return _mm256_storeu_ps(static_cast<float*>(p) + i, v);
  const __m256i hi = _mm256_srli_epi32(bf16_bits8(v), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), _mm256_castsi256_si128(packed));
}

// n values of p (float, or bf16 when bf16) from element i on -> dst fp32.
inline void load_row(const void* p, int64_t i, int64_t n, bool bf16, float* dst) {
  if (!bf16) return (void)std::memcpy(dst, static_cast<const float*>(p) + i, n * sizeof(float));
  const uint16_t* src = static_cast<const uint16_t*>(p) + i;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, load8(src, k, true));
  for (; k < n; ++k) dst[k] = from_bf16(src[k]);
}

inline void store_row(void* p, int64_t i, int64_t n, bool bf16, const float* src) {
  if (!bf16) return (void)std::memcpy(static_cast<float*>(p) + i, src, n * sizeof(float));
  uint16_t* dst = static_cast<uint16_t*>(p) + i;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) store8(dst, k, _mm256_loadu_ps(src + k), true);
  for (; k < n; ++k) dst[k] = to_bf16(src[k]);
}

}  // namespace deepinfer
