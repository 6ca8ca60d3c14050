#include "cpu/moe.h"

#include <algorithm>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/scratch.h"
#include "cpu/thread_pool.h"

namespace deepinfer {
namespace {

// Rows of the expert-sorted order: slot p holds pair f = t * k + j; offsets [E + 1] bound each expert's
// rows. Stable, so an expert's pairs keep token order.
struct Grouping {
  std::vector<int64_t> offsets, pair_of_slot, slot_of_pair;
};

Grouping group_by_expert(const int64_t* ids, int64_t pairs, int64_t E) {
  Grouping g;
  g.offsets.assign(E + 1, 0);
  for (int64_t f = 0; f < pairs; ++f) ++g.offsets[ids[f] + 1];
  for (int64_t e = 0; e < E; ++e) g.offsets[e + 1] += g.offsets[e];
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  g.pair_of_slot.resize(pairs);
  g.slot_of_pair.resize(pairs);
  for (int64_t f = 0; f < pairs; ++f) {
    const int64_t p = next[ids[f]]++;
    g.pair_of_slot[p] = f;
    g.slot_of_pair[f] = p;
  }
  return g;
}

}  // namespace

template <class W>
bool moe_experts_bf16(const void* x, const int64_t* ids, const void* weights, bool bf16, int64_t T, int64_t k,
                      int64_t E, const uint8_t* skip, const W* w13, const W* w2, float* y, int64_t H, int64_t I,
                      float limit, GemmMode mode, int num_threads) {
  const int64_t pairs = T * k;
  for (int64_t f = 0; f < pairs; ++f)
    if (ids[f] < 0 || ids[f] >= E) return false;
  const Grouping g = group_by_expert(ids, pairs, E);
  // Every row is written before it is read (a skipped expert's rows are never read).
  Scratch<float> rows(ScratchUse::MOE_ROWS, pairs * H), out(ScratchUse::MOE_OUT, pairs * H);
  parallel_ranges(pairs, threads_for(pairs * H, num_threads), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) load_row(x, g.pair_of_slot[p] / k * H, H, bf16, rows.data() + p * H);
  });
  grouped_experts_bf16(rows.data(), g.offsets.data(), E, skip, w13, w2, out.data(), H, I, limit, mode, num_threads);
  parallel_ranges(T, threads_for(pairs * H, num_threads), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(k);
    for (int64_t t = t0; t < t1; ++t) {
      std::copy(g.slot_of_pair.begin() + t * k, g.slot_of_pair.begin() + (t + 1) * k, slots.begin());
      std::sort(slots.begin(), slots.end());  // slots ascend with the expert id
      float* acc = y + t * H;
      std::fill(acc, acc + H, 0.0f);
      for (int64_t p : slots) {
        const int64_t f = g.pair_of_slot[p];
        if (skip && skip[ids[f]]) continue;
        float w;
        load_row(weights, f, 1, bf16, &w);
        const float* o = out.data() + p * H;
        for (int64_t i = 0; i < H; ++i) acc[i] += w * o[i];
      }
    }
  });
  return true;
}

template bool moe_experts_bf16(const void*, const int64_t*, const void*, bool, int64_t, int64_t, int64_t,
                               const uint8_t*, const uint16_t*, const uint16_t*, float*, int64_t, int64_t, float,
                               GemmMode, int);
template bool moe_experts_bf16(const void*, const int64_t*, const void*, bool, int64_t, int64_t, int64_t,
                               const uint8_t*, const float*, const float*, float*, int64_t, int64_t, float, GemmMode,
                               int);

}  // namespace deepinfer
