#pragma once
// A persistent pool for the CPU kernels. OpenMP's fork/join per parallel region costs tens of microseconds
// and, with torch's own OpenMP threads spinning beside ours on 2 vCPUs, made small GEMMs 10-100x slower at
// two threads. Workers here outlive every call, spin briefly for the next job (kernels of one forward come
// back to back), then sleep; the caller works on its own job too, and tasks are claimed from one atomic
// counter, so no thread waits on a barrier for a slower sibling's fixed share.
#include <cstdint>
#include <functional>

namespace deepinfer {

// Runs fn(t) for every t in [0, tasks) on up to num_threads threads, the caller included, and returns
// when all have finished. Nested calls (from inside fn) run serially on the calling thread.
void parallel_for(int64_t tasks, int num_threads, const std::function<void(int64_t)>& fn);

// fn(begin, end) once for each of `parts` near-equal contiguous ranges of [0, n), in parallel: for
// kernels whose threads each need their own scratch, set up once per range rather than per item.
inline void parallel_ranges(int64_t n, int parts, const std::function<void(int64_t, int64_t)>& fn) {
  parallel_for(parts, parts, [&](int64_t part) { fn(n * part / parts, n * (part + 1) / parts); });
}

}  // namespace deepinfer
