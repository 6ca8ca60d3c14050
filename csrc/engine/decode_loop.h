#pragma once
// Decode steps in C++ from a scheduled batch (cpu/decode_step.h with the head): one greedy step in one call, or
// steps back to back (LLM(num_scheduler_steps=K)), each drawn, processed and the next one scheduled with no
// Python in between. A batch-1 step's Python around its call (~0.3 ms of ~10 ms on two threads, on caches the
// weight stream has just emptied) is then paid once per K steps.
#include <cstdint>
#include <vector>

#include "cpu/decode_step.h"
#include "engine/scheduler.h"

namespace deepinfer {

// tokens [T] = decode_step's greedy tokens over a decode batch of one token per sequence (T = its sequences),
// read from the batch's own arrays, with the stack's head (required); counts as decode_step's.
DecodeStatus decode_greedy(const DecoderStack& stack, const ScheduledBatch& batch, int64_t* counts, bool bf16,
                           int num_threads, int64_t* tokens);

// What a run of decode steps draws for each sequence of its first batch, in that batch's row order:
// sample_tokens' parameters (cpu/sampling.h), offsets the tokens each sequence generated before the run. Empty:
// every row takes the plain argmax.
struct LoopSampling {
  std::vector<float> temperature, top_p, min_p;
  std::vector<int64_t> top_k, seeds, offsets;
  bool empty() const { return temperature.empty(); }
};

struct LoopStep {
  ScheduledBatch batch;
  std::vector<StepOutput> outputs;  // scheduler.process of its tokens
};

// The steps a loop ran in order, and where it stopped: status is the failure of the step after them (`failed`,
// scheduled and not processed), or OK; preempted: sequences a last decode schedule evicted without fitting anyone.
struct LoopSteps {
  std::vector<LoopStep> done;
  ScheduledBatch failed;
  DecodeStatus status;
  std::vector<int64_t> preempted;
};

// Runs `first` (a decode batch the caller scheduled) and up to max_steps - 1 more decode steps, each scheduled
// (forced DECODE) and processed here, while no sequence waits or is mid-prefill (the next step could be a
// prefill) and a step was scheduled. Each row's token is its greedy token, or with `sampling` sample_tokens' draw
// from its logits at offset (its offset + steps it ran in this loop); a row with NaN or inf logits gets -1 either
// way. The caller guarantees no sequence needs anything per step outside the scheduler (stop strings, logprobs,
// logits processors, grammars). counts: max_steps rows of counts_per_step counters, row k decode_step's counts of
// step k (or null).
LoopSteps run_decode_steps(Scheduler& scheduler, const DecoderStack& stack, ScheduledBatch first, int max_steps,
                           const LoopSampling& sampling, int64_t* counts, int64_t counts_per_step, bool bf16,
                           int num_threads);

}  // namespace deepinfer
