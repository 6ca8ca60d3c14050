"""Model registry. Every model class follows one protocol (see ModelRunner):

    __init__(hf_config, dtype)
    block_size_multiple: int                  # block_size must be a multiple of this
    supports_chunked_prefill: bool            # a prompt may be prefilled over several steps
    cache_spec(block_size, kv_cache_dtype) -> CacheSpec
    bind_cache(paged: dict[str, Tensor], state: dict[str, Tensor]) -> None
    forward(input_ids [T], meta: AttentionMetadata) -> hidden [T, H]
    compute_logits(hidden [N, H]) -> logits [N, V] (fp32)
    forward_logits(input_ids [T], meta) -> logits [T, V] (fp32): compute_logits(forward(...)), fused where it can
    decode_drawn(batch: ScheduledBatch, sampling, num_logprobs) -> (tokens [T], logprobs) or None  # optional: a
        # decode step drawn in one call
    decode_steps(scheduler, batch, max_steps, sampling, counts, done, num_logprobs) -> evicted or None  # optional:
        # such steps back to back
                                              # back to back, greedy or sampled, with the scheduler in the call
    load_weights(weights: Iterable[(hf_name, Tensor)]) -> None   # raises on missing/extra/misshapen
    weights_changed() -> None                 # optional: weights were moved or sharded after loading
"""
import importlib

_MODELS = {
    "LlamaForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "deepinfer.models.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV4ForCausalLM": "deepinfer.models.deepseek_v4:DeepseekV4ForCausalLM",
}


def get_model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(_MODELS)}")
    module, name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), name)
