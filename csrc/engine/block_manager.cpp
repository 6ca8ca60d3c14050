#include "engine/block_manager.h"

#include <string>

#include "engine/check.h"

namespace deepinfer {

BlockManager::BlockManager(int num_blocks, int block_size)
    : block_size_(block_size), ref_counts_(num_blocks, 0) {
  DI_REQUIRE(num_blocks > 0, "num_blocks must be positive");
  DI_REQUIRE(block_size > 0, "block_size must be positive");
  free_list_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) free_list_.push_back(b);
}

std::vector<int> BlockManager::allocate(int n) {
  DI_REQUIRE(n >= 0 && can_allocate(n), "cannot allocate " + std::to_string(n) + " blocks, " +
                                            std::to_string(num_free_blocks()) + " free");
  std::vector<int> blocks(free_list_.end() - n, free_list_.end());
  free_list_.resize(free_list_.size() - n);
  for (int b : blocks) {
    DI_CHECK(ref_counts_[b] == 0, "allocated block was referenced");
    ref_counts_[b] = 1;
  }
  return blocks;
}

bool BlockManager::append(std::vector<int>& table, int num_tokens) {
  int missing = blocks_for(num_tokens) - static_cast<int>(table.size());
  if (missing <= 0) return true;
  if (!can_allocate(missing)) return false;
  std::vector<int> fresh = allocate(missing);
  table.insert(table.end(), fresh.begin(), fresh.end());
  return true;
}

void BlockManager::incref(const std::vector<int>& blocks) {
  for (int b : blocks) {
    DI_REQUIRE(b >= 0 && b < num_blocks(), "block id out of range");
    DI_REQUIRE(ref_counts_[b] > 0, "incref of a free block " + std::to_string(b));
    ++ref_counts_[b];
  }
}

void BlockManager::free(const std::vector<int>& blocks) {
  for (int b : blocks) {
    DI_REQUIRE(b >= 0 && b < num_blocks(), "block id out of range");
    DI_REQUIRE(ref_counts_[b] > 0, "double free of block " + std::to_string(b));
    if (--ref_counts_[b] == 0) free_list_.push_back(b);
  }
}

void BlockManager::check() const {
  std::vector<char> in_free(ref_counts_.size(), 0);
  for (int b : free_list_) {
    if (in_free[b]) throw std::logic_error("block " + std::to_string(b) + " twice in free list");
    if (ref_counts_[b] != 0) throw std::logic_error("free block " + std::to_string(b) + " is referenced");
    in_free[b] = 1;
  }
  for (size_t b = 0; b < ref_counts_.size(); ++b)
    if (!in_free[b] && ref_counts_[b] <= 0)
      throw std::logic_error("block " + std::to_string(b) + " leaked (unreferenced, not free)");
}

}  // namespace deepinfer
