#pragma once
// Reference-counted free list of fixed-size KV blocks. No prefix hashing: prefix reuse belongs to
// the front end and the KV store, not the engine.
#include <cstdint>
#include <vector>

namespace deepinfer {

class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size);

  int block_size() const { return block_size_; }
  int num_blocks() const { return static_cast<int>(ref_counts_.size()); }
  int num_free_blocks() const { return static_cast<int>(free_list_.size()); }
  int ref_count(int block) const { return ref_counts_.at(block); }
  // Blocks needed to hold num_tokens tokens.
  int blocks_for(int num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }
  bool can_allocate(int num_blocks) const { return num_blocks <= num_free_blocks(); }

  // Pops n blocks off the free list, each with reference count 1.
  std::vector<int> allocate(int n);
  // Grows a block table so it holds num_tokens tokens. Returns false (and changes nothing) if the
  // pool is short.
  bool append(std::vector<int>& table, int num_tokens);
  // One more owner for each block (a KV exporter holding blocks after a handoff).
  void incref(const std::vector<int>& blocks);
  // Drops one reference per block; a block returns to the free list when its count reaches zero.
  void free(const std::vector<int>& blocks);
  // Throws if counts and the free list disagree (a block both free and referenced, or duplicated).
  void check() const;

 private:
  int block_size_;
  std::vector<int> ref_counts_;
  std::vector<int> free_list_;  // used as a stack: LIFO keeps recently freed blocks warm in cache
};

}  // namespace deepinfer
