#include "engine/decode_loop.h"

#include <utility>

#include "cpu/scratch.h"
#include "engine/check.h"

namespace deepinfer {

DecodeStatus decode_greedy(const DecoderStack& stack, const ScheduledBatch& batch, int64_t* counts, bool bf16,
                           int num_threads, int64_t* tokens) {
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
  Scratch<char> out(ScratchUse::DECODE_OUT, T * row_bytes);
  Scratch<float> logits(ScratchUse::DECODE_LOGITS, T * stack.head->vocab);
  return decode_step(stack, batch.input_ids.data(), counts, inputs, bf16, num_threads, out.data(), logits.data(),
                     tokens);
}

GreedySteps run_greedy_steps(Scheduler& scheduler, const DecoderStack& stack, ScheduledBatch first, int max_steps,
                             int64_t* counts, int64_t counts_per_step, bool bf16, int num_threads) {
  GreedySteps r;
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
    r.status = decode_greedy(stack, batch, counts ? counts + k * counts_per_step : nullptr, bf16, num_threads,
                             tokens.data());
    if (!r.status.ok()) {
      r.failed = std::move(batch);
      break;
    }
    std::vector<StepOutput> outputs = scheduler.process(batch, std::vector<int32_t>(tokens.begin(), tokens.end()));
    r.done.push_back({std::move(batch), std::move(outputs)});
  }
  return r;
}

}  // namespace deepinfer
