"""deepinfer: offline-batch inference for Mixture-of-Experts LLMs."""
import os
import sys

# torch's OpenMP workers (libgomp) spin after each parallel region by default, on the cores this engine's own thread
# pool computes on next (platform.set_threads); asleep at once instead, a 64-token prefill at two threads ran in
# 163-173 ms against 261-326 ms (Zen 3, 3 runs each). libgomp reads the policy once, as torch loads.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from deepinfer.llm import LLM  # noqa: E402  (after the policy: it loads torch)
from deepinfer.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob,  # noqa: E402
                               RequestMetrics, RequestOutput)
from deepinfer.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob",
           "StructuredOutputsParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
