"""deepinfer: offline-batch inference for Mixture-of-Experts LLMs."""
from deepinfer.llm import LLM
from deepinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob",
           "StructuredOutputsParams"]
