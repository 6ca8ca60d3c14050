#include "cpu/sampling.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/simd.h"
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

// The hash's 23 bits as a uniform in (0, 1), exact in fp32.
float uniform(uint32_t h) { return (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f); }

// g = -log(-log(u)) of the hashed uniform u of (row hash, token), as gumbel_ref computes it in fp32.
float gumbel(uint32_t row, int64_t token) {
  return -std::log(-std::log(uniform(mix32(row ^ mix32(static_cast<uint32_t>(token))))));
}

__m256i mix32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x846CA68Bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// -log(-log(u)) with log8 for the two logs.
__m256 gumbel_of8(__m256 u) {
  const __m256 neg = _mm256_set1_ps(-0.0f);
  return _mm256_xor_ps(log8(_mm256_xor_ps(log8(u), neg)), neg);
}

// gumbel() of tokens v..v+7, within kGumbelError of it.
__m256 gumbel8(__m256i row, int32_t v) {
  const __m256i tokens = _mm256_add_epi32(_mm256_set1_epi32(v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i h = mix32x8(_mm256_xor_si256(row, mix32x8(tokens)));
  const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 9)), _mm256_set1_ps(0.5f)),
                                 _mm256_set1_ps(1.0f / 8388608.0f));
  return gumbel_of8(u);
}

struct SampleParams {
  float temperature, top_p, min_p;
  int64_t top_k;
  uint32_t row_hash;
};

// z = x / temperature (the reference's fp32 division) -> max z.
float scale(const float* x, int64_t V, float temperature, float* z) {
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 q = _mm256_div_ps(_mm256_loadu_ps(x + v), t);
    _mm256_storeu_ps(z + v, q);
    top = _mm256_max_ps(top, q);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float zmax = *std::max_element(lanes, lanes + 8);
  for (; v < V; ++v) zmax = std::max(zmax, z[v] = x[v] / temperature);
  return zmax;
}

// The filters select thresholds among tokens bucketed by z (16 bins per unit below the max, the last bin all
// further below), so only the one bin holding a threshold is sorted: a full sort of a 32k row cost ~0.6 ms.
// Keys fall as bins rise. Bin kDropped holds the tokens already at -inf.
constexpr int kBinsPerUnit = 16, kBins = 1024, kDropped = kBins;

struct Bins {
  int64_t count[kBins];
  float mass[kBins];
  int last;  // the last bin with a kept token
};

// A row's buffers, kept per thread: allocating them per call page-faults on every step.
struct RowScratch {
  std::vector<float> z, aux;  // [V]: scaled logits; masses, then approximate scores
  std::vector<int32_t> bin;   // [V]: each token's bin
  std::vector<std::pair<int32_t, float>> members;  // (key, mass) of one bin's kept tokens
  int32_t count[4][kBins + 1];  // four partial histograms: a run of tokens in one bin is not one chain of adds
  float mass[4][kBins + 1];
  Bins bins;
};

// bin_tokens' vector rule for one token: a NaN (which the op does not take) lands in the last bin, as min_ps puts it.
int bin_of(float z, float zmax) {
  const float d = (zmax - z) * kBinsPerUnit;
  return d < kBins - 1 ? static_cast<int>(d) : kBins - 1;
}

__m256i keys8(__m256 z) {
  const __m256i b = _mm256_castps_si256(z);
  return _mm256_xor_si256(b, _mm256_and_si256(_mm256_srai_epi32(b, 31), _mm256_set1_epi32(0x7FFFFFFF)));
}

// r.bins from r.bin and r.aux: four partial sums per bin, each in token order, added in a fixed order.
void histogram(int64_t V, RowScratch& r) {
  std::memset(r.count, 0, sizeof r.count);
  std::memset(r.mass, 0, sizeof r.mass);
  int64_t v = 0;
  for (; v + 4 <= V; v += 4)
    for (int c = 0; c < 4; ++c) {
      r.count[c][r.bin[v + c]] += 1;
      r.mass[c][r.bin[v + c]] += r.aux[v + c];
    }
  for (; v < V; ++v) {
    r.count[0][r.bin[v]] += 1;
    r.mass[0][r.bin[v]] += r.aux[v];
  }
  Bins& bins = r.bins;
  bins.last = 0;
  for (int b = 0; b < kBins; ++b) {
    bins.count[b] = r.count[0][b] + r.count[1][b] + r.count[2][b] + r.count[3][b];
    bins.mass[b] = ((r.mass[0][b] + r.mass[1][b]) + r.mass[2][b]) + r.mass[3][b];
    if (bins.count[b]) bins.last = b;
  }
}

