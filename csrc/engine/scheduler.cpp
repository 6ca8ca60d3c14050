#include "engine/scheduler.h"

#include <algorithm>
#include <string>

#include "engine/check.h"

namespace deepinfer {

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config), blocks_(config.num_blocks, config.block_size) {
  DI_REQUIRE(config.max_num_seqs > 0, "max_num_seqs must be positive");
  DI_REQUIRE(config.num_state_slots >= config.max_num_seqs,
             "num_state_slots must be at least max_num_seqs");
  DI_REQUIRE(config.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive");
  DI_REQUIRE(config.chunked_prefill || config.max_num_batched_tokens >= config.max_model_len,
             "max_num_batched_tokens must be at least max_model_len when prefill is not chunked");
  DI_REQUIRE(static_cast<int64_t>(config.num_blocks) * config.block_size >= config.max_model_len,
             "the KV pool must hold one max_model_len sequence");
  for (int s = config.num_state_slots - 1; s >= 0; --s) free_slots_.push_back(s);
}

Sequence* Scheduler::lookup(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  DI_REQUIRE(it != seqs_.end(), "unknown sequence " + std::to_string(seq_id));
  return it->second.get();
}

const Sequence& Scheduler::sequence(int64_t seq_id) const { return *lookup(seq_id); }

std::vector<int64_t> Scheduler::running_ids() const {
  std::vector<int64_t> ids;
  for (const Sequence* s : running_) ids.push_back(s->seq_id);
  return ids;
}

void Scheduler::add_sequence(int64_t seq_id, const std::vector<int32_t>& prompt,
                             const SamplingLimits& limits, int num_cached_tokens) {
  DI_REQUIRE(config_.engine_type != EngineType::COMPLETION,
             "a COMPLETION engine only accepts imported sequences");
  DI_REQUIRE(!seqs_.count(seq_id), "sequence " + std::to_string(seq_id) + " already exists");
  DI_REQUIRE(!prompt.empty(), "sequence " + std::to_string(seq_id) + " has an empty prompt");
  DI_REQUIRE(static_cast<int>(prompt.size()) < config_.max_model_len,
             "sequence " + std::to_string(seq_id) + " prompt does not fit max_model_len");
  DI_REQUIRE(num_cached_tokens >= 0 && num_cached_tokens < static_cast<int>(prompt.size()) &&
                 num_cached_tokens % config_.block_size == 0,
             "sequence " + std::to_string(seq_id) + ": a cached prefix is whole blocks short of the last prompt token");
  auto seq = std::make_unique<Sequence>();
  seq->seq_id = seq_id;
  seq->arrival = next_arrival_++;
  seq->token_ids = prompt;
  seq->num_prompt_tokens = static_cast<int>(prompt.size());
  seq->num_computed_tokens = num_cached_tokens;
  seq->limits = limits;
  waiting_.push_back(seq.get());
  seqs_.emplace(seq_id, std::move(seq));
}

bool Scheduler::import_sequence(int64_t seq_id, const std::vector<int32_t>& tokens,
                                int num_prompt_tokens, const SamplingLimits& limits) {
  DI_REQUIRE(config_.engine_type == EngineType::COMPLETION, "only a COMPLETION engine imports");
  DI_REQUIRE(!seqs_.count(seq_id), "sequence " + std::to_string(seq_id) + " already exists");
  DI_REQUIRE(num_prompt_tokens > 0 && num_prompt_tokens < static_cast<int>(tokens.size()),
             "an imported sequence needs its prompt and at least one sampled token");
  if (static_cast<int>(running_.size()) >= config_.max_num_seqs || free_slots_.empty()) return false;
  if (!blocks_.can_allocate(blocks_.blocks_for(static_cast<int>(tokens.size())))) return false;
  auto seq = std::make_unique<Sequence>();
  seq->seq_id = seq_id;
  seq->arrival = next_arrival_++;
  seq->token_ids = tokens;
  seq->num_prompt_tokens = num_prompt_tokens;
  // The KV of every token but the last sampled one arrives with the sequence.
  seq->num_computed_tokens = static_cast<int>(tokens.size()) - 1;
  seq->limits = limits;
  seq->status = SequenceStatus::RUNNING;
  seq->block_table = blocks_.allocate(blocks_.blocks_for(seq->num_computed_tokens));
  seq->state_slot = free_slots_.back();
  free_slots_.pop_back();
  running_.push_back(seq.get());
  seqs_.emplace(seq_id, std::move(seq));
  return true;
}

ScheduledBatch Scheduler::schedule(StepType want) {
  ScheduledBatch batch;
  bool may_prefill = config_.engine_type != EngineType::COMPLETION && want != StepType::DECODE;
  bool may_decode = config_.engine_type != EngineType::PROMPT && want != StepType::PREFILL;
  if (may_prefill && schedule_prefill(batch)) return batch;
  // A decode step that fits no one may still have evicted sequences: their blocks let a prefill run now.
  if (may_decode && !schedule_decode(batch) && may_prefill && !batch.preempted.empty()) schedule_prefill(batch);
  return batch;
}

bool Scheduler::can_prefill() const {
  if (config_.engine_type == EngineType::COMPLETION) return false;
  for (const Sequence* seq : running_)
    if (seq->prefilling()) return true;
  if (waiting_.empty()) return false;
  const Sequence* seq = waiting_.front();
  const int chunk = chunk_for(seq, config_.max_num_batched_tokens);
  return static_cast<int>(running_.size()) < config_.max_num_seqs && !free_slots_.empty() && chunk > 0 &&
         blocks_.can_allocate(blocks_.blocks_for(seq->num_computed_tokens + chunk));
}

std::vector<Sequence*> Scheduler::prefilling() const {
  std::vector<Sequence*> out;
  for (Sequence* seq : running_)
    if (seq->prefilling()) out.push_back(seq);
  std::sort(out.begin(), out.end(), [](const Sequence* a, const Sequence* b) { return a->arrival < b->arrival; });
  return out;
}

// Tokens of seq a prefill step with `budget` tokens left takes: all that are left, or with chunking as many as
// the budget and the per-sequence threshold allow (0: it waits for a later step).
int Scheduler::chunk_for(const Sequence* seq, int budget) const {
  const int left = seq->num_tokens() - seq->num_computed_tokens;
  if (!config_.chunked_prefill) return left <= budget ? left : 0;
  const int cap = config_.long_prefill_token_threshold > 0 ? config_.long_prefill_token_threshold : budget;
  return std::min({left, budget, cap});
}

// Grows a chunked prefill's blocks; when the pool is short and may_evict (nothing else is in the step yet), the
// newest other chunked prefills are evicted (they would hold blocks no one can use while the oldest waits).
bool Scheduler::grow_for_chunk(Sequence* seq, int chunk, bool may_evict, ScheduledBatch& batch) {
  while (!blocks_.append(seq->block_table, seq->num_computed_tokens + chunk)) {
    if (!may_evict) return false;
    std::vector<Sequence*> others = prefilling();
    if (others.empty() || others.back() == seq) return false;
    remove_running(others.back());
    preempt(others.back(), batch);
  }
  return true;
}

bool Scheduler::schedule_prefill(ScheduledBatch& batch) {
  std::vector<Sequence*> picked;
  std::vector<int> chunks;
  int budget = config_.max_num_batched_tokens;
  // Chunked prefills under way go first, oldest first: they already hold blocks and a state slot.
  for (Sequence* seq : prefilling()) {
    if (!seq->prefilling()) continue;  // evicted by an older one's grow_for_chunk
    const int chunk = chunk_for(seq, budget);
    if (chunk == 0 || !grow_for_chunk(seq, chunk, picked.empty(), batch)) break;
    picked.push_back(seq);
    chunks.push_back(chunk);
    budget -= chunk;
  }
  while (!waiting_.empty() && budget > 0) {
    Sequence* seq = waiting_.front();
    const int chunk = chunk_for(seq, budget);
    if (chunk == 0 || static_cast<int>(running_.size()) >= config_.max_num_seqs) break;
    if (free_slots_.empty() || !blocks_.append(seq->block_table, seq->num_computed_tokens + chunk)) break;
    waiting_.pop_front();
    seq->state_slot = free_slots_.back();
    free_slots_.pop_back();
    seq->status = SequenceStatus::RUNNING;
    running_.push_back(seq);
    picked.push_back(seq);
    chunks.push_back(chunk);
    budget -= chunk;
  }
  if (picked.empty()) return false;
  batch.type = StepType::PREFILL;
  prepare_inputs(batch, picked, chunks);
  return true;
}

bool Scheduler::schedule_decode(ScheduledBatch& batch) {
  // Shortest output first: short sequences finish soonest and free their blocks; when blocks run
  // out the longest-output sequences are evicted, since recomputing them later costs the most but
  // holding them starves everyone else.
  std::stable_sort(running_.begin(), running_.end(), [](const Sequence* a, const Sequence* b) {
    if (a->num_output_tokens() != b->num_output_tokens())
      return a->num_output_tokens() < b->num_output_tokens();
    return a->arrival < b->arrival;
  });
  std::vector<Sequence*> picked;
  size_t last = running_.size();
  for (size_t i = 0; i < last; ++i) {
    Sequence* seq = running_[i];
    if (seq->prefilling()) continue;  // its next step is a prefill chunk
    // Drafts ride along only if their blocks are free: speculation never evicts anyone.
    if (!seq->draft_tokens.empty() &&
        !blocks_.append(seq->block_table, seq->num_tokens() + static_cast<int>(seq->draft_tokens.size())))
      seq->draft_tokens.clear();
    bool ok = blocks_.append(seq->block_table, seq->num_tokens());
    while (!ok && last > i + 1) {
      preempt(running_[--last], batch);
      ok = blocks_.append(seq->block_table, seq->num_tokens());
    }
    if (ok) {
      picked.push_back(seq);
    } else {  // nothing left to evict but itself
      preempt(seq, batch);
      --last;
    }
  }
  running_.resize(last);
  if (picked.empty()) return false;
  batch.type = StepType::DECODE;
  prepare_inputs(batch, picked, std::vector<int>(picked.size(), 1));
  return true;
}

ScheduledBatch Scheduler::schedule_ahead(const ScheduledBatch& flight) {
  ScheduledBatch batch;
  const bool drafts = std::any_of(flight.draft_lens.begin(), flight.draft_lens.end(), [](int32_t d) { return d > 0; });
  if (flight.type != StepType::DECODE || drafts || config_.engine_type == EngineType::PROMPT || can_prefill())
    return batch;
  std::vector<Sequence*> picked;
  for (Sequence* seq : running_) {
    if (seq->schedule_cnt != seq->process_cnt + 1 || !seq->draft_tokens.empty()) return batch;
    const int with_token = seq->num_tokens() + 1;
    if (seq->num_output_tokens() + 1 >= seq->limits.max_tokens || with_token >= config_.max_model_len) continue;
    // Blocks grown here are the ones the next schedule() would grow: nothing is lost if this gives up.
    if (!blocks_.append(seq->block_table, with_token)) return batch;
    picked.push_back(seq);
  }
  if (picked.empty()) return batch;
  batch.type = StepType::DECODE;
  prepare_inputs(batch, picked, std::vector<int>(picked.size(), 1), true);
  return batch;
}

void Scheduler::complete_ahead(ScheduledBatch& ahead) {
  ScheduledBatch kept;
  kept.max_blocks = ahead.max_blocks;
  kept.query_start_loc.push_back(0);
  for (size_t i = 0; i < ahead.seq_ids.size(); ++i) {
    Sequence* seq = lookup(ahead.seq_ids[i]);
    if (seq->status == SequenceStatus::FINISHED) {
      ++seq->process_cnt;
      erase_if_done(seq);
      continue;
    }
    DI_CHECK(seq->schedule_cnt == seq->process_cnt + 1 && ahead.positions[i] == seq->num_tokens() - 1,
             "ahead row out of step with its sequence");
    kept.seq_ids.push_back(seq->seq_id);
    kept.input_ids.push_back(seq->token_ids.back());
    kept.positions.push_back(ahead.positions[i]);
    kept.slot_mapping.push_back(ahead.slot_mapping[i]);
    kept.query_start_loc.push_back(static_cast<int32_t>(kept.input_ids.size()));
    kept.context_lens.push_back(ahead.context_lens[i]);
    kept.state_slots.push_back(ahead.state_slots[i]);
    kept.draft_lens.push_back(0);
    kept.sampled.push_back(1);
    auto row = ahead.block_tables.begin() + i * ahead.max_blocks;
    kept.block_tables.insert(kept.block_tables.end(), row, row + ahead.max_blocks);
  }
  kept.type = kept.seq_ids.empty() ? StepType::IDLE : StepType::DECODE;
  ahead = std::move(kept);
}

void Scheduler::discard(const ScheduledBatch& batch) {
  for (int64_t seq_id : batch.seq_ids) {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) continue;
    ++it->second->process_cnt;
    erase_if_done(it->second.get());
  }
}

