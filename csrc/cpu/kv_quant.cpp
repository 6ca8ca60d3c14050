#include "kv_quant.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "thread_pool.h"

namespace deepinfer {
namespace {

constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr float kE4M3Max = 448.0f;

// E4M3 (float8_e4m3fn) bit pattern -> its value: bias 7, subnormals m * 2^-9, 0x7f / 0xff NaN, no infinity.
std::array<float, 256> e4m3_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    if (e == 15 && m == 7) v = NAN;
    t[b] = (b & 0x80) ? -v : v;
  }
  return t;
}

const std::array<float, 256>& e4m3() {
  static const std::array<float, 256> table = e4m3_table();
  return table;
}

// |v| <= 448 -> E4M3 byte, round to nearest even (torch's cast): below 2^-6 on the subnormal grid of 2^-9,
// above by rounding the fp32 mantissa to 3 bits (a carry moves into the exponent, as it should).
uint8_t to_e4m3(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a < 0.015625f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  uint32_t bits;
  std::memcpy(&bits, &a, 4);
  bits += 0x7FFFFu + ((bits >> 20) & 1u);
  return sign | static_cast<uint8_t>((bits >> 20) - ((127u - 7u) << 3));
}

// E2M1 code of v already divided by its scale (fp4.e2m1_encode: each threshold a midpoint, ties to even).
uint8_t to_e2m1(float v) {
  const float a = std::fabs(v);
  const uint8_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return code | ((v < 0 && code > 0) ? 8 : 0);
}

int64_t group_of(KvFormat fmt, int64_t D) { return fmt == KvFormat::FP8 ? D : fmt == KvFormat::NVFP4 ? 16 : 32; }

void dequantize_row(const uint8_t* data, const void* scales, int64_t r, int64_t D, KvFormat fmt, float ts, float* row) {
  if (fmt == KvFormat::FP8) {
    const uint8_t* q = data + r * D;
    const float s = static_cast<const float*>(scales)[r];
    for (int64_t j = 0; j < D; ++j) row[j] = e4m3()[q[j]] * s;
    return;
  }
  const int64_t group = group_of(fmt, D);
  const uint8_t* packed = data + r * (D / 2);
  const uint8_t* sc = static_cast<const uint8_t*>(scales) + r * (D / group);
  for (int64_t g = 0; g < D / group; ++g) {
    const float s = fmt == KvFormat::NVFP4 ? e4m3()[sc[g]] * ts : std::ldexp(1.0f, static_cast<int>(sc[g]) - 127);
    for (int64_t j = g * group; j < (g + 1) * group; j += 2) {
      row[j] = kE2M1[packed[j / 2] & 15] * s;
      row[j + 1] = kE2M1[packed[j / 2] >> 4] * s;
    }
  }
}

float amax_of(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, std::fabs(x[j]));
  return m;
}

void quantize_row(const float* x, int64_t r, int64_t D, KvFormat fmt, float ts, uint8_t* data, void* scales) {
  if (fmt == KvFormat::FP8) {
    const float s = amax_of(x, D) / kE4M3Max;
    static_cast<float*>(scales)[r] = s;
    for (int64_t j = 0; j < D; ++j) data[r * D + j] = s > 0 ? to_e4m3(x[j] / s) : 0;
    return;
  }
  const int64_t group = group_of(fmt, D);
  uint8_t* packed = data + r * (D / 2);
  uint8_t* sc = static_cast<uint8_t*>(scales) + r * (D / group);
  for (int64_t g = 0; g < D / group; ++g) {
    const float* xb = x + g * group;
    const float amax = amax_of(xb, group);
    float mul = 1.0f, div = 0.0f;  // v = xb * mul (MXFP4, exact) or xb / div (NVFP4)
    if (fmt == KvFormat::NVFP4) {
      sc[g] = to_e4m3(std::min(amax / 6.0f / ts, kE4M3Max));
      div = e4m3()[sc[g]] * ts;
    } else {
      int E = 0;
      std::frexp(amax, &E);
      const int e = amax > 0 ? std::clamp(E - 1 - 2, -127, 127) : -127;
      sc[g] = static_cast<uint8_t>(e + 127);
      mul = std::ldexp(1.0f, -e);
    }
    for (int64_t j = 0; j < group; j += 2) {
      const float v0 = fmt == KvFormat::NVFP4 ? (div > 0 ? xb[j] / div : 0.0f) : xb[j] * mul;
      const float v1 = fmt == KvFormat::NVFP4 ? (div > 0 ? xb[j + 1] / div : 0.0f) : xb[j + 1] * mul;
      packed[(g * group + j) / 2] = to_e2m1(v0) | (to_e2m1(v1) << 4);
    }
  }
}

}  // namespace

void kv_load_rows(const uint8_t* data, const void* scales, const int64_t* rows, int64_t n, int64_t D, KvFormat fmt,
                  float tensor_scale, void* out, bool out_bf16, int num_threads) {
  parallel_ranges(n, threads_for(n * D, num_threads), [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(D);
    for (int64_t i = lo; i < hi; ++i) {
      if (rows[i] < 0) {
        std::fill(buf.begin(), buf.end(), 0.0f);
      } else {
        dequantize_row(data, scales, rows[i], D, fmt, tensor_scale, buf.data());
      }
      store_row(out, i * D, D, out_bf16, buf.data());
    }
  });
}

bool kv_store_rows(const void* x, bool x_bf16, const int64_t* rows, int64_t n, int64_t D, KvFormat fmt,
                   float tensor_scale, uint8_t* data, void* scales, int num_threads) {
  std::vector<float> buf(D);
  for (int64_t i = 0; i < n; ++i) {  // refuse before writing anything
    load_row(x, i * D, D, x_bf16, buf.data());
    for (float v : buf) {
      if (!std::isfinite(v)) return false;
    }
  }
  parallel_ranges(n, threads_for(n * D, num_threads), [&](int64_t lo, int64_t hi) {
    std::vector<float> row(D);
    for (int64_t i = lo; i < hi; ++i) {
      load_row(x, i * D, D, x_bf16, row.data());
      quantize_row(row.data(), rows[i], D, fmt, tensor_scale, data, scales);
    }
  });
  return true;
}

}  // namespace deepinfer
