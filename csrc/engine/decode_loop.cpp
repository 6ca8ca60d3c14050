#include "engine/decode_loop.h"

#include <unordered_map>
#include <utility>

#include "cpu/sampling.h"
#include "cpu/scratch.h"
#include "engine/check.h"

namespace deepinfer {
namespace {

// The parameters of one step's rows (sample_tokens' arrays), gathered from the loop's sequences.
struct StepDraws {
  std::vector<float> temperature, top_p, min_p;
  std::vector<int64_t> top_k, seeds, offsets;
};

// decode_greedy, and with draws (one per row) each row's token drawn from its logits by sample_tokens, but for
// a row whose greedy token is -1 (NaN or inf logits, which sample_tokens does not take).
DecodeStatus decode_drawn(const DecoderStack& stack, const ScheduledBatch& batch, int64_t* counts, bool bf16,
                          int num_threads, const StepDraws* draws, int64_t* tokens) {
  const auto T = static_cast<int64_t>(batch.seq_ids.size());
  DI_CHECK(batch.type == StepType::DECODE && static_cast<int64_t>(batch.input_ids.size()) == T && stack.head,
           "decode_greedy takes a decode batch of one token per sequence and a stack with a head");
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
  if (!status.ok() || draws == nullptr) return status;
  std::vector<float> temperature = draws->temperature;
  for (int64_t b = 0; b < T; ++b)
    if (tokens[b] < 0) temperature[b] = 0.0f;  // its argmax: no filter reads the non-finite values
  std::vector<int64_t> drawn(T);
  sample_tokens(logits.data(), T, V, temperature.data(), draws->top_k.data(), draws->top_p.data(),
                draws->min_p.data(), draws->seeds.data(), draws->offsets.data(), drawn.data(), num_threads);
  for (int64_t b = 0; b < T; ++b)
    if (tokens[b] >= 0) tokens[b] = drawn[b];
  return status;
}

// Row i of the loop's sequences for each of batch's rows, at offset `generated[i]`.
StepDraws step_draws(const LoopSampling& s, const std::unordered_map<int64_t, size_t>& row_of,
                     const std::vector<int64_t>& generated, const ScheduledBatch& batch) {
  StepDraws d;
  for (const int64_t seq : batch.seq_ids) {
    const size_t i = row_of.at(seq);
    d.temperature.push_back(s.temperature[i]);
    d.top_p.push_back(s.top_p[i]);
    d.min_p.push_back(s.min_p[i]);
    d.top_k.push_back(s.top_k[i]);
    d.seeds.push_back(s.seeds[i]);
    d.offsets.push_back(generated[i]);
  }
  return d;
}

}  // namespace

DecodeStatus decode_greedy(const DecoderStack& stack, const ScheduledBatch& batch, int64_t* counts, bool bf16,
                           int num_threads, int64_t* tokens) {
  return decode_drawn(stack, batch, counts, bf16, num_threads, nullptr, tokens);
}

LoopSteps run_decode_steps(Scheduler& scheduler, const DecoderStack& stack, ScheduledBatch first, int max_steps,
                           const LoopSampling& sampling, int64_t* counts, int64_t counts_per_step, bool bf16,
                           int num_threads) {
  DI_CHECK(sampling.empty() || sampling.temperature.size() == first.seq_ids.size(),
           "a loop's sampling has one row per sequence of its first batch");
  std::unordered_map<int64_t, size_t> row_of;
  for (size_t i = 0; i < first.seq_ids.size(); ++i) row_of[first.seq_ids[i]] = i;
  std::vector<int64_t> generated = sampling.offsets;
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
    const StepDraws draws = sampling.empty() ? StepDraws{} : step_draws(sampling, row_of, generated, batch);
    r.status = decode_drawn(stack, batch, counts ? counts + k * counts_per_step : nullptr, bf16, num_threads,
                            sampling.empty() ? nullptr : &draws, tokens.data());
    if (!r.status.ok()) {
      r.failed = std::move(batch);
      break;
    }
    if (!sampling.empty())
      for (const int64_t seq : batch.seq_ids) ++generated[row_of.at(seq)];
    std::vector<StepOutput> outputs = scheduler.process(batch, std::vector<int32_t>(tokens.begin(), tokens.end()));
    r.done.push_back({std::move(batch), std::move(outputs)});
  }
  return r;
}

}  // namespace deepinfer
