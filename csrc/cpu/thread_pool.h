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

// [begin, end) of part `part` of `parts` near-equal contiguous parts of [0, n).
inline void split_range(int64_t n, int64_t parts, int64_t part, int64_t* begin, int64_t* end) {
  *begin = n * part / parts;
  *end = n * (part + 1) / parts;
}

}  // namespace deepinfer
