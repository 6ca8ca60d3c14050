#include "cpu/thread_pool.h"

#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace deepinfer {
namespace {

// An idle worker spins (pause) this long, then keeps polling between sched_yield() calls, which hand its
// core to any other runnable thread (torch's, in prefill), until YIELD_UNTIL has passed; only then does it
// sleep. Waking a sleeper costs the caller a futex syscall, and on a VM the sleeping vCPU's wake-up can
// outlast a whole small GEMM (measured: a 0.15 ms GEMM at 0.26-0.67 ms when every call woke the worker).
constexpr auto SPIN = std::chrono::microseconds(200);
constexpr auto YIELD_UNTIL = std::chrono::milliseconds(5);

struct Job {
  const std::function<void(int64_t)>* fn;
  int64_t tasks;
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int> seats;  // workers still allowed to join: num_threads - 1 at the start

  Job(const std::function<void(int64_t)>* f, int64_t n, int workers) : fn(f), tasks(n), seats(workers) {}

  // A thread that arrives after the last task was claimed calls nothing, so fn may be gone by then.
  void work() {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      (*fn)(t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

thread_local bool in_pool = false;

struct Pool {
  std::mutex mu;  // guards current, and epoch's changes for the sleepers' condition
  std::condition_variable wake;
  std::shared_ptr<Job> current;
  std::atomic<uint64_t> epoch{0};
  std::mutex submit;  // one job at a time
  std::vector<std::thread> workers;

  void grow(int n) {
    while (static_cast<int>(workers.size()) < n) {
      workers.emplace_back([this] { loop(); });
      workers.back().detach();
    }
  }

  uint64_t wait_past(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; epoch.load(std::memory_order_acquire) == seen; ++i) {
      if (i % 64) {
        _mm_pause();
        continue;
      }
      const auto idle = std::chrono::steady_clock::now() - start;
      if (idle > YIELD_UNTIL) {
        std::unique_lock<std::mutex> lock(mu);
        wake.wait(lock, [&] { return epoch.load(std::memory_order_relaxed) != seen; });
      } else if (idle > SPIN) {
        std::this_thread::yield();
      }
    }
    return epoch.load(std::memory_order_acquire);
  }

  void loop() {
    in_pool = true;
    for (uint64_t seen = 0;;) {
      seen = wait_past(seen);
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu);
        job = current;
      }
      if (job && job->seats.fetch_sub(1, std::memory_order_relaxed) > 0) job->work();
    }
  }

  void run(int64_t tasks, int num_threads, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> one(submit);
    grow(num_threads - 1);
    auto job = std::make_shared<Job>(&fn, tasks, num_threads - 1);
    publish(job);
    job->work();
    // The finished job stays published: a worker that takes it later finds no task and never calls fn.
    while (job->done.load(std::memory_order_acquire) < tasks) _mm_pause();
  }

  void publish(std::shared_ptr<Job> job) {
    {
      std::lock_guard<std::mutex> lock(mu);
      current = std::move(job);
      epoch.fetch_add(1, std::memory_order_release);
    }
    wake.notify_all();
  }
};

// Leaked on purpose: detached workers may still read it while the process exits.
Pool* pool = new Pool();

// A forked child has none of the parent's workers and may have inherited a locked mutex: start afresh.
[[maybe_unused]] const int atfork_registered = pthread_atfork(nullptr, nullptr, [] { pool = new Pool(); });

}  // namespace

void parallel_for(int64_t tasks, int num_threads, const std::function<void(int64_t)>& fn) {
  int threads = static_cast<int>(std::min<int64_t>(num_threads, tasks));
  if (threads <= 1 || in_pool) {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  in_pool = true;
  pool->run(tasks, threads, fn);
  in_pool = false;
}

}  // namespace deepinfer
