#pragma once
// One generation stream: its tokens, where its KV lives (block table, state slot) and its limits.
#include <cstdint>
#include <vector>

namespace deepinfer {

enum class SequenceStatus { WAITING, RUNNING, HANDED_OFF, FINISHED };
enum class FinishReason { NONE, STOP, LENGTH, ABORT, ERROR, HANDOFF };

struct SamplingLimits {
  int max_tokens = 16;
  int min_tokens = 0;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
};

struct Sequence {
  int64_t seq_id = 0;
  int64_t arrival = 0;  // admission order: FCFS prefill and tie-breaks
  std::vector<int32_t> token_ids;
  int num_prompt_tokens = 0;
  // Tokens whose KV is already in the paged pool.
  int num_computed_tokens = 0;
  SequenceStatus status = SequenceStatus::WAITING;
  FinishReason finish_reason = FinishReason::NONE;
  int32_t stop_token = -1;  // the stop_token_ids entry that ended it, else -1
  std::vector<int> block_table;
  int state_slot = -1;
  SamplingLimits limits;
  // Async scheduling runs schedule(N+1) before process(N): schedule_cnt counts steps the sequence
  // was scheduled in, process_cnt steps whose output was applied. Their gap is the steps in flight.
  int64_t schedule_cnt = 0;
  int64_t process_cnt = 0;
  int num_preemptions = 0;
  // Speculative tokens to verify in the next decode step (after the last real token).
  std::vector<int32_t> draft_tokens;

  int num_tokens() const { return static_cast<int>(token_ids.size()); }
  int num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
  // Running, with more than its newest token still to prefill: a chunked prefill under way. With exactly
  // one left the sequence decodes it (a decode step's query is that token).
  bool prefilling() const {
    return status == SequenceStatus::RUNNING && num_computed_tokens < num_tokens() - 1;
  }
};

}  // namespace deepinfer
