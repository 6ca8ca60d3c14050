#include "cpu/sampling.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/thread_pool.h"

namespace deepinfer {
namespace {

// First index of the row's maximum, or -1 when any value is NaN or inf. Eight lanes each keep their
// first maximum (strict >), then the lowest index among the lanes that hold the overall maximum.
int64_t row_argmax(const float* row, int64_t V) {
  __m256 best = _mm256_set1_ps(-INFINITY), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  __m256i arg = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  const int64_t vector_end = V <= INT32_MAX ? V / 8 * 8 : 0;  // lane indices are 32-bit
  int64_t v = 0;
  for (; v < vector_end; v += 8, idx = _mm256_add_epi32(idx, step)) {
    const __m256 x = _mm256_loadu_ps(row + v);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_EQ_OQ));
    const __m256 better = _mm256_cmp_ps(x, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, x, better);
    arg = _mm256_blendv_epi8(arg, idx, _mm256_castps_si256(better));
  }
  if (_mm256_movemask_ps(finite) != 0xff) return -1;
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_arg[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_arg), arg);
  float top = -INFINITY;  // lanes that saw no value hold -inf and are passed over
  int64_t at = 0;
  for (int l = 0; l < 8; ++l)
    if (lane_best[l] > top || (lane_best[l] == top && lane_arg[l] < at)) {
      top = lane_best[l];
      at = lane_arg[l];
    }
  for (; v < V; ++v) {
    if (!std::isfinite(row[v])) return -1;
    if (row[v] > top) {
      top = row[v];
      at = v;
    }
  }
  return at;
}

uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// The float's bits as an integer with the floats' order (-0 just below +0).
int32_t ordered_key(float z) {
  int32_t b;
  std::memcpy(&b, &z, sizeof b);
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}

// g = -log(-log(u)) of the hashed uniform u of (row hash, token), as gumbel_ref computes it in fp32.
float gumbel(uint32_t row, int64_t token) {
  const uint32_t h = mix32(row ^ mix32(static_cast<uint32_t>(token)));
  const float u = (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -std::log(-std::log(u));
}

// No uniform exceeds 1 - 2^-24, so no g exceeds -log(-log(1 - 2^-24)) = 16.64: a token whose z is this far below
// the best score so far cannot win, and its two logs are skipped.
constexpr float kGumbelMax = 17.0f;

struct SampleParams {
  float temperature, top_p, min_p;
  int64_t top_k;
  uint32_t row_hash;
};

// The largest key t with cumulative mass (in descending key order) reaching target, among kept tokens; the
// smallest kept key when rounding leaves the total short (keep all), as _top_p_key does.
int32_t top_p_key(std::vector<std::pair<int32_t, float>>& kept, float target) {
  auto desc = [](const std::pair<int32_t, float>& a, const std::pair<int32_t, float>& b) { return a.first > b.first; };
  size_t sorted = std::min<size_t>(kept.size(), 1024);  // the reference's TOP_P_FIRST: most rows stop early
  for (;;) {
    std::partial_sort(kept.begin(), kept.begin() + sorted, kept.end(), desc);
    float mass = 0.0f;
    for (size_t i = 0; i < sorted; ++i) {
      mass += kept[i].second;
      if (mass >= target) return kept[i].first;
    }
    if (sorted == kept.size()) return kept.back().first;
    sorted = kept.size();
  }
}

int64_t sample_row(const float* x, int64_t V, const SampleParams& p, std::vector<float>& z, std::vector<uint8_t>& keep,
                   std::vector<std::pair<int32_t, float>>& kept) {
  if (p.temperature <= 0) {
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (x[v] > x[best]) best = v;
    return x[best] == -INFINITY ? -1 : best;
  }
  z.resize(V);
  keep.assign(V, 0);
  float zmax = -INFINITY;
  for (int64_t v = 0; v < V; ++v) zmax = std::max(zmax, z[v] = x[v] / p.temperature);
  if (zmax == -INFINITY) return -1;
  const bool filter_k = p.top_k > 0 && p.top_k < V, filter_p = p.top_p < 1.0f;
  kept.clear();
  for (int64_t v = 0; v < V; ++v) {
    if (z[v] == -INFINITY) continue;
    const float mass = (p.min_p > 0 || filter_p) ? std::exp(z[v] - zmax) : 1.0f;
    if (mass < p.min_p) continue;
    keep[v] = 1;
    if (filter_k || filter_p) kept.emplace_back(ordered_key(z[v]), mass);
  }
  int32_t threshold = INT32_MIN;
  if (filter_k && static_cast<int64_t>(kept.size()) >= p.top_k) {
    std::nth_element(kept.begin(), kept.begin() + (p.top_k - 1), kept.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    threshold = kept[p.top_k - 1].first;
    kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const auto& k) { return k.first < threshold; }),
               kept.end());
  }
  if (filter_p) {
    float total = 0.0f;
    for (const auto& k : kept) total += k.second;
    threshold = std::max(threshold, top_p_key(kept, p.top_p * total));
  }
  // Seed the best score with the highest z (it is always kept) so that far-behind tokens skip their logs;
  // ties still go to the lowest index, as argmax's.
  const int64_t top = std::max_element(z.begin(), z.end()) - z.begin();
  float best = gumbel(p.row_hash, top) + z[top];
  int64_t tok = top;
  for (int64_t v = 0; v < V; ++v) {
    if (!keep[v] || ordered_key(z[v]) < threshold || z[v] + kGumbelMax < best) continue;
    const float score = gumbel(p.row_hash, v) + z[v];
    if (score > best || (score == best && v < tok)) {
      best = score;
      tok = v;
    }
  }
  return tok;
}

}  // namespace