// Drops min-p's tokens (z = -inf) and gives every token its mass exp(z - zmax) (exp8; 1 where neither min-p nor
// top-p needs it) and bin.
void bin_tokens(float* z, int64_t V, float zmax, const SampleParams& p, bool masses, RowScratch& r) {
  const __m256 top = _mm256_set1_ps(zmax), min_p = _mm256_set1_ps(p.min_p), ninf = _mm256_set1_ps(-INFINITY);
  const __m256 scale = _mm256_set1_ps(kBinsPerUnit), last = _mm256_set1_ps(kBins - 1);
  const int64_t vector_end = V / 8 * 8;
  for (int64_t v = 0; v < vector_end; v += 8) {
    __m256 x = _mm256_loadu_ps(z + v);
    const __m256 m = masses ? exp8(_mm256_sub_ps(x, top)) : _mm256_set1_ps(1.0f);
    x = _mm256_blendv_ps(x, ninf, _mm256_cmp_ps(m, min_p, _CMP_LT_OQ));
    const __m256i b = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(top, x), scale), last));
    const __m256 dropped = _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ);
    _mm256_storeu_ps(z + v, x);
    _mm256_storeu_ps(r.aux.data() + v, m);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.bin.data() + v),
                        _mm256_blendv_epi8(b, _mm256_set1_epi32(kDropped), _mm256_castps_si256(dropped)));
  }
  for (int64_t v = vector_end; v < V; ++v) {
    const float m = masses ? std::exp(z[v] - zmax) : 1.0f;
    if (m < p.min_p) z[v] = -INFINITY;
    r.aux[v] = m;
    r.bin[v] = z[v] == -INFINITY ? kDropped : bin_of(z[v], zmax);
  }
}

// (key, mass) of bin b's tokens with key >= floor, in r.members, sorted by key, descending.
void bin_members(const float* z, int64_t V, int b, int32_t floor, RowScratch& r) {
  r.members.clear();
  const __m256i want = _mm256_set1_epi32(b);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.bin.data() + v));
    for (int hits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(at, want))); hits; hits &= hits - 1) {
      const int64_t t = v + __builtin_ctz(hits);
      if (ordered_key(z[t]) >= floor) r.members.emplace_back(ordered_key(z[t]), r.aux[t]);
    }
  }
  for (; v < V; ++v)
    if (r.bin[v] == b && ordered_key(z[v]) >= floor) r.members.emplace_back(ordered_key(z[v]), r.aux[v]);
  std::sort(r.members.begin(), r.members.end(), [](const auto& a, const auto& c) { return a.first > c.first; });
}

// The k-th largest kept key (k <= kept tokens); r.bins then counts and masses only the tokens at or above it.
int32_t top_k_key(const float* z, int64_t V, int64_t k, RowScratch& r) {
  Bins& bins = r.bins;
  int b = 0;
  for (; bins.count[b] < k; ++b) k -= bins.count[b];
  bin_members(z, V, b, INT32_MIN, r);
  const int32_t key = r.members[k - 1].first;
  while (k < static_cast<int64_t>(r.members.size()) && r.members[k].first == key) ++k;  // ties are kept
  bins.count[b] = k;
  bins.mass[b] = 0.0f;
  for (int64_t i = 0; i < k; ++i) bins.mass[b] += r.members[i].second;
  bins.last = b;
  return key;
}

// The largest key t whose cumulative mass (in descending key order) over the kept tokens at or above floor
// reaches top_p of their total; the smallest such key when rounding leaves the sum short (keep all). Bins sum
// their masses in token order, so t can differ from the reference's sorted sum where it falls within rounding.
int32_t top_p_key(const float* z, int64_t V, float top_p, int32_t floor, RowScratch& r) {
  const Bins& bins = r.bins;
  float total = 0.0f;
  for (int b = 0; b <= bins.last; ++b) total += bins.mass[b];
  const float target = top_p * total;
  float cum = 0.0f;
  for (int b = 0;; ++b) {
    if (b < bins.last && cum + bins.mass[b] < target) {
      cum += bins.mass[b];
      continue;
    }
    bin_members(z, V, b, floor, r);
    for (const auto& m : r.members)
      if ((cum += m.second) >= target) return m.first;
    if (b == bins.last) return r.members.back().first;  // bin sums reached the target, the sorted sum did not
  }
}

// z = -inf where the key is below threshold.
void drop_below(float* z, int64_t V, int32_t threshold) {
  const __m256i t = _mm256_set1_epi32(threshold);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_loadu_ps(z + v);
    _mm256_storeu_ps(z + v, _mm256_blendv_ps(x, ninf, _mm256_castsi256_ps(_mm256_cmpgt_epi32(t, keys8(x)))));
  }
  for (; v < V; ++v)
    if (ordered_key(z[v]) < threshold) z[v] = -INFINITY;
}

