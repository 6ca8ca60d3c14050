// Decode attention (attention_kernel.h) instantiated for AVX-512. Headers with non-template code are
// included above the target pragma; decode_attention.cpp calls this only on CPUs that have AVX-512.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/bf16.h"
#include "cpu/simd.h"

#pragma GCC push_options
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*, which -Wmaybe-uninitialized misreads.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#include "cpu/attention_kernel.h"
#include "cpu/vec_avx512.h"

namespace deepinfer {

void attend_heads_avx512(const float* q, int64_t kv_heads, int64_t group, const float* keys, const float* values,
                         const int64_t* rows, int64_t n, int64_t D, float scale, const float* sinks, float* p,
                         float* out) {
  attn::attend_heads<Avx512>(q, kv_heads, group, keys, values, rows, n, D, scale, sinks, p, out);
}

void attend_heads_avx512(const float* q, int64_t kv_heads, int64_t group, const uint16_t* keys, const uint16_t* values,
                         const int64_t* rows, int64_t n, int64_t D, float scale, const float* sinks, float* p,
                         float* out) {
  attn::attend_heads<Avx512>(q, kv_heads, group, keys, values, rows, n, D, scale, sinks, p, out);
}

}  // namespace deepinfer
#pragma GCC pop_options
