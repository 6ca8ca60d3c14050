#include "cpu/sampling.h"

#include <cmath>

#include "cpu/thread_pool.h"

namespace deepinfer {
namespace {

int64_t row_argmax(const float* row, int64_t V) {
  float best = -INFINITY;
  int64_t arg = 0;
  bool finite = true;
  for (int64_t v = 0; v < V; ++v) {
    finite &= std::isfinite(row[v]);
    if (row[v] > best) {
      best = row[v];
      arg = v;
    }
  }
  return finite ? arg : -1;
}

}  // namespace

void greedy_tokens(const float* logits, int64_t B, int64_t V, int64_t* tokens, int num_threads) {
  parallel_ranges(B, threads_for(B * V, num_threads, 1 << 20), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) tokens[b] = row_argmax(logits + b * V, V);
  });
}

}  // namespace deepinfer
