#include "cpu/moe_block.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/moe.h"
#include "cpu/norm_rope.h"

namespace deepinfer {
namespace {

// out[i] = round(x[i] + y[i]) for n values of the dtype (y fp32 rounded to the dtype first when y32).
void add_rounded(const void* x, const void* y, bool y32, void* out, int64_t n, bool bf16) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 yv = y32 ? round_to8(_mm256_loadu_ps(static_cast<const float*>(y) + i), bf16) : load8(y, i, bf16);
    store8(out, i, _mm256_add_ps(load8(x, i, bf16), yv), bf16);
  }
  for (; i < n; ++i) {
    float xv, yv;
    load_row(x, i, 1, bf16, &xv);
    if (y32) yv = round_to(static_cast<const float*>(y)[i], bf16);
    else load_row(y, i, 1, bf16, &yv);
    const float s = xv + yv;
    store_row(out, i, 1, bf16, &s);
  }
}

// One token's router: logits [E] (fp32 values of the dtype) -> the top_k experts of softmax(logits) by
// probability (ties: lower id), their weights renormalised to sum 1 when renorm, rounded to the dtype.
// p [E] and order [E]: scratch.
void route_token(const float* logits, int64_t E, int64_t top_k, bool renorm, bool bf16, int64_t* ids, float* weights,
                 std::vector<float>& p, std::vector<int64_t>& order) {
  const float m = *std::max_element(logits, logits + E);
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[e] - m));
  const float inv = 1.0f / sum;  // torch's softmax multiplies by the reciprocal of the sum
  for (float& v : p) v *= inv;
  std::iota(order.begin(), order.end(), 0);
  // NaN ranks above every number, as in torch.topk: compared as a number it would break the strict weak order
  // partial_sort requires (undefined behaviour), and a request whose activations overflow shares its batch.
  std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
    const bool nan_a = std::isnan(p[a]), nan_b = std::isnan(p[b]);
    if (nan_a != nan_b) return nan_a;
    return (!nan_a && p[a] != p[b]) ? p[a] > p[b] : a < b;
  });
  float total = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) total += p[order[j]];
  for (int64_t j = 0; j < top_k; ++j) {
    ids[j] = order[j];
    weights[j] = round_to(renorm ? p[order[j]] / total : p[order[j]], bf16);
  }
}

// The grouped kernel's ISA for these physical ids: the one planned for the busiest expert's row count.
GemmMode expert_mode(const MoeBlock& b, const std::vector<int64_t>& ids) {
  std::vector<int64_t> rows(b.num_physical, 0);
  for (int64_t id : ids) ++rows[id];
  const int64_t busiest = *std::max_element(rows.begin(), rows.end());
  int level = 0;
  while (level + 1 < static_cast<int>(b.expert_isa.size()) && (int64_t{2} << level) <= busiest) ++level;
  return kernel_mode(b.expert_isa[level], b.invariant, b.packed);
}

}  // namespace

bool moe_block(const MoeBlock& b, int64_t* counts, const int64_t* log2phy, const void* x, const void* a, void* out,
               int64_t T, bool bf16, int num_threads) {
  const int64_t H = b.H, E = b.num_logical, k = b.top_k, elem = bf16 ? 2 : 4;
  add_rounded(x, a, false, out, T * H, bf16);  // out holds x1 until the last step
  std::vector<char> h(T * H * elem), logits(T * E * elem);
  rms_norm(out, H, b.norm_w, h.data(), T, H, b.eps, bf16, num_threads);
  with_weights(b.gate, nullptr, b.fp32_weights, [&](auto gate, auto no_bias) {
    linear_bf16(h.data(), gate, no_bias, logits.data(), bf16, T, H, E, b.gate_mode, num_threads);
  });
  std::vector<int64_t> ids(T * k);
  std::vector<float> weights(T * k), row(E), p(E);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    load_row(logits.data(), t * E, E, bf16, row.data());
    route_token(row.data(), E, k, b.renorm, bf16, &ids[t * k], &weights[t * k], p, order);
  }
  // Every mapped slot is checked before any count is added, so a bad log2phy leaves the counts as they were.
  for (int64_t id : ids) {
    const int64_t slot = log2phy ? log2phy[id] : id;
    if (slot < 0 || slot >= b.num_physical) return false;
  }
  for (int64_t& id : ids) {
    if (counts) ++counts[id];
    if (log2phy) id = log2phy[id];
  }
  std::vector<char> w(T * k * elem);
  store_row(w.data(), 0, T * k, bf16, weights.data());
  std::vector<float> y(T * H);
  bool ok = false;
  with_weights(b.w13, b.w2, b.fp32_weights, [&](auto w13, auto w2) {
    ok = moe_experts_bf16(h.data(), ids.data(), w.data(), bf16, T, k, b.num_physical, nullptr, w13, w2, y.data(), H,
                          b.I, INFINITY, expert_mode(b, ids), num_threads);
  });
  if (!ok) return false;
  add_rounded(out, y.data(), true, out, T * H, bf16);
  return true;
}

}  // namespace deepinfer
