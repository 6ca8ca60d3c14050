#pragma once
// Decode steps in C++ from a scheduled batch (cpu/decode_step.h with the head), each row's token drawn there
// (greedy, or sampled by cpu/sampling.h): one step in one call, or steps back to back (LLM(num_scheduler_steps=K)),
// each drawn, processed and the next one scheduled with no Python in between. A batch-1 step's Python around its
// call (~0.3 ms of ~10 ms on two threads, on caches the weight stream has just emptied; ~1 ms more with Python's
// sampler) is then paid once per K steps.
#include <cstdint>
#include <vector>

#include "cpu/decode_step.h"
#include "engine/scheduler.h"

namespace deepinfer {

// What each row of a batch draws: sample_tokens' parameters (cpu/sampling.h), offsets the tokens its sequence has
// generated. Empty: every row takes the plain argmax.
struct Draws {
  std::vector<float> temperature, top_p, min_p;
  std::vector<int64_t> top_k, seeds, offsets;
  bool empty() const { return temperature.empty(); }
};

// The logprobs of a step's drawn tokens (cpu/sampling.h token_logprobs) with the n most likely tokens per row;
// n < 0: none wanted, and the vectors stay empty. token_logprob, rank [T]; top_ids, top_logprobs [T, n].
struct StepLogprobs {
  int64_t n = -1;
  std::vector<float> token_logprob, top_logprobs;
  std::vector<int64_t> rank, top_ids;
};

// tokens [T] drawn over a decode batch of one token per sequence (T = its sequences), read from the batch's own
// arrays, with the stack's head (required): decode_step's greedy tokens, or with draws (one per row)
// sample_tokens' draw from each row's logits; a row with NaN or inf logits gets -1 either way. counts as
// decode_step's. logprobs (or null): filled for its n from the raw logits, as vLLM reports them.
DecodeStatus decode_drawn(const DecoderStack& stack, const ScheduledBatch& batch, const Draws& draws,
                          int64_t* counts, bool bf16, int num_threads, int64_t* tokens,
                          StepLogprobs* logprobs = nullptr);

struct LoopStep {
  ScheduledBatch batch;
  std::vector<StepOutput> outputs;  // scheduler.process of its tokens
  StepLogprobs logprobs;
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
// prefill) and a step was scheduled. Each step is drawn by decode_drawn, with `draws` (per row of `first`, or
// empty) at each sequence's offset plus the steps it ran in this loop, with num_logprobs' logprobs (< 0: none).
// The caller guarantees no sequence needs anything per step outside the scheduler (stop strings, logits
// processors, grammars). counts: max_steps rows of counts_per_step counters, row k decode_step's counts of step k
// (or null).
LoopSteps run_decode_steps(Scheduler& scheduler, const DecoderStack& stack, ScheduledBatch first, int max_steps,
                           const Draws& draws, int64_t num_logprobs, int64_t* counts, int64_t counts_per_step,
                           bool bf16, int num_threads);

}  // namespace deepinfer
