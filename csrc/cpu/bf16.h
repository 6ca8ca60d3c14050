#pragma once
// bfloat16 <-> float as torch does it: widening is exact (a 16-bit shift), narrowing rounds to nearest
// even and keeps NaN quiet. Rows are float or bf16 (raw bits) by a flag, the dtypes our kernels take.
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

inline float round_to(float f, bool bf16) { return bf16 ? from_bf16(to_bf16(f)) : f; }

// n values of p (float, or bf16 when bf16) from element i on -> dst fp32.
inline void load_row(const void* p, int64_t i, int64_t n, bool bf16, float* dst) {
  if (!bf16) return (void)std::memcpy(dst, static_cast<const float*>(p) + i, n * sizeof(float));
  const uint16_t* src = static_cast<const uint16_t*>(p) + i;
  for (int64_t k = 0; k < n; ++k) dst[k] = from_bf16(src[k]);
}

inline void store_row(void* p, int64_t i, int64_t n, bool bf16, const float* src) {
  if (!bf16) return (void)std::memcpy(static_cast<float*>(p) + i, src, n * sizeof(float));
  uint16_t* dst = static_cast<uint16_t*>(p) + i;
  for (int64_t k = 0; k < n; ++k) dst[k] = to_bf16(src[k]);
}

}  // namespace deepinfer
