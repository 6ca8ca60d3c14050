"""Engine configuration: the LLM(...) keywords, validated once, plus the model's HF config."""
from dataclasses import dataclass

import torch

STATE_TRANSFER_MODES = ("auto", "state", "replay")  # engine/kv_transfer.py
# LLM(num_scheduler_steps=None): decode steps per C++ call. 8 leaves 1/8 of a batch-1 step's Python share (~0.3-0.6
# ms of 10-12 ms on a 2-vCPU Zen 3); the loop ends as soon as a request waits, so no prefill waits on it.
DEFAULT_SCHEDULER_STEPS = 8
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def scheduler_steps(num_scheduler_steps: int | None, speculative, async_scheduling: bool) -> int:
    """LLM(num_scheduler_steps=...) as given, or by default DEFAULT_SCHEDULER_STEPS where more than one step per
    call is allowed (not with speculative=... or async_scheduling=True)."""
    if num_scheduler_steps is not None:
        return num_scheduler_steps
    return 1 if speculative or async_scheduling else DEFAULT_SCHEDULER_STEPS


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in _DTYPES:
        # fp16 runs at a fraction of a GFLOP/s on these CPUs: refuse it rather than crawl.
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


@dataclass
class EngineConfig:
    model: str
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: int
    block_size: int
    kv_cache_dtype: str
    seed: int
    engine_type: str
    num_threads: int
    enable_eplb: bool = False
    eplb_config: dict | None = None
    eplb_plan: str | None = None
    speculative: dict | None = None
    batch_invariant: bool = False
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    prefix_cache: str | dict | None = None  # engine/prefix_cache.py
    state_transfer: str = "auto"  # engine/kv_transfer.py: how a handoff's StateBlock travels
    async_scheduling: bool = False  # engine/llm_engine.py: schedule decode step N+1 while step N runs
    num_scheduler_steps: int = 1  # engine/llm_engine.py: decode steps run back to back in one C++ call

    @staticmethod
    def default_num_threads() -> int:
        """All the cores torch sees. Our kernels split their work on a persistent pool and torch's own ops
        stay on one thread outside prefill (platform.set_threads), so the second vCPU of a 2-vCPU machine
        speeds decode up (medium Qwen3-MoE: 1.1x at batch 1, 1.4-1.5x at 16-64) instead of slowing small
        GEMMs down on OpenMP barriers as it used to. (Not torch's count: an engine sets that to one.)"""
        import os

        return len(os.sched_getaffinity(0))

    def validate(self):
        """Checks the keywords; max_model_len and max_num_batched_tokens may still be 0 (unset)."""
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "block_size"):
            value = getattr(self, name)
            unset_ok = name in ("max_model_len", "max_num_batched_tokens", "block_size") and value == 0
            if not isinstance(value, int) or (value < 1 and not unset_ok):
                raise ValueError(f"LLM({name}=...) must be a positive integer, got {value!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"LLM(long_prefill_token_threshold={self.long_prefill_token_threshold!r}) must be an "
                             "integer >= 0 (0: no cap)")
        if not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise ValueError(f"LLM(num_threads={self.num_threads!r}) must be a positive integer")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp4", "fp4_all"):
            raise ValueError(f"LLM(kv_cache_dtype={self.kv_cache_dtype!r}) must be 'auto', 'fp8', 'fp4' or 'fp4_all'")
        if self.state_transfer not in STATE_TRANSFER_MODES:
            raise ValueError(f"LLM(state_transfer={self.state_transfer!r}) must be one of {STATE_TRANSFER_MODES}")
        if self.engine_type not in ("normal", "prompt", "completion"):
            raise ValueError(f"LLM(engine_type={self.engine_type!r}) must be normal, prompt or completion")
        if not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1:
            raise ValueError(f"LLM(num_scheduler_steps={self.num_scheduler_steps!r}) must be a positive integer")
        if self.num_scheduler_steps > 1 and (self.speculative or self.async_scheduling):
            # A draft needs the previous step's tokens in Python; an ahead step needs each step back in Python.
            raise ValueError("LLM(num_scheduler_steps > 1) does not support speculative=... or async_scheduling=True; "
                             "use one of them")
        if self.async_scheduling and self.speculative:
            # A speculative step's drafts come from the previous step's output, which an ahead step cannot wait for.
            raise ValueError("LLM(async_scheduling=True) does not support speculative=...; use one of them")

    def fill_defaults(self, hf_config, block_size_multiple: int = 1) -> None:
        """Unset lengths come from the model config; an unset block size is 16 or the smallest the
        model's cache layout allows (DeepSeek-V4: 128, one HCA window)."""
        if not self.block_size:
            self.block_size = max(16, block_size_multiple)
        if not self.max_model_len:
            self.max_model_len = int(hf_get(hf_config, "max_position_embeddings", default=4096))
        if not self.max_num_batched_tokens:
            self.max_num_batched_tokens = max(8192, self.max_model_len)
        self.validate()


def dataclass_from_dict(cls, d: dict | None, keyword: str):
    """Builds an options dataclass from an LLM(keyword={...}) dict, refusing unknown keys by name."""
    d = dict(d or {})
    unknown = set(d) - set(cls.__dataclass_fields__)
    if unknown:
        raise ValueError(f"LLM({keyword}=...) has unknown keys {sorted(unknown)}")
    return cls(**d)


def hf_get(hf_config, *names, default=None):
    """First attribute present among names: transformers 4 and 5 spell some keys differently."""
    for name in names:
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    return default


def rope_theta(hf_config) -> float:
    params = hf_get(hf_config, "rope_parameters", "rope_scaling") or {}
    return float(params.get("rope_theta") or hf_get(hf_config, "rope_theta", default=10000.0))


def rope_scaling(hf_config) -> dict | None:
    params = hf_get(hf_config, "rope_parameters", "rope_scaling")
    if not params or params.get("rope_type", params.get("type", "default")) == "default":
        return None
    return params
