#pragma once
// Picks one step type per step (PREFILL or DECODE) and the sequences in it, owns every live
// Sequence, and applies sampled tokens (output processing). Called with the GIL released.
#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/block_manager.h"
#include "engine/sequence.h"

namespace deepinfer {

// NORMAL runs both phases; PROMPT only prefills, then hands each sequence off with its KV;
// COMPLETION only decodes sequences imported with their KV already present.
enum class EngineType { NORMAL, PROMPT, COMPLETION };
enum class StepType { IDLE, PREFILL, DECODE };

struct SchedulerConfig {
  int max_num_seqs = 256;
  int max_num_batched_tokens = 8192;
  int max_model_len = 4096;
  int block_size = 16;
  int num_blocks = 0;
  int num_state_slots = 0;
  // A prefill step takes at most this many tokens of one sequence (0: up to the step's budget), so short
  // prompts share a step with a long prompt's chunk instead of waiting for all of it.
  int long_prefill_token_threshold = 0;
  // Whether a prompt longer than what is left of a step's budget is prefilled in chunks across steps.
  bool chunked_prefill = true;
  EngineType engine_type = EngineType::NORMAL;
  std::vector<int32_t> eos_token_ids;
};

// The flat model inputs of one step. Sequences are in batch order; tokens of sequence i occupy
// [query_start_loc[i], query_start_loc[i+1]) in the flat arrays.
struct ScheduledBatch {
  StepType type = StepType::IDLE;
  std::vector<int64_t> seq_ids;
  std::vector<int64_t> input_ids;       // [T]
  std::vector<int64_t> positions;       // [T]
  std::vector<int64_t> slot_mapping;    // [T] block * block_size + offset
  std::vector<int32_t> query_start_loc; // [B + 1]
  std::vector<int32_t> context_lens;    // [B] tokens in cache after this step
  std::vector<int32_t> block_tables;    // [B, max_blocks] padded with -1
  int max_blocks = 0;
  std::vector<int32_t> state_slots;     // [B]
  std::vector<int32_t> draft_lens;      // [B] draft tokens appended to each sequence's query
  // [B] 1 where a token is drawn for the sequence this step; 0 for a prefill chunk that ends short of the
  // sequence's last token (its logits are not needed, and process() takes no token for it).
  std::vector<uint8_t> sampled;
  std::vector<int64_t> preempted;       // sequences evicted to make room in this step
};

struct StepOutput {
  int64_t seq_id;
  std::vector<int32_t> tokens;  // appended this step (stops cut the rest); empty when the row failed
  bool finished;
  FinishReason reason;
  int32_t stop_token;
};

// What Scheduler::fork leaves the caller to copy: block src -> dst, state slot src -> dst (-1: nothing).
struct ForkCopy {
  int src_block = -1, dst_block = -1, src_slot = -1, dst_slot = -1;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);