void Scheduler::preempt(Sequence* seq, ScheduledBatch& batch) {
  release_resources(seq);
  seq->draft_tokens.clear();
  seq->status = SequenceStatus::WAITING;
  seq->num_computed_tokens = 0;
  ++seq->num_preemptions;
  ++num_preemptions_;
  waiting_.push_front(seq);
  batch.preempted.push_back(seq->seq_id);
}

void Scheduler::release_resources(Sequence* seq) {
  blocks_.free(seq->block_table);
  seq->block_table.clear();
  if (seq->state_slot >= 0) free_slots_.push_back(seq->state_slot);
  seq->state_slot = -1;
}

void Scheduler::prepare_inputs(ScheduledBatch& batch, const std::vector<Sequence*>& seqs,
                               const std::vector<int>& chunks, bool ahead) {
  const int bs = config_.block_size;
  batch.query_start_loc.push_back(0);
  for (Sequence* seq : seqs) {
    batch.max_blocks = std::max(batch.max_blocks, static_cast<int>(seq->block_table.size()));
  }
  batch.block_tables.assign(seqs.size() * batch.max_blocks, -1);
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence* seq = seqs[i];
    // ahead: one token sampled in flight, not yet appended
    DI_CHECK(seq->schedule_cnt == seq->process_cnt + ahead, "sequence scheduled twice before processing");
    const int end = seq->num_computed_tokens + chunks[i];
    DI_CHECK(chunks[i] > 0 && end <= seq->num_tokens() + ahead, "chunk outside the sequence");
    for (int pos = seq->num_computed_tokens; pos < end; ++pos) {
      batch.input_ids.push_back(pos < seq->num_tokens() ? seq->token_ids[pos] : -1);
      batch.positions.push_back(pos);
      batch.slot_mapping.push_back(static_cast<int64_t>(seq->block_table[pos / bs]) * bs + pos % bs);
    }
    const bool sampled = end >= seq->num_tokens();
    if (!sampled) seq->draft_tokens.clear();  // drafts follow the last token only
    for (size_t j = 0; j < seq->draft_tokens.size(); ++j) {
      int pos = seq->num_tokens() + static_cast<int>(j);
      batch.input_ids.push_back(seq->draft_tokens[j]);
      batch.positions.push_back(pos);
      batch.slot_mapping.push_back(static_cast<int64_t>(seq->block_table[pos / bs]) * bs + pos % bs);
    }
    batch.draft_lens.push_back(static_cast<int32_t>(seq->draft_tokens.size()));
    batch.sampled.push_back(sampled);
    seq->draft_tokens.clear();
    seq->num_computed_tokens = end;
    ++seq->schedule_cnt;
    batch.seq_ids.push_back(seq->seq_id);
    batch.query_start_loc.push_back(static_cast<int32_t>(batch.input_ids.size()));
    batch.context_lens.push_back(end + batch.draft_lens.back());
    batch.state_slots.push_back(seq->state_slot);
    std::copy(seq->block_table.begin(), seq->block_table.end(),
              batch.block_tables.begin() + i * batch.max_blocks);
  }
}