void sample_tokens(const float* logits, int64_t B, int64_t V, const float* temperature, const int64_t* top_k,
                   const float* top_p, const float* min_p, const int64_t* seeds, const int64_t* offsets,
                   int64_t* tokens, int num_threads) {
  parallel_ranges(B, threads_for(B * V * 8, num_threads, 1 << 20), [&](int64_t b0, int64_t b1) {
    std::vector<float> z;
    std::vector<uint8_t> keep;
    std::vector<std::pair<int32_t, float>> kept;
    for (int64_t b = b0; b < b1; ++b) {
      const uint64_t seed = static_cast<uint64_t>(seeds[b]);
      const uint32_t row = mix32(mix32(mix32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32)) ^
                                 static_cast<uint32_t>(static_cast<uint64_t>(offsets[b])));
      const SampleParams p{temperature[b], top_p[b], min_p[b], top_k[b], row};
      tokens[b] = V == 0 ? -1 : sample_row(logits + b * V, V, p, z, keep, kept);
    }
  });
}

void greedy_tokens(const float* logits, int64_t B, int64_t V, int64_t* tokens, int num_threads) {
  parallel_ranges(B, threads_for(B * V, num_threads, 1 << 20), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) tokens[b] = row_argmax(logits + b * V, V);
  });
}

void apply_token_mask(float* logits, const int32_t* bitmask, int64_t B, int64_t V, int num_threads) {
  const int64_t W = (V + 31) / 32;
  parallel_ranges(B, threads_for(B * V, num_threads, 1 << 20), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* row = logits + b * V;
      for (int64_t w = 0; w < W; ++w) {
        // Grammar rows are mostly all-clear words and free rows all-set ones: both skip the bit loop.
        const uint32_t bits = static_cast<uint32_t>(bitmask[b * W + w]);
        const int64_t n = std::min<int64_t>(32, V - 32 * w);
        float* x = row + 32 * w;
        if (bits == 0xffffffffu) continue;
        if (bits == 0) {
          std::fill(x, x + n, -INFINITY);
          continue;
        }
        for (int64_t j = 0; j < n; ++j) x[j] = ((bits >> j) & 1u) ? x[j] : -INFINITY;  // a blend, no branch
      }
    }
  });
}

}  // namespace deepinfer
