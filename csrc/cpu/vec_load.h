#pragma once
// fp32 or bf16 elements loaded as a vector of the traits V (vec.h, vec_avx512.h): fp32 as it is, bf16 widened (or,
// for the bf16 dot-product ISA, kept as its vector of bf16 pairs); to_float (bf16.h) is the scalar form. For the
// kernel headers templated on the element type, which include this below each ISA's target pragma: defined above
// it (in bf16.h), GCC compiled these for the baseline and called the AVX-512 loads out of line.
#include <cstdint>

namespace deepinfer {

template <class V>
auto load_elems(const float* p) {
  return V::load(p);
}

template <class V>
auto load_elems(const uint16_t* p) {
  return V::load_bf16(p);
}

}  // namespace deepinfer