// Appends a sampled token and returns whether the sequence is now finished. EOS and stop tokens
// are ignored until min_tokens outputs exist, as in vLLM.
bool Scheduler::append_token(Sequence* seq, int32_t token) {
  seq->token_ids.push_back(token);
  const SamplingLimits& lim = seq->limits;
  int n_out = seq->num_output_tokens();
  if (n_out >= lim.min_tokens) {
    const auto& eos = config_.eos_token_ids;
    if (!lim.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) {
      seq->finish_reason = FinishReason::STOP;
      return true;
    }
    const auto& stops = lim.stop_token_ids;
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
      seq->finish_reason = FinishReason::STOP;
      seq->stop_token = token;
      return true;
    }
  }
  if (n_out >= lim.max_tokens || seq->num_tokens() >= config_.max_model_len) {
    seq->finish_reason = FinishReason::LENGTH;
    return true;
  }
  return false;
}

void Scheduler::apply_tokens(Sequence* seq, const std::vector<int32_t>& tokens, StepOutput& res) {
  if (tokens[0] < 0) {
    seq->finish_reason = FinishReason::ERROR;
    res.finished = true;
  }
  for (size_t j = 0; j < tokens.size() && !res.finished; ++j) {
    res.tokens.push_back(tokens[j]);
    res.finished = append_token(seq, tokens[j]);
  }
}

