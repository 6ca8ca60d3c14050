"""Llama-family dense decoder (also the base Qwen3-MoE builds on): fused QKV and gate/up
projections, optional per-head q/k RMSNorm, rotary, paged attention."""
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config import hf_get, rope_scaling, rope_theta
from deepinfer.formats.cache_spec import CacheSpec, CacheTensor
from deepinfer.layers import cpu_ops
from deepinfer.layers.attention import paged_attention, store_kv
from deepinfer.layers.attention_metadata import AttentionMetadata
from deepinfer.layers.gemm_plan import PLAN, bucket
from deepinfer.layers.linear import Linear, linear
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding
from deepinfer.models.weights import WeightLoader


def member(module: nn.Module, name: str):
    """module.<name> for a registered parameter or submodule, read from its table: nn.Module.__getattr__, which
    Python calls only after the plain lookup failed, cost ~0.7 us a read here, and the fused decode path checks
    ~20 per layer each step (0.85 ms of a ~16 ms batch-1 step for the 16 layers' keys)."""
    tables = module.__dict__
    return tables["_parameters"][name] if name in tables["_parameters"] else tables["_modules"][name]


def _linear(n_in: int, n_out: int | list[int], dtype, bias: bool = False) -> Linear:
    return Linear(n_in, n_out, dtype, bias)


