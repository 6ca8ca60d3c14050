#pragma once
// Kernel scratch memory. Two costs hide in a plain std::vector per call: malloc's 16-byte alignment (an
// AMX tile row that straddles two cache lines costs two loads: x tiles so placed made the tile loop 1.9x
// slower with the weights in L1), and fresh pages (a malloc of a MiB or more can be a new mmap, or a heap
// top that glibc trims back to the OS on free, so a call faults each 4 KiB page in again: 8% of the
// medium Qwen3-MoE's MoE layers at 64 rows called in a loop; none inside the engine, whose allocation
// history had glibc keep the pages, which is luck this makes a rule).
#include <array>
#include <atomic>
#include <cstddef>
#include <new>
#include <vector>

namespace deepinfer {

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const CacheLineAllocator&) const { return true; }
  bool operator!=(const CacheLineAllocator&) const { return false; }
};

// A std::vector on 64-byte boundaries.
template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// What a Scratch buffer holds: each use has one buffer per thread, so uses that are live at once on one
// thread (a caller's buffer while a kernel it calls takes its own) need different entries.
enum class ScratchUse {
  MOE_ROWS, MOE_OUT, EXPERT_ACT, GEMM_X, GEMM_X_TILES, AMX_TILES, LINEAR_OUT, LAYER_INPUT, LAYER_ATTENTION, ATTENTION_BLOCK,
  DECODE_ATTENTION, DECODE_OUT, DECODE_LOGITS, COUNT
};

// Open keep scopes (keep_scratch): while one is, buffers keep their pages whatever their size.
inline std::atomic<int>& scratch_keepers() {
  static std::atomic<int> n{0};
  return n;
}

// This thread's buffers, one per use, whatever element type a Scratch reads them as.
inline std::array<AlignedVector<char>, static_cast<size_t>(ScratchUse::COUNT)>& scratch_buffers() {
  thread_local std::array<AlignedVector<char>, static_cast<size_t>(ScratchUse::COUNT)> b;
  return b;
}

constexpr size_t SCRATCH_KEEP_BYTES = size_t{16} << 20;

// Frees a buffer grown past SCRATCH_KEEP_BYTES.
inline void trim_scratch(AlignedVector<char>& b) {
  if (b.size() > SCRATCH_KEEP_BYTES) AlignedVector<char>().swap(b);
}

// n elements of T, 64-byte aligned, contents unspecified, from this thread's buffer for `use`; the buffer
// keeps its pages for the next call unless it grew past SCRATCH_KEEP_BYTES while no keep scope is open (a long
// prefill's peak is not pinned past its step; within it every layer's call reuses the pages: freed per call, a
// 4096-token prefill of the medium Qwen3-MoE faulted 0.8M pages in and ran 1.25x slower).
template <class T>
class Scratch {
 public:
  Scratch(ScratchUse use, size_t n) : buf_(scratch_buffers()[static_cast<size_t>(use)]) {
    if (buf_.size() < n * sizeof(T)) buf_.resize(n * sizeof(T));
  }
  ~Scratch() {
    if (scratch_keepers().load(std::memory_order_relaxed) == 0) trim_scratch(buf_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  T* data() const { return reinterpret_cast<T*>(buf_.data()); }

 private:
  AlignedVector<char>& buf_;
};

// Bytes this thread's buffers hold.
inline size_t scratch_bytes() {
  size_t n = 0;
  for (const auto& b : scratch_buffers()) n += b.size();
  return n;
}

// Opens (on) or closes a keep scope; false for a close with none open (nothing changes). Closing the last trims
// the calling thread's buffers; other threads trim theirs at their next use.
inline bool keep_scratch(bool on) {
  auto& open = scratch_keepers();
  if (on) {
    open.fetch_add(1);
    return true;
  }
  int n = open.load();
  while (n > 0 && !open.compare_exchange_weak(n, n - 1)) {
  }
  if (n == 1)
    for (auto& b : scratch_buffers()) trim_scratch(b);
  return n > 0;
}

// A keep scope for the lifetime of this object (keep_scratch): one call's kernels reuse one set of buffers.
class ScratchKeep {
 public:
  ScratchKeep() { keep_scratch(true); }
  ~ScratchKeep() { keep_scratch(false); }
  ScratchKeep(const ScratchKeep&) = delete;
  ScratchKeep& operator=(const ScratchKeep&) = delete;
};

}  // namespace deepinfer