std::vector<StepOutput> Scheduler::process(const ScheduledBatch& batch,
                                           const std::vector<int32_t>& tokens) {
  std::vector<std::vector<int32_t>> per_seq;
  per_seq.reserve(batch.seq_ids.size());
  size_t next = 0;
  for (uint8_t sampled : batch.sampled) {
    DI_REQUIRE(!sampled || next < tokens.size(), "fewer tokens than sampled sequences");
    per_seq.push_back(sampled ? std::vector<int32_t>{tokens[next++]} : std::vector<int32_t>{});
  }
  DI_REQUIRE(next == tokens.size(), "more tokens than sampled sequences");
  return process_multi(batch, per_seq);
}

std::vector<StepOutput> Scheduler::process_multi(const ScheduledBatch& batch,
                                                 const std::vector<std::vector<int32_t>>& tokens) {
  DI_REQUIRE(tokens.size() == batch.seq_ids.size(), "one token list per scheduled sequence");
  std::vector<StepOutput> out;
  out.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    Sequence* seq = lookup(batch.seq_ids[i]);
    const int drafts = batch.draft_lens.empty() ? 0 : batch.draft_lens[i];
    ++seq->process_cnt;
    const bool ahead = seq->schedule_cnt > seq->process_cnt;  // its next step is scheduled already
    StepOutput res{seq->seq_id, {}, false, FinishReason::NONE, -1};
    if (seq->status == SequenceStatus::FINISHED) {  // ended while this step ran: the row is void
      res.finished = true;
      res.reason = seq->finish_reason;
      out.push_back(res);
      erase_if_done(seq);
      continue;
    }
    if (!batch.sampled[i]) {  // a prefill chunk short of the last token: nothing drawn, nothing to apply
      DI_REQUIRE(tokens[i].empty(), "sequence " + std::to_string(seq->seq_id) + ": a token for an unsampled chunk");
      out.push_back(res);
      continue;
    }
    DI_REQUIRE(!tokens[i].empty() && static_cast<int>(tokens[i].size()) <= drafts + 1,
               "sequence " + std::to_string(seq->seq_id) + ": between 1 and drafts + 1 tokens per step");
    apply_tokens(seq, tokens[i], res);
    if (!res.finished && !ahead) {
      // KV exists for every token but the newest; rejected drafts' slots are simply overwritten later.
      seq->num_computed_tokens = seq->num_tokens() - 1;
      int keep = blocks_.blocks_for(seq->num_tokens());
      if (static_cast<int>(seq->block_table.size()) > keep) {
        blocks_.free(std::vector<int>(seq->block_table.begin() + keep, seq->block_table.end()));
        seq->block_table.resize(keep);
      }
      if (config_.engine_type == EngineType::PROMPT) {
        seq->finish_reason = FinishReason::HANDOFF;
        res.finished = true;
      }
    }
    res.reason = seq->finish_reason;
    res.stop_token = seq->stop_token;
    out.push_back(res);
    if (res.finished) finish(seq->seq_id, seq->finish_reason);
  }
  DI_CHECK((check_invariants(), true), "");
  return out;
}