// The min-p, top-k and top-p filters of the module rule: z[v] = -inf for every token they drop.
void filter(float* z, int64_t V, float zmax, const SampleParams& p, RowScratch& r) {
  const bool filter_k = p.top_k > 0 && p.top_k < V, filter_p = p.top_p < 1.0f;
  if (!filter_k && !filter_p && p.min_p <= 0) return;
  bin_tokens(z, V, zmax, p, p.min_p > 0 || filter_p, r);
  if (!filter_k && !filter_p) return;  // min-p alone: its drops are done
  histogram(V, r);
  int64_t kept = 0;
  for (int b = 0; b <= r.bins.last; ++b) kept += r.bins.count[b];
  int32_t threshold = INT32_MIN;
  if (filter_k && kept >= p.top_k) threshold = top_k_key(z, V, p.top_k, r);
  if (filter_p) threshold = std::max(threshold, top_p_key(z, V, p.top_p, threshold, r));
  if (threshold != INT32_MIN) drop_below(z, V, threshold);
}

// Twice the most an approximate score can differ from the exact one near `score`: the Gumbel error, and an ulp
// of the score from rounding each to fp32.
float slack(float score) { return 2 * (kGumbelError + 2.4e-7f * std::fabs(score)); }

// First argmax of gumbel(row, v) + z[v] over the tokens with z above -inf (at least one; zmax the largest z).
// The C library's two logs per token cost ~25 ns; gumbel8 scores tokens first (approx [V]), and only the tokens
// within slack of the best approximate score, which include the exact winner, are scored with gumbel(). The top
// token scores at least zmax - 2.82 (the smallest uniform's noise) and no token more than z + 16.64 (the
// largest's), so blocks of tokens 20 below zmax cannot come near the best: they are not scored at all.
int64_t gumbel_argmax(const float* z, int64_t V, float zmax, uint32_t row_hash, float* approx) {
  const __m256i row = _mm256_set1_epi32(static_cast<int32_t>(row_hash));
  const __m256 ninf = _mm256_set1_ps(-INFINITY), floor = _mm256_set1_ps(zmax - 20.0f - 2 * slack(zmax));
  __m256 top = ninf;
  const int64_t vector_end = V <= INT32_MAX ? V / 8 * 8 : 0;
  for (int64_t v = 0; v < vector_end; v += 8) {
    const __m256 x = _mm256_loadu_ps(z + v);
    const bool far = _mm256_movemask_ps(_mm256_cmp_ps(x, floor, _CMP_LT_OQ)) == 0xff;  // or dropped (-inf)
    const __m256 s = far ? ninf : _mm256_add_ps(x, gumbel8(row, static_cast<int32_t>(v)));
    _mm256_storeu_ps(approx + v, s);
    top = _mm256_max_ps(top, s);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  const float best_approx = *std::max_element(lanes, lanes + 8);
  const float cut = best_approx - slack(best_approx);
  float best = -INFINITY;
  int64_t tok = -1;
  auto score = [&](int64_t v) {
    const float s = gumbel(row_hash, v) + z[v];
    if (s > best) {  // tokens come in order: ties go to the first
      best = s;
      tok = v;
    }
  };
  const __m256 cut8 = _mm256_set1_ps(cut);
  for (int64_t v = 0; v < vector_end; v += 8)
    for (int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(approx + v), cut8, _CMP_GE_OQ)); hits;
         hits &= hits - 1)
      score(v + __builtin_ctz(hits));
  for (int64_t v = vector_end; v < V; ++v)
    if (z[v] != -INFINITY) score(v);
  return tok;
}

int64_t sample_row(const float* x, int64_t V, const SampleParams& p, RowScratch& r) {
  if (p.temperature <= 0) {
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (x[v] > x[best]) best = v;
    return x[best] == -INFINITY ? -1 : best;
  }
  r.z.resize(V);
  r.aux.resize(V);
  r.bin.resize(V);
  const float zmax = scale(x, V, p.temperature, r.z.data());
  if (zmax == -INFINITY) return -1;
  filter(r.z.data(), V, zmax, p, r);
  return gumbel_argmax(r.z.data(), V, zmax, p.row_hash, r.aux.data());
}

// The row's maximum (finite values).
float row_max(const float* row, int64_t V) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(row + v));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float top = *std::max_element(lanes, lanes + 8);
  for (; v < V; ++v) top = std::max(top, row[v]);
  return top;
}