class Attention(nn.Module):
    def __init__(self, cfg, dtype, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = hf_get(cfg, "num_key_value_heads", default=self.num_heads)
        self.head_dim = hf_get(cfg, "head_dim", default=hidden // self.num_heads)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(hf_get(cfg, "attention_bias", default=False))
        self.qkv_proj = _linear(hidden, [self.q_size, self.kv_size, self.kv_size], dtype, bias)
        self.o_proj = _linear(self.q_size, hidden, dtype, bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps).to(dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps).to(dtype) if qk_norm else None
        self.rotary = rotary
        self.k_cache = self.v_cache = None
        self._fused_weights: dict[tuple, tuple | None] = {}  # fused_decode's checked weights, by inputs

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(x)
        norms = self._norm_weights()
        if cpu_ops.fast_path(qkv, self.k_cache, self.v_cache, *norms):
            q = cpu_ops.qk_norm_rope_store(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *norms,
                                           self._norm_eps(), self.rotary.cos, self.rotary.sin, meta.positions,
                                           self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            q = self._inputs_torch(qkv, meta)
        out = paged_attention(q, self.k_cache, self.v_cache, meta, self.head_dim ** -0.5)
        return self.o_proj(out.reshape(-1, self.q_size))

    def fused_decode(self, x: torch.Tensor, norm: RMSNorm, meta: AttentionMetadata) -> torch.Tensor | None:
        """self(norm(x), meta) in one C++ call (cpu_ops.attention_block) for a decode step (one query per
        sequence) on CPU bf16 weights whose GEMM plan keeps both projections on our kernels; None otherwise."""
        weights = self.fused_weights(x, norm) if meta.max_query_len == 1 else None
        if weights is None:
            return None
        return cpu_ops.attention_block(x, meta.positions, meta.slot_mapping, meta.block_tables, meta.context_lens,
                                       weights)

    def fused_weights(self, x: torch.Tensor, norm: RMSNorm) -> tuple | None:
        """cpu_ops.attention_block_weights for a decode step over these inputs (one query per sequence), or None
        where the fused half cannot run them."""
        if x.dim() != 2:
            return None
        qkv, o = member(self, "qkv_proj"), member(self, "o_proj")
        key = (x.dtype, x.device.type, bucket(x.shape[0]), PLAN.invariant, member(norm, "weight").data_ptr(),
               member(qkv, "weight").data_ptr(), member(o, "weight").data_ptr(), qkv.packed, o.packed,
               0 if self.k_cache is None else self.k_cache.data_ptr())
        if key not in self._fused_weights:  # checked once per dtype, row bucket and set of tensors
            self._fused_weights[key] = self._fused_weights_for(x, norm)
        return self._fused_weights[key]

    def _fused_weights_for(self, x: torch.Tensor, norm: RMSNorm) -> tuple | None:
        if self.qkv_proj.weight.dtype not in cpu_ops.WEIGHT_DTYPES \
                or not cpu_ops.fast_path(x, norm.weight, self.k_cache, self.v_cache, *self._norm_weights()):
            return None
        qkv = PLAN.linear_path(x.dtype, x.shape[0], self.qkv_proj.weight, self.qkv_proj.packed)
        o = PLAN.linear_path(x.dtype, x.shape[0], self.o_proj.weight, self.o_proj.packed)
        if not (qkv.startswith("cpu-") and o.startswith("cpu-")):
            return None
        return cpu_ops.attention_block_weights(norm.weight, norm.eps, self.qkv_proj.weight, self.qkv_proj.bias, qkv[4:],
                                               *self._norm_weights(), self._norm_eps(), self.rotary.cos, self.rotary.sin,
                                               self.k_cache, self.v_cache, self.o_proj.weight, self.o_proj.bias, o[4:],
                                               self.num_heads, self.head_dim ** -0.5, PLAN.invariant,
                                               self.qkv_proj.packed, self.o_proj.packed)

    def _norm_weights(self) -> tuple:
        """(q_norm, k_norm) weights, or (None, None) without q/k norm."""
        return (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)

    def _norm_eps(self) -> float:
        return 0.0 if self.q_norm is None else self.q_norm.eps

    def _inputs_torch(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The torch form of cpu_ops.qk_norm_rope_store (other devices and dtypes): qkv [T, q + 2 kv] -> q [T, H, D]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(meta.positions, q, k)
        store_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        return q


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype):
        super().__init__()
        self.gate_up_proj = _linear(hidden, [intermediate, intermediate], dtype)
        self.down_proj = _linear(intermediate, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, dtype, rotary, mlp: nn.Module, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(cfg, dtype, rotary, qk_norm)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)

    def fused_weights(self, x: torch.Tensor) -> tuple | None:
        """(attention, MLP) weights of this layer's entry in cpu_ops.decoder_stack's `layers` (the MLP's log2phy
        completes it) for a decode step over x, or None where its fused halves cannot run these inputs (or its MLP
        has no fused half)."""
        block = member(self, "mlp")
        fused = getattr(block, "fused_weights", None)
        attn = member(self, "self_attn").fused_weights(x, member(self, "input_layernorm")) \
            if fused is not None else None
        mlp = fused(x, x, member(self, "post_attention_layernorm")) if attn is not None else None
        return None if mlp is None else (attn, mlp)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        a = self.self_attn.fused_decode(x, self.input_layernorm, meta)
        if a is None:
            a = self.self_attn(self.input_layernorm(x), meta)
        # An MLP may run the whole second half in one call (fused_residual: None where it cannot).
        fused = getattr(self.mlp, "fused_residual", None)
        out = fused(x, a, self.post_attention_layernorm) if fused is not None else None
        if out is not None:
            return out
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    block_size_multiple = 1
    qk_norm = False
    # All per-token state is paged KV: a rejected draft's slot is masked out, then overwritten.
    supports_draft_rollback = True
    # Attention reads each sequence's keys from the paged cache, so a prompt's later chunk sees the earlier ones.
    supports_chunked_prefill = True

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        head_dim = hf_get(cfg, "head_dim", default=cfg.hidden_size // cfg.num_attention_heads)
        max_pos = hf_get(cfg, "max_position_embeddings", default=4096)
        self.rotary = RotaryEmbedding(head_dim, max_pos, rope_theta(cfg), rope_scaling(cfg))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype).requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, self.rotary, self.make_mlp(cfg, i, dtype), self.qk_norm)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)
        self.tie_word_embeddings = bool(hf_get(cfg, "tie_word_embeddings", default=False))
        self.lm_head = None if self.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, dtype)
        # _decode_stack's checks by row bucket, valid for one expert placement and until weights_changed().
        self._stacks: dict[tuple, tuple | None] = {}
        self._stacks_placement = None

    def make_mlp(self, cfg, layer: int, dtype) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    def cache_spec(self, block_size: int, kv_cache_dtype: str) -> CacheSpec:
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is only supported by DeepSeek-V4 models")
        attn = self.layers[0].self_attn
        per_block = CacheTensor((block_size, attn.num_kv_heads, attn.head_dim), self.dtype)
        spec = CacheSpec()
        for i in range(len(self.layers)):
            spec.paged[f"layers.{i}.k"] = per_block
            spec.paged[f"layers.{i}.v"] = per_block
        return spec

    def bind_cache(self, paged: dict, state: dict) -> None:
        for i, layer in enumerate(self.layers):
            layer.self_attn.k_cache = paged[f"layers.{i}.k"]
            layer.self_attn.v_cache = paged[f"layers.{i}.v"]
        self.weights_changed()

    def weights_changed(self) -> None:
        """Forgets which decode steps run in one call: their weights, caches or expert sharding changed."""
        self._stacks.clear()

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]."""
        out = self._decode(input_ids, meta, head=False)
        if out is not None:
            return self.norm(out)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, meta)
        return self.norm(x)

    def forward_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """compute_logits(forward(input_ids, meta)): fp32 logits [T, V] at every token. Where a decode step runs in
        one C++ call, the final norm and LM head join it: the same bits without two more calls from Python (whose
        code runs on caches the weight stream has just emptied)."""
        out = self._decode(input_ids, meta, head=True)
        return self.compute_logits(self(input_ids, meta)) if out is None else out

    def decode_drawn(self, batch, sampling: tuple | None, num_logprobs: int = -1) -> tuple | None:
        """A scheduled decode batch's (C++ ScheduledBatch, one token per sequence) tokens [T] int64 drawn from
        forward_logits in one C++ call from the batch's own arrays: each row's first argmax, or as the sampler draws
        with `sampling`; -1 for a row with NaN or inf; with their logprobs (cpu_ops.decode_drawn's pair). None where
        the step cannot run in one call with the head (nothing ran)."""
        stack = self._decode_stack(batch.num_seqs, head=True)
        return None if stack is None else cpu_ops.decode_drawn(stack, batch, sampling, self._step_counts(),
                                                               num_logprobs)

    def decode_steps(self, scheduler, batch, max_steps: int, sampling: tuple | None, counts: torch.Tensor | None,
                     done: list, num_logprobs: int = -1) -> list | None:
        """`batch` and up to max_steps - 1 more decode steps drawn (greedy, or by `sampling`), scheduled and processed
        in the same C++ call (cpu_ops.decode_steps: done gets (batch, outputs, logprobs) per step; counts
        [max_steps, L * E] the steps' expert counts, or None); None where the steps cannot run in one call (nothing
        ran)."""
        stack = self._decode_stack(batch.num_seqs, head=True)
        return None if stack is None else cpu_ops.decode_steps(stack, scheduler, batch, max_steps, sampling, counts,
                                                               done, num_logprobs)

    def _decode(self, input_ids: torch.Tensor, meta: AttentionMetadata, head: bool) -> torch.Tensor | None:
        """cpu_ops.decode_step's output for this step, or None where it cannot run in one call."""
        if input_ids.dim() != 1 or input_ids.device.type != "cpu" or meta.max_query_len != 1:
            return None
        stack = self._decode_stack(input_ids.shape[0], head)
        if stack is None:
            return None
        return cpu_ops.decode_step(stack, input_ids, meta.positions, meta.slot_mapping, meta.block_tables,
                                   meta.context_lens, self._step_counts())

    def _step_counts(self) -> torch.Tensor | None:
        """decode_step's counts: every MoE layer's row of the EPLB recorder's step counts, or None without EPLB."""
        eplb = self._eplb()
        return None if eplb is None else eplb.recorder.step_flat()

    def _decode_stack(self, rows: int, head: bool) -> tuple | None:
        """cpu_ops.decode_step's `stack` for a decode step of `rows` CPU tokens (with the final norm and LM head when
        head), or None unless every layer (and the head) can run in it. Checking the layers cost ~20 us each per
        step at batch 1, so they are checked once per row bucket and expert placement (the EPLB placement the MoE
        layers route with; replanning replaces it)."""
        eplb = self._eplb()
        placement = None if eplb is None else eplb.placement
        if placement is not self._stacks_placement:
            self._stacks.clear()
            self._stacks_placement = placement
        key = (bucket(rows), PLAN.invariant)
        if key not in self._stacks:
            self._stacks[key] = self._check_decode_stack(rows)
        stacks = self._stacks[key]
        return None if stacks is None else stacks[head]

    def _check_decode_stack(self, rows: int) -> tuple | None:
        """cpu_ops.decoder_stack for decode steps of `rows` tokens without and with the head (None where the head
        cannot run in it), or None where a layer cannot."""
        x = torch.empty(rows, self.config.hidden_size, dtype=self.embed_tokens.weight.dtype)
        layers = []
        for i, layer in enumerate(self.layers):
            weights = layer.fused_weights(x)
            if weights is None or (layer.mlp.eplb is not None and layer.mlp.moe_index != i):
                return None  # counts are passed as the recorder's rows, one per layer in order
            layers.append((*weights, layer.mlp.load_tensors()[1]))
        head = self._check_fused_head(x)
        embed = self.embed_tokens.weight
        return (cpu_ops.decoder_stack(embed, layers),
                None if head is None else cpu_ops.decoder_stack(embed, layers, head))

    def _check_fused_head(self, x: torch.Tensor) -> tuple | None:
        """cpu_ops.decode_head_weights for inputs like x, or None: weights torch multiplies, activations our norm
        does not take, or a GEMM plan that picked torch for this row count."""
        weight, packed = self._lm_weight()
        if weight.dtype not in cpu_ops.WEIGHT_DTYPES or weight.device.type != "cpu" \
                or not cpu_ops.fast_path(x, self.norm.weight):
            return None
        path = PLAN.linear_path(x.dtype, x.shape[0], weight, packed)
        if not path.startswith("cpu-"):
            return None
        return cpu_ops.decode_head_weights(self.norm.weight, self.norm.eps, weight, path[4:], PLAN.invariant, packed)

    def _eplb(self):
        """The EPLB state the MoE layers share (engine/eplb.py), or None."""
        return getattr(self.layers[0].mlp, "eplb", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, packed = self._lm_weight()
        return linear(hidden, weight, packed=packed).float()

    def _lm_weight(self) -> tuple[torch.Tensor, bool]:
        """The LM head's weight [V, H] and whether it is packed (tied: the embeddings, read as rows, never packed)."""
        if self.lm_head is None:
            return self.embed_tokens.weight, False
        return self.lm_head.weight, self.lm_head.packed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        for name, tensor in weights:
            if not self.skip_weight(name):
                loader.load(self.hf_to_param(name), tensor, name)
        loader.finish()
        self.weights_changed()

    def skip_weight(self, name: str) -> bool:
        # Old checkpoints carry rotary tables; tied heads may be saved twice.
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def hf_to_param(self, name: str) -> tuple[str, int | None, int | None]:
        """HF tensor name -> (our parameter, expert index or None, shard of a fused parameter or None)."""
        name = name.removeprefix("model.")
        for part, (fused, shard) in _FUSED.items():
            if f".{part}." in name:
                return name.replace(part, fused), None, shard
        return name, None, None


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