void Scheduler::set_drafts(int64_t seq_id, const std::vector<int32_t>& drafts) {
  Sequence* seq = lookup(seq_id);
  DI_REQUIRE(seq->status == SequenceStatus::RUNNING, "drafts only for running sequences");
  if (seq->prefilling()) return;  // drafts follow the last token, which a later chunk reaches
  int room = config_.max_model_len - seq->num_tokens() - 1;
  seq->draft_tokens.assign(drafts.begin(), drafts.begin() + std::max(0, std::min<int>(room, drafts.size())));
}

void Scheduler::remove_running(Sequence* seq) {
  auto it = std::find(running_.begin(), running_.end(), seq);
  if (it != running_.end()) running_.erase(it);
  auto wt = std::find(waiting_.begin(), waiting_.end(), seq);
  if (wt != waiting_.end()) waiting_.erase(wt);
}

void Scheduler::finish(int64_t seq_id, FinishReason reason) {
  Sequence* seq = lookup(seq_id);
  DI_REQUIRE(seq->status != SequenceStatus::HANDED_OFF, "a handed-off sequence is released, not finished");
  remove_running(seq);
  seq->finish_reason = reason;
  if (reason == FinishReason::HANDOFF) {
    // The exporter still reads these blocks; release() frees them.
    seq->status = SequenceStatus::HANDED_OFF;
    return;
  }
  seq->status = SequenceStatus::FINISHED;
  erase_if_done(seq);
}