  // num_cached_tokens: a prefix (whole blocks, short of the last prompt token) whose KV the caller writes
  // into the first blocks of block_table(seq_id) when the sequence is first scheduled (a prefix-store hit);
  // its prefill starts after it. A preempted sequence recomputes from token 0.
  void add_sequence(int64_t seq_id, const std::vector<int32_t>& prompt, const SamplingLimits& limits,
                    int num_cached_tokens = 0);
  // COMPLETION: admit a prefilled sequence (tokens = prompt + first sampled token). Returns false if
  // blocks or a state slot are short; on success the caller copies its KV into block_table(seq_id).
  bool import_sequence(int64_t seq_id, const std::vector<int32_t>& tokens, int num_prompt_tokens,
                       const SamplingLimits& limits);
  // want = IDLE picks the type (prefill first when anything can be admitted); PREFILL or DECODE
  // forces it, as a DP group's vote does, returning an IDLE batch when nothing of that type fits.
  ScheduledBatch schedule(StepType want = StepType::IDLE);
  // Whether the head of the waiting queue would be admitted by a prefill step now.
  bool can_prefill() const;
  // Applies one sampled token per sampled sequence, in batch order (-1 marks a failed row, finished with
  // ERROR). Returns one StepOutput per scheduled sequence (no tokens for an unsampled prefill chunk).
  std::vector<StepOutput> process(const ScheduledBatch& batch, const std::vector<int32_t>& tokens);
  // Async scheduling, for the decode step `flight` whose forward runs now: a DECODE step for its sequences,
  // each fed the token `flight` samples for it (input id -1 until complete_ahead). IDLE when the next step must
  // wait for process(flight): something could prefill, a running sequence is not in flight, drafts ride along,
  // or the pool is short (an ahead step never evicts). Sequences that `flight`'s token ends by length are left out.
  ScheduledBatch schedule_ahead(const ScheduledBatch& flight);
  // After process(flight): drops the rows of sequences that ended in it (their blocks return now) and feeds
  // every other row the token just appended. The batch is IDLE when no row is left.
  void complete_ahead(ScheduledBatch& ahead);
  // A scheduled step that will never be processed (its forward failed): counts its rows as processed
  // without tokens; the caller then ends its sequences.
  void discard(const ScheduledBatch& batch);
  // Per scheduled sequence the accepted drafts plus one target token ({-1}: failed; {} when unsampled).
  // Rejected drafts are rolled back: their KV slots count as not computed and surplus blocks return.
  std::vector<StepOutput> process_multi(const ScheduledBatch& batch,
                                        const std::vector<std::vector<int32_t>>& tokens);
  // Drafts to verify in the next decode step for a running sequence (replaces earlier ones).
  void set_drafts(int64_t seq_id, const std::vector<int32_t>& drafts);
  // Ends a sequence from outside (stop string, abort, error); frees its blocks and slot, or, while a step
  // that writes its KV is in flight, when that step is processed (its row there is void).
  void finish(int64_t seq_id, FinishReason reason);
  // PROMPT: drops the scheduler's hold on a handed-off sequence once its KV has been exported.
  void release(int64_t seq_id);
  // Beam search, between steps: a running sequence whose newest token is drawn but not yet computed goes on as
  // child_id too, with last_token in that token's place. The child shares the parent's full KV blocks; the
  // partial block after them and the state slot are its own, and the caller copies the parent's into them.
  ForkCopy fork(int64_t parent_id, int64_t child_id, int32_t last_token);
  // Parallel sampling (n > 1), after the forward of the step that computes parent_id's prompt and before its
  // process(): child_id is another sample of the same prompt, `token` its first output (-1: a failed row). It
  // shares the parent's full prompt blocks, its partial block and state slot its own (ForkCopy, for the caller to
  // copy before process()); with max_num_seqs, slots or blocks short it waits to recompute, as an evicted sequence
  // does. A first token that ends it (EOS, stop token, length, -1) ends it here, holding nothing: the StepOutput
  // says so, as process() would have.
  std::pair<StepOutput, ForkCopy> add_sibling(int64_t parent_id, int64_t child_id, int32_t token);
  // Beam search, between steps: replaces a running sequence's newest token (drawn, not yet computed).
  void set_last_token(int64_t seq_id, int32_t token);

  const Sequence& sequence(int64_t seq_id) const;
  std::vector<int64_t> running_ids() const;
  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  int num_running() const { return static_cast<int>(running_.size()); }
  int num_free_state_slots() const { return static_cast<int>(free_slots_.size()); }
  int64_t num_preemptions() const { return num_preemptions_; }
  BlockManager& block_manager() { return blocks_; }
  const SchedulerConfig& config() const { return config_; }
  // Throws if any block, slot or queue invariant is broken.
  void check_invariants() const;

 private:
  bool schedule_prefill(ScheduledBatch& batch);
  bool schedule_decode(ScheduledBatch& batch);
  std::vector<Sequence*> prefilling() const;
  int chunk_for(const Sequence* seq, int budget) const;
  bool grow_for_chunk(Sequence* seq, int chunk, bool may_evict, ScheduledBatch& batch);
  void preempt(Sequence* seq, ScheduledBatch& batch);
  void release_resources(Sequence* seq);
  // Frees a FINISHED sequence once no scheduled step of it is left unprocessed.
  void erase_if_done(Sequence* seq);
  // chunks[i]: tokens of seqs[i] this step, from its first uncomputed one. ahead: each sequence has a step in
  // flight whose sampled token (not yet appended) is the first of its chunk.
  void prepare_inputs(ScheduledBatch& batch, const std::vector<Sequence*>& seqs, const std::vector<int>& chunks,
                      bool ahead = false);
  bool append_token(Sequence* seq, int32_t token);
  // A step's tokens for seq ({-1, ...}: its row failed, an ERROR), appended until one ends it, into res.
  void apply_tokens(Sequence* seq, const std::vector<int32_t>& tokens, StepOutput& res);
  // A copy of parent as child_id, waiting, holding no blocks or slot and no step (fork, add_sibling).
  std::unique_ptr<Sequence> new_child(const Sequence& parent, int64_t child_id);
  // Gives child (not yet in seqs_) parent's computed KV and runs it: the full blocks shared, the partial block and
  // a state slot its own, to be copied from the parent's (copy). False, taking nothing, where max_num_seqs, slots
  // or blocks are short.
  bool share_computed(const Sequence& parent, Sequence* child, ForkCopy& copy);
  // The running sequence seq_id between steps, its newest token drawn and not yet computed (fork, set_last_token).
  Sequence* drawn_between_steps(int64_t seq_id) const;
  void remove_running(Sequence* seq);
  Sequence* lookup(int64_t seq_id) const;

  SchedulerConfig config_;
  BlockManager blocks_;
  std::vector<int> free_slots_;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> seqs_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;
  int64_t next_arrival_ = 0;
  int64_t num_preemptions_ = 0;
};

}  // namespace deepinfer