// log(sum exp(row - mx)): eight lanes of exp8, summed in double in a fixed order, then the tail. An fp32 sum of a
// 32000-token row's exps drifts by ~1e-5 of itself (each lane adds 4000 small terms to a growing total); in double
// the log-sum keeps exp8's ~2 ulp.
float row_log_sum_exp(const float* row, int64_t V, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + v), m));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; v < V; ++v) sum += std::exp(row[v] - mx);
  return static_cast<float>(std::log(sum));
}

// How many values have (x - mx) - ls > t: the same arithmetic as the drawn token's logprob, so ties stay ties.
int64_t count_above(const float* row, int64_t V, float mx, float ls, float t) {
  const __m256 m = _mm256_set1_ps(mx), l = _mm256_set1_ps(ls), thr = _mm256_set1_ps(t);
  int64_t count = 0, v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 lp = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(row + v), m), l);
    count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(lp, thr, _CMP_GT_OQ)));
  }
  for (; v < V; ++v) count += (row[v] - mx) - ls > t;
  return count;
}

// The n greatest values as (value, id), descending, lower id first among equals. A min-heap of the best so far;
// eight values at a time are skipped while none beats its least (most of the row, once the heap is full).
std::vector<std::pair<float, int64_t>> top_values(const float* row, int64_t V, int64_t n) {
  using Entry = std::pair<float, int64_t>;
  // "a before b" = a is the better: greater value, or equal value and lower id. The heap keeps the worst in front.
  const auto better = [](const Entry& a, const Entry& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<Entry> heap;
  heap.reserve(n + 1);
  const auto offer = [&](int64_t v) {
    if (static_cast<int64_t>(heap.size()) < n) {
      heap.emplace_back(row[v], v);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (row[v] > heap.front().first) {  // ids rise along the row: an equal value later is worse
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = {row[v], v};
      std::push_heap(heap.begin(), heap.end(), better);
    }
  };
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const float least = static_cast<int64_t>(heap.size()) < n ? -INFINITY : heap.front().first;
    const int beat = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), _mm256_set1_ps(least), _CMP_GE_OQ));
    for (int lane = 0; beat && lane < 8; ++lane)
      if (beat >> lane & 1) offer(v + lane);
  }
  for (; v < V; ++v) offer(v);
  std::sort(heap.begin(), heap.end(), better);
  return heap;
}

}  // namespace

void sample_tokens(const float* logits, int64_t B, int64_t V, const float* temperature, const int64_t* top_k,
                   const float* top_p, const float* min_p, const int64_t* seeds, const int64_t* offsets,
                   int64_t* tokens, int num_threads) {
  parallel_ranges(B, threads_for(B * V * 8, num_threads, 1 << 20), [&](int64_t b0, int64_t b1) {
    static thread_local RowScratch scratch;
    for (int64_t b = b0; b < b1; ++b) {
      const uint64_t seed = static_cast<uint64_t>(seeds[b]);
      const uint32_t row = mix32(mix32(mix32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32)) ^
                                 static_cast<uint32_t>(static_cast<uint64_t>(offsets[b])));
      const SampleParams p{temperature[b], top_p[b], min_p[b], top_k[b], row};
      tokens[b] = V == 0 ? -1 : sample_row(logits + b * V, V, p, scratch);
    }
  });
}

float gumbel_approx_error() {
  float worst = 0.0f;
  alignas(32) float u[8], approx[8];
  for (uint32_t h = 0; h < (1u << 23); h += 8) {
    for (int l = 0; l < 8; ++l) u[l] = uniform((h + l) << 9);
    _mm256_store_ps(approx, gumbel_of8(_mm256_load_ps(u)));
    for (int l = 0; l < 8; ++l) worst = std::max(worst, std::fabs(approx[l] + std::log(-std::log(u[l]))));
  }
  return worst;
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

void token_logprobs(const float* logits, int64_t B, int64_t V, const int64_t* tokens, int64_t n, float* token_logprob,
                    int64_t* rank, int64_t* top_ids, float* top_logprobs, int num_threads) {
  parallel_ranges(B, threads_for(B * V * 4, num_threads, 1 << 20), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (tokens[b] < 0) continue;
      const float* row = logits + b * V;
      const float mx = row_max(row, V), ls = row_log_sum_exp(row, V, mx);
      const float t = (row[tokens[b]] - mx) - ls;
      token_logprob[b] = t;
      rank[b] = 1 + count_above(row, V, mx, ls, t);
      if (n <= 0) continue;
      const auto top = top_values(row, V, n);
      for (int64_t j = 0; j < n; ++j) {
        top_ids[b * n + j] = top[j].second;
        top_logprobs[b * n + j] = (top[j].first - mx) - ls;
      }
    }
  });
}

}  // namespace deepinfer