void Scheduler::erase_if_done(Sequence* seq) {
  if (seq->status != SequenceStatus::FINISHED || seq->schedule_cnt != seq->process_cnt) return;
  release_resources(seq);
  seqs_.erase(seq->seq_id);
}

void Scheduler::release(int64_t seq_id) {
  Sequence* seq = lookup(seq_id);
  DI_REQUIRE(seq->status == SequenceStatus::HANDED_OFF,
             "sequence " + std::to_string(seq_id) + " was not handed off");
  release_resources(seq);
  seqs_.erase(seq_id);
}

Sequence* Scheduler::drawn_between_steps(int64_t seq_id) const {
  Sequence* seq = lookup(seq_id);
  const std::string name = "sequence " + std::to_string(seq_id);
  DI_REQUIRE(seq->status == SequenceStatus::RUNNING && seq->finish_reason == FinishReason::NONE,
             name + " is not running");
  DI_REQUIRE(seq->schedule_cnt == seq->process_cnt, name + " has a step in flight");
  DI_REQUIRE(seq->num_output_tokens() > 0 && seq->num_computed_tokens == seq->num_tokens() - 1 &&
                 seq->draft_tokens.empty(),
             name + " has no drawn token waiting for its step");
  return seq;
}

std::unique_ptr<Sequence> Scheduler::new_child(const Sequence& parent, int64_t child_id) {
  DI_REQUIRE(!seqs_.count(child_id), "sequence " + std::to_string(child_id) + " already exists");
  auto child = std::make_unique<Sequence>(parent);
  child->seq_id = child_id;
  child->arrival = next_arrival_++;
  child->schedule_cnt = child->process_cnt = 0;
  child->num_preemptions = 0;
  child->status = SequenceStatus::WAITING;
  child->block_table.clear();
  child->state_slot = -1;
  child->draft_tokens.clear();
  return child;
}

