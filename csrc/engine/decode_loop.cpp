#include "engine/decode_loop.h"

#include <unordered_map>
#include <utility>

#include "cpu/sampling.h"
#include "cpu/scratch.h"
#include "engine/check.h"

namespace deepinfer {
namespace {

// Row i of `all` for each of batch's rows (row_of: sequence -> i), at offset generated[i].
Draws step_draws(const Draws& all, const std::unordered_map<int64_t, size_t>& row_of,
                 const std::vector<int64_t>& generated, const ScheduledBatch& batch) {
  Draws d;
  for (const int64_t seq : batch.seq_ids) {
    const size_t i = row_of.at(seq);
    d.temperature.push_back(all.temperature[i]);
    d.top_p.push_back(all.top_p[i]);
    d.min_p.push_back(all.min_p[i]);
    d.top_k.push_back(all.top_k[i]);
    d.seeds.push_back(all.seeds[i]);
    d.offsets.push_back(generated[i]);
  }
  return d;
}

// tokens [T]: sample_tokens' draw from logits [T, V] with draws; a row whose greedy token is -1 (NaN or inf
// logits) stays -1.
void draw_tokens(const float* logits, int64_t T, int64_t V, const Draws& draws, int num_threads, int64_t* tokens) {
  std::vector<float> temperature = draws.temperature;
  for (int64_t b = 0; b < T; ++b)
    if (tokens[b] < 0) temperature[b] = 0.0f;  // its argmax: no filter reads the non-finite values
  std::vector<int64_t> drawn(T);
  sample_tokens(logits, T, V, temperature.data(), draws.top_k.data(), draws.top_p.data(), draws.min_p.data(),
                draws.seeds.data(), draws.offsets.data(), drawn.data(), num_threads);
  for (int64_t b = 0; b < T; ++b)
    if (tokens[b] >= 0) tokens[b] = drawn[b];
}

// logprobs' arrays for T rows, filled from logits [T, V] at the drawn tokens.
void fill_logprobs(const float* logits, int64_t T, int64_t V, const int64_t* tokens, int num_threads,
                   StepLogprobs& lp) {
  const int64_t n = lp.n;
  lp.token_logprob.assign(T, 0.0f);
  lp.rank.assign(T, 0);
  lp.top_ids.assign(T * n, -1);
  lp.top_logprobs.assign(T * n, 0.0f);
  token_logprobs(logits, T, V, tokens, n, lp.token_logprob.data(), lp.rank.data(), lp.top_ids.data(),
                 lp.top_logprobs.data(), num_threads);
}

}  // namespace

DecodeStatus decode_drawn(const DecoderStack& stack, const ScheduledBatch& batch, const Draws& draws,
                          int64_t* counts, bool bf16, int num_threads, int64_t* tokens, StepLogprobs* logprobs) {
  const auto T = static_cast<int64_t>(batch.seq_ids.size());
  DI_CHECK(batch.type == StepType::DECODE && static_cast<int64_t>(batch.input_ids.size()) == T && stack.head,
           "decode_drawn takes a decode batch of one token per sequence and a stack with a head");
  DI_CHECK(draws.empty() || static_cast<int64_t>(draws.temperature.size()) == T, "one draw per row");
  // The kernels read int64 tables and lengths; the scheduler keeps them as int32.
  const std::vector<int64_t> lens(batch.context_lens.begin(), batch.context_lens.end());
  const std::vector<int64_t> tables(batch.block_tables.begin(), batch.block_tables.end());
  const DecodeBatch inputs{T, batch.positions.data(), batch.slot_mapping.data(), tables.data(), batch.max_blocks,
                           lens.data()};
  ScratchKeep keep;  // the step's layers reuse one set of buffers (cpu_ops.scratch_kept in Python)
  const int64_t row_bytes = stack.layers.at(0).attention->hidden * (bf16 ? 2 : 4);
  const int64_t V = stack.head->vocab;
  Scratch<char> out(ScratchUse::DECODE_OUT, T * row_bytes);
  Scratch<float> logits(ScratchUse::DECODE_LOGITS, T * V);
  const DecodeStatus status = decode_step(stack, batch.input_ids.data(), counts, inputs, bf16, num_threads,
                                          out.data(), logits.data(), tokens);
  if (!status.ok()) return status;
  if (!draws.empty()) draw_tokens(logits.data(), T, V, draws, num_threads, tokens);
  if (logprobs && logprobs->n >= 0) fill_logprobs(logits.data(), T, V, tokens, num_threads, *logprobs);
  return status;
}

LoopSteps run_decode_steps(Scheduler& scheduler, const DecoderStack& stack, ScheduledBatch first, int max_steps,
                           const Draws& draws, int64_t num_logprobs, int64_t* counts, int64_t counts_per_step,
                           bool bf16, int num_threads) {
  DI_CHECK(draws.empty() || draws.temperature.size() == first.seq_ids.size(),
           "a loop's draws have one row per sequence of its first batch");
  std::unordered_map<int64_t, size_t> row_of;
  for (size_t i = 0; i < first.seq_ids.size(); ++i) row_of[first.seq_ids[i]] = i;
  std::vector<int64_t> generated = draws.offsets;
  LoopSteps r;
  ScratchKeep keep;  // and so do the loop's steps
  ScheduledBatch batch = std::move(first);
  for (int k = 0; k < max_steps; ++k) {
    if (k > 0) {
      if (scheduler.num_waiting() > 0 || scheduler.can_prefill()) break;
      batch = scheduler.schedule(StepType::DECODE);
      if (batch.type != StepType::DECODE) {  // nothing fits: the next step (a prefill of the evicted) is Python's
        r.preempted = std::move(batch.preempted);
        break;
      }
    }
    std::vector<int64_t> tokens(batch.seq_ids.size());
    const Draws step = draws.empty() ? Draws{} : step_draws(draws, row_of, generated, batch);
    StepLogprobs logprobs{num_logprobs};
    r.status = decode_drawn(stack, batch, step, counts ? counts + k * counts_per_step : nullptr, bf16, num_threads,
                            tokens.data(), &logprobs);
    if (!r.status.ok()) {
      r.failed = std::move(batch);
      break;
    }
    if (!draws.empty())
      for (const int64_t seq : batch.seq_ids) ++generated[row_of.at(seq)];
    std::vector<StepOutput> outputs = scheduler.process(batch, std::vector<int32_t>(tokens.begin(), tokens.end()));
    r.done.push_back({std::move(batch), std::move(outputs), std::move(logprobs)});
  }
  return r;
}

}  // namespace deepinfer
