#include "cpu/hyper_connection.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"

namespace deepinfer {
namespace {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// c [N, N] > 0: columns normalised first, then (rows, columns) iters-1 times, each sum + eps.
void sinkhorn(float* c, int64_t N, int iters, float eps) {
  auto columns = [&] {
    for (int64_t j = 0; j < N; ++j) {
      float s = 0.0f;
      for (int64_t i = 0; i < N; ++i) s += c[i * N + j];
      for (int64_t i = 0; i < N; ++i) c[i * N + j] /= s + eps;
    }
  };
  columns();
  for (int it = 1; it < iters; ++it) {
    for (int64_t i = 0; i < N; ++i) {
      float s = 0.0f;
      for (int64_t j = 0; j < N; ++j) s += c[i * N + j];
      for (int64_t j = 0; j < N; ++j) c[i * N + j] /= s + eps;
    }
    columns();
  }
}

// Tokens whose normalised streams are mixed together: each fn row is then read from memory once per
// chunk instead of once per token (fn is 384 KB at N=4, D=1024; the chunk's streams stay in L2).
constexpr int64_t CHUNK = 8;

// post/comb/collapse of token t from its mixes [(2+N)N] and fp32 streams x [N*D]; scratch [D].
void hc_finish_token(const float* mixes, const float* x, const float* base, const float* scale, int64_t t, int64_t N,
                     int64_t D, int iters, float hc_eps, bool bf16, float* post, float* comb, void* collapsed,
                     float* scratch) {
  float pre[64];  // N <= 64 checked by the caller
  for (int64_t n = 0; n < N; ++n) {
    pre[n] = sigmoid(mixes[n] * scale[0] + base[n]) + hc_eps;
    post[t * N + n] = 2.0f * sigmoid(mixes[N + n] * scale[1] + base[N + n]);
  }
  float* c = comb + t * N * N;
  for (int64_t i = 0; i < N; ++i) {
    const float* logit = mixes + 2 * N + i * N;
    const float* bias = base + 2 * N + i * N;
    float* row = c + i * N;
    float mx = -INFINITY, s = 0.0f;
    for (int64_t j = 0; j < N; ++j) mx = std::max(mx, row[j] = logit[j] * scale[2] + bias[j]);
    for (int64_t j = 0; j < N; ++j) s += row[j] = std::exp(row[j] - mx);
    for (int64_t j = 0; j < N; ++j) row[j] = row[j] / s + hc_eps;
  }
  sinkhorn(c, N, iters, hc_eps);
  std::fill(scratch, scratch + D, 0.0f);  // the collapse, summed over streams in order
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) scratch[d] += pre[n] * x[n * D + d];
  store_row(collapsed, t * D, D, bf16, scratch);
}

// Tokens [t0, t0 + count), count <= CHUNK. x, xn [CHUNK, N*D] and mixes [CHUNK, (2+N)N] are scratch.
void hc_pre_chunk(const void* streams, bool bf16, const float* fn, const float* base, const float* scale, int64_t t0,
                  int64_t count, int64_t N, int64_t D, int iters, float hc_eps, float norm_eps, float* post,
                  float* comb, void* collapsed, float* x, float* xn, float* mixes) {
  const int64_t width = N * D, M = (2 + N) * N;
  for (int64_t i = 0; i < count; ++i) {
    float* xi = x + i * width;
    load_row(streams, (t0 + i) * width, width, bf16, xi);
    const float r = 1.0f / std::sqrt(dot(xi, xi, width) / static_cast<float>(width) + norm_eps);
    for (int64_t k = 0; k < width; ++k) xn[i * width + k] = xi[k] * r;
  }
  for (int64_t j = 0; j < M; ++j)
    for (int64_t i = 0; i < count; ++i) mixes[i * M + j] = dot(fn + j * width, xn + i * width, width);
  for (int64_t i = 0; i < count; ++i)
    hc_finish_token(mixes + i * M, x + i * width, base, scale, t0 + i, N, D, iters, hc_eps, bf16, post, comb,
                    collapsed, xn);
}

constexpr int64_t HC_PARALLEL_MIN = 1 << 20;  // multiply-adds of a call below which it stays on one thread

}  // namespace

void hc_pre(const void* streams, bool bf16, const float* fn, const float* base, const float* scale, int64_t T,
            int64_t N, int64_t D, int sinkhorn_iters, float hc_eps, float norm_eps, float* post, float* comb,
            void* collapsed, int num_threads) {
  const int64_t M = (2 + N) * N, chunks = (T + CHUNK - 1) / CHUNK;
  // Tokens split across threads only when each gets enough work to beat the wake-up cost.
  const int threads = threads_for(T * M * N * D, num_threads, HC_PARALLEL_MIN);
  parallel_ranges(chunks, threads, [&](int64_t c0, int64_t c1) {
    std::vector<float> x(static_cast<size_t>(CHUNK * N * D)), xn(x.size()), mixes(static_cast<size_t>(CHUNK * M));
    for (int64_t c = c0; c < c1; ++c)
      hc_pre_chunk(streams, bf16, fn, base, scale, c * CHUNK, std::min(CHUNK, T - c * CHUNK), N, D, sinkhorn_iters,
                   hc_eps, norm_eps, post, comb, collapsed, x.data(), xn.data(), mixes.data());
  });
}

void hc_merge(const void* block_out, const void* streams, bool bf16, const float* post, const float* comb,
              int64_t T, int64_t N, int64_t D, void* out, int num_threads) {
  const int threads = threads_for(T * N * N * D, num_threads, HC_PARALLEL_MIN);
  parallel_ranges(T, threads, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(static_cast<size_t>(N * D)), direct(static_cast<size_t>(D)), mix(static_cast<size_t>(D));
    for (int64_t t = t0; t < t1; ++t) {
      load_row(streams, t * N * D, N * D, bf16, s.data());
      load_row(block_out, t * D, D, bf16, direct.data());
      for (int64_t n = 0; n < N; ++n) {
        // post and comb are rounded to the streams' type first, as `post.to(dtype)` and `comb.to(dtype)`.
        const float p = round_to(post[t * N + n], bf16);
        std::fill(mix.begin(), mix.end(), 0.0f);
        for (int64_t m = 0; m < N; ++m) {
          const float c = round_to(comb[(t * N + m) * N + n], bf16);
          for (int64_t d = 0; d < D; ++d) mix[d] += c * s[m * D + d];
        }
        for (int64_t d = 0; d < D; ++d) mix[d] = round_to(p * direct[d], bf16) + round_to(mix[d], bf16);
        store_row(out, (t * N + n) * D, D, bf16, mix.data());
      }
    }
  });
}

}  // namespace deepinfer