bool Scheduler::share_computed(const Sequence& parent, Sequence* child, ForkCopy& copy) {
  const int bs = config_.block_size, full = parent.num_computed_tokens / bs;
  const bool partial = parent.num_computed_tokens % bs != 0;
  if (static_cast<int>(running_.size()) >= config_.max_num_seqs || free_slots_.empty() ||
      !blocks_.can_allocate(partial ? 1 : 0))
    return false;
  DI_CHECK(static_cast<int>(parent.block_table.size()) >= full + (partial ? 1 : 0), "parent's blocks short");
  child->num_computed_tokens = parent.num_computed_tokens;
  child->block_table.assign(parent.block_table.begin(), parent.block_table.begin() + full);
  blocks_.incref(child->block_table);
  if (partial) {
    copy.src_block = parent.block_table[full];
    copy.dst_block = blocks_.allocate(1)[0];
    child->block_table.push_back(copy.dst_block);
  }
  copy.src_slot = parent.state_slot;
  copy.dst_slot = child->state_slot = free_slots_.back();
  free_slots_.pop_back();
  child->status = SequenceStatus::RUNNING;
  running_.push_back(child);
  return true;
}

ForkCopy Scheduler::fork(int64_t parent_id, int64_t child_id, int32_t last_token) {
  const Sequence* parent = drawn_between_steps(parent_id);
  auto child = new_child(*parent, child_id);
  child->token_ids.back() = last_token;
  ForkCopy copy;
  DI_REQUIRE(share_computed(*parent, child.get(), copy),
             "no room to fork sequence " + std::to_string(parent_id) + " (max_num_seqs, state slots or KV blocks)");
  seqs_.emplace(child_id, std::move(child));
  return copy;
}

std::pair<StepOutput, ForkCopy> Scheduler::add_sibling(int64_t parent_id, int64_t child_id, int32_t token) {
  const Sequence* parent = lookup(parent_id);
  DI_REQUIRE(config_.engine_type == EngineType::NORMAL && parent->status == SequenceStatus::RUNNING &&
                 parent->num_output_tokens() == 0 && parent->num_computed_tokens == parent->num_tokens() &&
                 parent->schedule_cnt == parent->process_cnt + 1,
             "sequence " + std::to_string(parent_id) + " has no prompt computed in a step waiting for process()");
  auto child = new_child(*parent, child_id);
  StepOutput res{child_id, {}, false, FinishReason::NONE, -1};
  ForkCopy copy;
  apply_tokens(child.get(), {token}, res);
  res.reason = child->finish_reason;
  res.stop_token = child->stop_token;
  if (res.finished) return {res, copy};  // ended by its first token: it never needs KV
  if (!share_computed(*parent, child.get(), copy)) {  // waits to recompute, as an evicted sequence does
    child->num_computed_tokens = 0;
    waiting_.push_front(child.get());
  }
  seqs_.emplace(child_id, std::move(child));
  DI_CHECK((check_invariants(), true), "");
  return {res, copy};
}

void Scheduler::set_last_token(int64_t seq_id, int32_t token) { drawn_between_steps(seq_id)->token_ids.back() = token; }

void Scheduler::check_invariants() const {
  blocks_.check();
  std::vector<int> owners(blocks_.num_blocks(), 0);
  std::vector<char> slot_used(config_.num_state_slots, 0);
  for (const auto& kv : seqs_) {
    const Sequence& s = *kv.second;
    for (int b : s.block_table) ++owners[b];
    if (s.state_slot >= 0) {
      if (slot_used[s.state_slot]) throw std::logic_error("state slot owned twice");
      slot_used[s.state_slot] = 1;
    }
    if (s.status == SequenceStatus::WAITING && !s.block_table.empty())
      throw std::logic_error("waiting sequence holds blocks");
    if (s.status == SequenceStatus::FINISHED && s.schedule_cnt == s.process_cnt)
      throw std::logic_error("finished sequence outlives its last step");
  }
  for (int b = 0; b < blocks_.num_blocks(); ++b)
    if (owners[b] > blocks_.ref_count(b))
      throw std::logic_error("block " + std::to_string(b) + " has more owners than references");
  size_t used_slots = std::count(slot_used.begin(), slot_used.end(), 1);
  if (used_slots + free_slots_.size() != slot_used.size()) throw std::logic_error("state slot leaked");
  if (waiting_.size() + running_.size() > seqs_.size()) throw std::logic_error("queue holds a dead sequence");
  if (static_cast<int>(running_.size()) > config_.max_num_seqs) throw std::logic_error("too many running");
}

}  // namespace deepinfer
