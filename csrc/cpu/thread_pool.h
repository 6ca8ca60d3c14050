#pragma once
// A persistent pool for the CPU kernels. OpenMP's fork/join per parallel region costs tens of microseconds
// and, with torch's own OpenMP threads spinning beside ours on 2 vCPUs, made small GEMMs 10-100x slower at
// two threads. Workers here outlive every call, spin briefly for the next job (kernels of one forward come
// back to back), then sleep; the caller works on its own job too, and tasks are claimed from one atomic
// counter, so no thread waits on a barrier for a slower sibling's fixed share.
#include <algorithm>
#include <cstdint>
#include <functional>

namespace deepinfer {

// Runs fn(t) for every t in [0, tasks) on up to num_threads threads, the caller included, and returns
// when all have finished. Nested calls (from inside fn) run serially on the calling thread.
void parallel_for(int64_t tasks, int num_threads, const std::function<void(int64_t)>& fn);

// Below this much work (elements touched) a small kernel runs on the calling thread: waking a worker costs more.
constexpr int64_t PARALLEL_MIN_ELEMS = 1 << 16;

// Threads for a kernel call of `elems` elements (or multiply-adds): all num_threads (at least 1) from
// min_elems on, else 1.
inline int threads_for(int64_t elems, int num_threads, int64_t min_elems = PARALLEL_MIN_ELEMS) {
  return elems >= min_elems ? std::max(1, num_threads) : 1;
}

// fn(begin, end) once for each of `parts` near-equal contiguous ranges of [0, n) (at most n of them: no
// range is empty), in parallel: for kernels whose threads each need their own scratch, set up once per
// range rather than per item.
inline void parallel_ranges(int64_t n, int parts, const std::function<void(int64_t, int64_t)>& fn) {
  parts = static_cast<int>(std::min<int64_t>(parts, n));
  if (parts > 0) parallel_for(parts, parts, [&](int64_t part) { fn(n * part / parts, n * (part + 1) / parts); });
}

}  // namespace deepinfer
