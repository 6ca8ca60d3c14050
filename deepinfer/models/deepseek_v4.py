"""DeepSeek-V4 (model_type `deepseek_v4`), matching transformers' DeepseekV4ForCausalLM token for token.

Block: mHC streams -> collapse -> RMSNorm -> attention (deepinfer/layers/v4_attention.py: sliding / CSA /
HCA) -> expand+mix -> collapse -> RMSNorm -> MoE (hash-routed or top-k routed, plus one shared expert)
-> expand+mix. The streams are collapsed by the HyperHead before the final norm.

Cache (see cache_spec): compressed KV and indexer keys in the paged pool, the sliding-window ring and the
compression accumulators in the state pool, so prefill and decode only read and write the two pools.
"""
import math
import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.formats.cache_spec import CacheSpec, CacheTensor
from deepinfer.formats import fp4
from deepinfer.layers.attention_metadata import AttentionMetadata
from deepinfer.layers.hyper_connection import HyperConnection, HyperHead, hc_merge
from deepinfer.layers.moe import FusedMoE, RoutedMoE
from deepinfer.layers.v4_attention import EntryPool, Linear, RMSNorm, Rope, V4Attention, _param, linear
from deepinfer.models.weights import WeightLoader

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
# kv_cache_dtype -> formats (v4_attention.EntryPool) of the compressed main KV, the indexer keys and the SWA
# ring. The raw compression rings stay in the model dtype and HCA's accumulators in fp32 whatever it is: they
# are a few windows per layer, and the memory plan states their bytes.
KV_CACHE_FORMATS = {"auto": ("auto", "auto", "auto"), "fp8": ("fp8", "fp8", "fp8"),
                    "fp4": ("nvfp4", "mxfp4", "fp8"), "fp4_all": ("nvfp4", "mxfp4", "nvfp4")}


def _cfg(cfg, name, default=None):
    return getattr(cfg, name, default)


def validate_config(cfg) -> dict:
    """Check what this implementation relies on; returns {layer_type: compress rate} for the types used.
    Every error names the config key."""
    n = cfg.num_hidden_layers
    for key, types, allowed in (("layer_types", cfg.layer_types, LAYER_TYPES),
                                ("mlp_layer_types", cfg.mlp_layer_types, MLP_TYPES)):
        if types is None or len(types) != n:
            raise ValueError(f"config.{key} must list {n} entries (num_hidden_layers), got {types!r}")
        for i, t in enumerate(types):
            if t not in allowed:
                raise ValueError(f"config.{key}[{i}] = {t!r} is not a DeepSeek-V4 layer type; expected one of {allowed}")
    rates = {}
    for t in set(cfg.layer_types) - {SLIDING}:
        r = (cfg.compress_rates or {}).get(t)
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"config.compress_rates[{t!r}] = {r!r}: the cache lays out one compressed entry per "
                             f"`rate` source tokens, so it must be a positive integer")
        rates[t] = r
    if _cfg(cfg, "num_key_value_heads", 1) != 1:
        raise ValueError(f"config.num_key_value_heads = {cfg.num_key_value_heads}: DeepSeek-V4 is shared-KV MQA (1)")
    if cfg.scoring_func not in SCORING_FUNCS:
        raise ValueError(f"config.scoring_func = {cfg.scoring_func!r}; expected one of {SCORING_FUNCS}")
    if _cfg(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"config.hidden_act = {cfg.hidden_act!r}; DeepSeek-V4 experts are SwiGLU ('silu')")
    rope_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    if rope_dim % 2 or rope_dim > cfg.head_dim or (CSA in rates and rope_dim > cfg.index_head_dim):
        raise ValueError(f"config.partial_rotary_factor = {cfg.partial_rotary_factor} gives rope dim {rope_dim}, "
                         f"which must be even and fit head_dim ({cfg.head_dim}) and index_head_dim")
    if (cfg.num_attention_heads * cfg.head_dim) % cfg.o_groups:
        raise ValueError(f"config.o_groups = {cfg.o_groups} must divide num_attention_heads * head_dim")
    return rates


def build_rope(cfg, kind: str) -> Rope:
    """kind 'main' | 'compress' from config.rope_parameters (default or any transformers rope type, e.g. yarn)."""
    params = cfg.rope_parameters[kind]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return Rope(inv_freq, 1.0)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None, layer_type=kind)
    return Rope(inv_freq, scaling)


class Router(nn.Module):
    """Top-k routed (learned topk over score + correction bias) or hash-routed (tid2eid[token]); the learned
    scores weight the chosen experts either way. Weights are renormalised to sum 1 (always, as the
    reference) and scaled by routed_scaling_factor."""

    def __init__(self, cfg, is_hash: bool, dtype: torch.dtype):
        super().__init__()
        self.is_hash, self.top_k = is_hash, cfg.num_experts_per_tok
        self.scoring, self.scaling = cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        if is_hash:
            self.tid2eid = _param(cfg.vocab_size, self.top_k, dtype=torch.int64)
        else:
            self.e_score_correction_bias = _param(cfg.n_routed_experts, dtype=torch.float32)

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scoring == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.scoring == "sigmoid":
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], input_ids [T] -> expert ids [T, k], weights [T, k]."""
        scores = self.score(linear(x, self.weight))
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, w * self.scaling


class SharedExpert(FusedMoE):
    """The shared expert: one more SwiGLU expert, which every token goes through, run by the routed
    experts' kernel (its gate_proj / up_proj / down_proj load into gate_up_proj [1, 2I, H] and down_proj)."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__(1, hidden, inter, dtype, limit=limit)
        self.gate_up_proj.shard_sizes = [inter, inter]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self._run_experts(x.float(), torch.tensor([x.shape[0]])).to(x.dtype)


class MoE(RoutedMoE):
    """Routed experts (EPLB and expert parallelism through RoutedMoE) plus one shared expert."""

    def __init__(self, cfg, is_hash: bool, dtype: torch.dtype):
        inter = cfg.moe_intermediate_size  # the shared expert is one MLP of this width, as the reference
        super().__init__(FusedMoE(cfg.n_routed_experts, cfg.hidden_size, inter, dtype, limit=cfg.swiglu_limit))
        self.experts.gate_up_proj.shard_sizes = [inter, inter]
        self.gate = Router(cfg, is_hash, dtype)
        self.shared_experts = SharedExpert(cfg.hidden_size, inter, cfg.swiglu_limit, dtype)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x, input_ids)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(x, input_ids) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_type: str, is_hash: bool, rates: dict, dtype: torch.dtype):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.layer_type = layer_type
        self.self_attn = V4Attention(cfg, layer_type, rates, dtype)
        self.mlp = MoE(cfg, is_hash, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams, input_ids, positions, ropes, meta, replay_start) -> torch.Tensor:
        """streams [T, N, H] -> [T, N, H]."""
        cos, sin = ropes["main" if self.layer_type == SLIDING else "compress"]
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(x), positions, cos, sin, meta, replay_start)
        streams = hc_merge(out, streams, post, comb)
        post, comb, x = self.ffn_hc(streams)
        return hc_merge(self.mlp(self.post_attention_layernorm(x), input_ids), streams, post, comb)


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(vocab, hidden, dtype=dtype)


class V4Model(nn.Module):
    def __init__(self, cfg, rates: dict, dtype: torch.dtype):
        super().__init__()
        self.hc_mult = cfg.hc_mult
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind, mlp == "hash_moe", rates, dtype)
                                    for kind, mlp in zip(cfg.layer_types, cfg.mlp_layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    """One multi-token-prediction module (checkpoint `mtp.{i}.*`), laid out as vLLM's DeepSeek-V4 MTP:
    the next token's embedding (zeroed at position 0) through enorm and e_proj, added to every stream of
    the previous hidden streams through hnorm and h_proj; one sliding-window, top-k routed decoder block
    of the main architecture; its own HyperHead, then a norm and the main model's lm_head. Embedding and
    lm_head are shared with the main model."""

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.e_proj, self.h_proj = Linear(H, H, dtype), Linear(H, H, dtype)
        self.block = DecoderLayer(cfg, SLIDING, False, {}, dtype)
        self.block.mlp.balanced = False  # drafting runs on each DP rank alone: keep all experts here
        self.hc_head = HyperHead(cfg.hc_mult, H, cfg.hc_eps, eps)
        self.head_norm = RMSNorm(H, eps)

    def forward(self, streams, next_ids, positions, ropes, meta, embed: torch.Tensor) -> torch.Tensor:
        """streams [T, N, H]: the target's pre-HyperHead streams at `positions` (or this layer's own output
        one position earlier); next_ids [T]: the token after each position -> streams [T, N, H]."""
        e = F.embedding(next_ids, embed).masked_fill((positions == 0)[:, None], 0)
        T, N, H = streams.shape
        h = self.h_proj(self.hnorm(streams).view(T * N, H)).view(T, N, H)
        x = h + self.e_proj(self.enorm(e)).unsqueeze(1)
        return self.block(x, next_ids, positions, ropes, meta, None)

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, N, H] -> [T, H], ready for the shared lm_head."""
        return self.head_norm(self.hc_head(streams))


# Checkpoint names: DeepSeek's own layout (what save_pretrained writes too) -> transformers' module names.
# Applied in order, like transformers' conversion mapping for deepseek_v4; names already in transformers'
# layout pass through unchanged.
_RENAMES = [(re.compile(p), r) for p, r in [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]]
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_SHARED = re.compile(r"^(layers\.\d+\.mlp\.shared_experts)\.(gate_proj|up_proj|down_proj)\.weight$")
_MTP = re.compile(r"^mtp\.(\d+)\.")
# MTP tensors with `mtp.{i}.` stripped: the module's own names, and copies of the main embedding and
# lm_head that DeepSeek's checkpoints may carry (shared, so not loaded twice). The block's tensors are
# named as a main-model layer's.
_MTP_OWN = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale",
            "norm.weight": "head_norm.weight", "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight"}
_MTP_SHARED = ("emb.tok_emb.weight", "head.weight", "embed_tokens.weight", "shared_head.head.weight")


def mtp_checkpoint_tensors(one_layer: dict, own: dict, index: int = 0) -> dict:
    """Writes an MTP layer in DeepSeek's checkpoint layout. one_layer: the state of a one-layer transformers
    DeepseekV4 model (with or without the `model.` prefix) whose layer, HyperHead and final norm are the MTP
    block, head and head norm; own: the MTP's enorm / hnorm / e_proj / h_proj tensors by their names
    ("enorm.weight", ...) -> {"mtp.{index}.*": tensor}."""
    out = {f"mtp.{index}.{k}": v for k, v in own.items()}
    for name, t in one_layer.items():
        name = name[len("model."):] if name.startswith("model.") else name
        if name.startswith("layers.0."):
            out[f"mtp.{index}." + name[len("layers.0."):]] = t
        elif name.startswith("hc_head."):
            out[f"mtp.{index}.hc_head_" + name.split("hc_head.hc_")[1]] = t
        elif name == "norm.weight":
            out[f"mtp.{index}.norm.weight"] = t
    return out


def hf_to_param(name: str) -> tuple[str, int | None, int | None]:
    """Checkpoint tensor name -> (parameter name, expert index or None, shard of a fused tensor or None)."""
    n = name[len("model."):] if name.startswith("model.") else name
    for pattern, repl in _RENAMES:
        n = pattern.sub(repl, n)
    m = _EXPERT.match(n)
    if m:
        prefix, e, w = m.group(1), int(m.group(2)), m.group(3)
        if w == "w2":
            return f"model.{prefix}.down_proj", e, None
        return f"model.{prefix}.gate_up_proj", e, 0 if w == "w1" else 1
    m = _SHARED.match(n)
    if m:
        prefix, w = m.group(1), m.group(2)
        if w == "down_proj":
            return f"model.{prefix}.down_proj", 0, None
        return f"model.{prefix}.gate_up_proj", 0, 0 if w == "gate_proj" else 1
    return (n if n == "lm_head.weight" else "model." + n), None, None


def mtp_to_param(rest: str) -> tuple[str, int | None, int | None]:
    """An MTP tensor name without its `mtp.{i}.` prefix -> (MTPLayer parameter name, expert, shard)."""
    if rest in _MTP_OWN:
        return _MTP_OWN[rest], None, None
    name, expert, shard = hf_to_param("layers.0." + rest)
    return "block." + name[len("model.layers.0."):], expert, shard


class DeepseekV4ForCausalLM(nn.Module):
    # Blocks must hold whole compression windows of every layer type, so that entry w of a sequence lives in
    # block w // (block_size / rate) at a fixed row and no entry's source tokens straddle two blocks (the
    # entry is written once, when its window closes, into the block of its own tokens). Hence block_size
    # must be a multiple of lcm(compress rates): 128 for V4 (4 and 128). The instance attribute is computed
    # from the checkpoint's config; this class default is V4's.
    block_size_multiple = 128
    # mb: draft tokens + 1 (1 when speculation is off), set by the engine before cache_spec(). Every state
    # ring keeps mb rows more than a step reads, so rolling back rejected drafts is shortening the sequence
    # (see v4_attention.write_ring).
    max_backtracking = 1
    supports_draft_rollback = True
    # A prefill query starts at p0 = context - query: it reads the ring's last window before p0, and the
    # compressor and indexer carry a window left open at a chunk's end in their per-sequence state.
    supports_chunked_prefill = True

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = hf_config, dtype
        self.rates = validate_config(hf_config)
        self.block_size_multiple = math.lcm(*self.rates.values()) if self.rates else 1
        self.model = V4Model(hf_config, self.rates, dtype)
        self.lm_head = Embedding(hf_config.vocab_size, hf_config.hidden_size, dtype)
        self.ropes = {kind: build_rope(hf_config, kind) for kind in ("main", "compress")}
        for layer in self.model.layers:
            if layer.self_attn.compressor is not None:
                layer.self_attn.compressor.rope = self.ropes["compress"]
                if layer.self_attn.indexer is not None:
                    layer.self_attn.indexer.rope = self.ropes["compress"]
        self.mtp = nn.ModuleList()  # MTP layer(s), built when the checkpoint carries them (for drafting)
        self.mtp_enabled = False  # the engine turns it on (before cache_spec) to give MTP its SWA rings
        self.capture_streams = False  # keep the last forward's pre-HyperHead streams for the MTP drafter
        self.last_streams: torch.Tensor | None = None
        self.kv_cache_dtype = None

    # ---- cache ------------------------------------------------------------------------------------------

    @property
    def ring_len(self) -> int:
        return self.config.sliding_window + self.max_backtracking

    def cache_spec(self, block_size: int, kv_cache_dtype: str = "auto") -> CacheSpec:
        """Paged (per block of block_size source tokens) and state (per sequence) tensors of every layer,
        in the formats KV_CACHE_FORMATS gives kv_cache_dtype."""
        if kv_cache_dtype not in KV_CACHE_FORMATS:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported for DeepSeek-V4; use one of "
                             f"{', '.join(map(repr, KV_CACHE_FORMATS))}")
        if block_size % self.block_size_multiple:
            raise ValueError(f"block_size {block_size} cannot hold whole compression windows: compress_rates "
                             f"{self.rates} need a multiple of {self.block_size_multiple}")
        main_fmt, index_fmt, ring_fmt = KV_CACHE_FORMATS[kv_cache_dtype]
        cfg, dt = self.config, self.dtype
        D, Di = cfg.head_dim, cfg.index_head_dim
        spec = CacheSpec()
        rings = [f"layers.{i}.swa_ring" for i in range(len(cfg.layer_types))]
        rings += [f"mtp.{i}.swa_ring" for i in range(len(self.mtp))] if self.mtp_enabled else []
        for name in rings:  # the MTP block is sliding-window only: its whole cache is one ring
            self._rows_spec(spec.state, name, self.ring_len, D, ring_fmt, kv_cache_dtype)
        for i, kind in enumerate(cfg.layer_types):
            if kind == SLIDING:
                continue
            p, r = f"layers.{i}.", self.rates[kind]
            main = "csa_kv" if kind == CSA else "hca_kv"
            self._rows_spec(spec.paged, p + main, block_size // r, D, main_fmt, kv_cache_dtype)
            if kind == HCA:  # online-softmax accumulator after each of the last mb positions (max, sum, weighted sum)
                spec.state[p + "hca_acc"] = CacheTensor((self.max_backtracking, 3, D), torch.float32)
                continue
            self._rows_spec(spec.paged, p + "indexer_k", block_size // r, Di, index_fmt, kv_cache_dtype)
            L = 2 * r + self.max_backtracking  # raw rings: the previous window (Ca), the current one, drafts
            for part, width in (("csa", D), ("idx", Di)):
                spec.state[f"{p}{part}_kv_ring"] = CacheTensor((L, 2 * width), dt)
                spec.state[f"{p}{part}_gate_ring"] = CacheTensor((L, 2 * width), dt)
        self.kv_cache_dtype = kv_cache_dtype
        return spec

    def _rows_spec(self, pool: dict, name: str, rows: int, dim: int, fmt: str, kv_cache_dtype: str) -> None:
        """Declare `rows` vectors of `dim` values in format fmt (EntryPool's layouts) as pool[name] (+ '_scale')."""
        if fmt == "auto":
            pool[name] = CacheTensor((rows, dim), self.dtype)
        elif fmt == "fp8":
            pool[name] = CacheTensor((rows, dim), torch.uint8)
            pool[name + "_scale"] = CacheTensor((rows, 1), torch.float32)
        else:
            block = fp4.NVFP4_BLOCK if fmt == "nvfp4" else fp4.MXFP4_BLOCK
            if dim % block:
                raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} stores {name} as {fmt} in blocks of {block}, "
                                 f"which must divide its width {dim}")
            pool[name] = CacheTensor((rows, dim // 2), torch.uint8)
            pool[name + "_scale"] = CacheTensor((rows, dim // block), torch.uint8)

    def bind_cache(self, paged: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        main_fmt, index_fmt, ring_fmt = KV_CACHE_FORMATS[self.kv_cache_dtype]
        for i, layer in enumerate(self.mtp):
            has_ring = f"mtp.{i}.swa_ring" in state
            layer.block.self_attn.ring = self._entry_pool(state, f"mtp.{i}.swa_ring", ring_fmt) if has_ring else None
        for i, layer in enumerate(self.model.layers):
            p, attn = f"layers.{i}.", layer.self_attn
            attn.ring = self._entry_pool(state, p + "swa_ring", ring_fmt)
            if attn.compressor is None:
                continue
            main = "csa_kv" if attn.layer_type == CSA else "hca_kv"
            pool = self._entry_pool(paged, p + main, main_fmt)
            if attn.indexer is None:
                attn.compressor.bind(pool, state[p + "hca_acc"])
                continue
            attn.compressor.bind(pool, state[p + "csa_kv_ring"], state[p + "csa_gate_ring"])
            attn.indexer.bind(self._entry_pool(paged, p + "indexer_k", index_fmt), state[p + "idx_kv_ring"],
                              state[p + "idx_gate_ring"])

    def _entry_pool(self, tensors: dict, name: str, fmt: str) -> EntryPool:
        return EntryPool(tensors[name], tensors.get(name + "_scale"), fmt, self.dtype)

    # ---- forward ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, replay_start: int | None = None):
        """input_ids [T], meta for one all-prefill or all-decode step -> hidden [T, H] (after the final norm)."""
        positions = meta.positions
        ropes = self.rope_tables(positions)
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        streams = x.unsqueeze(1).expand(-1, self.model.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, input_ids, positions, ropes, meta, replay_start)
        if self.capture_streams:
            self.last_streams = streams
        return self.model.norm(self.model.hc_head(streams))

    def rope_tables(self, positions: torch.Tensor) -> dict:
        """{'main' | 'compress': (cos, sin) [T, rd] (Rope's fp32 tables) for positions [T]."""
        return {kind: rope(positions, self.dtype) for kind, rope in self.ropes.items()}

    @torch.no_grad()
    def mtp_forward(self, i: int, streams, next_ids, meta) -> torch.Tensor:
        """MTP layer i over rows at meta.positions: streams [T, N, H], next_ids [T] -> streams [T, N, H]."""
        ropes = self.rope_tables(meta.positions)
        return self.mtp[i](streams, next_ids, meta.positions, ropes, meta, self.model.embed_tokens.weight)

    def mtp_logits(self, i: int, streams: torch.Tensor) -> torch.Tensor:
        """[T, N, H] -> fp32 logits [T, V] through MTP layer i's head and the shared lm_head."""
        return self.compute_logits(self.mtp[i].hidden(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight).float()

    def forward_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.compute_logits(self(input_ids, meta))

    # ---- SWA bounded replay ------------------------------------------------------------------------------

    def replay_min_tokens(self, context_len: int) -> int:
        """Fewest replayed tokens that rebuild the compression accumulators from replayed tokens only:
        the unfinished window of every rate, and for CSA also the last finished window (its Ca half)."""
        need = 0
        for kind, r in self.rates.items():
            need = max(need, context_len % r + (r if kind == CSA and context_len >= r else 0))
        return min(need, context_len)

    def replay_exact_tokens(self, context_len: int) -> int:
        """Replayed tokens that rebuild the StateBlock exactly (to fp32 rounding): a layer's window reaches one
        window further back through each layer below it, so num_layers x sliding_window, plus what the
        compression accumulators need (replay_min_tokens); capped at context_len."""
        reach = self.config.num_hidden_layers * self.config.sliding_window
        return min(context_len, reach + self.replay_min_tokens(context_len))

    @torch.no_grad()
    def replay_swa_state(self, token_ids: torch.Tensor, context_len: int, block_table: torch.Tensor,
                         state_slot: int, num_tokens: int | None = None) -> int:
        """Rebuild an approximate state block (SWA rings, compression accumulators) for a sequence whose
        compressed KV for its first `context_len` tokens is already in the paged pool, by recomputing only
        its last R tokens with every query's window cut to the replayed span. token_ids [>= context_len]
        (only the last R of the first context_len are read), block_table [max_blocks]. The paged pool is
        only read. R = num_tokens, default sliding_window + drafts (128 + drafts for V4), raised to
        replay_min_tokens(context_len) and capped at context_len. Returns R."""
        drafts = self.max_backtracking - 1
        R = num_tokens if num_tokens is not None else self.config.sliding_window + drafts
        R = min(max(R, self.replay_min_tokens(context_len)), context_len)
        start = context_len - R
        meta = AttentionMetadata(
            is_prefill=True, positions=torch.arange(start, context_len), slot_mapping=torch.zeros(R, dtype=torch.long),
            query_start_loc=torch.tensor([0, R]), context_lens=torch.tensor([context_len]),
            block_tables=block_table.view(1, -1), state_slots=torch.tensor([state_slot]), block_size=0,
            max_query_len=R, max_context_len=context_len)
        self.forward(token_ids[start:context_len], meta, replay_start=start)
        return R

    # ---- weights ----------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF checkpoint tensors, in DeepSeek's layout (as save_pretrained writes it) or transformers'.
        Raises on missing, unexpected, duplicated or misshapen tensors, naming them."""
        loader = WeightLoader(self)
        n_mtp = _cfg(self.config, "num_nextn_predict_layers", 0) or 0
        mtp = []
        for hf_name, tensor in weights:
            bare = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
            m = _MTP.match(bare)
            if m:
                if int(m.group(1)) >= n_mtp:
                    raise ValueError(f"unexpected checkpoint tensor {hf_name!r}: config.num_nextn_predict_layers "
                                     f"is {n_mtp}")
                mtp.append((int(m.group(1)), bare[m.end():], hf_name, tensor))
                continue
            loader.load(hf_to_param(hf_name), tensor, hf_name)
        loader.finish()
        if mtp:
            self._load_mtp(n_mtp, mtp)
        for m in self.modules():
            if isinstance(m, V4Attention):
                m.fuse_input_projections()

    def _load_mtp(self, n: int, tensors: list) -> None:
        """Checkpoints without MTP tensors (transformers saves none) get no MTP layers; a checkpoint with
        some must have all of them."""
        self.mtp = nn.ModuleList(MTPLayer(self.config, self.dtype) for _ in range(n))
        loader = WeightLoader(self.mtp)
        for i, rest, hf_name, tensor in tensors:
            if rest in _MTP_SHARED:
                continue
            name, expert, shard = mtp_to_param(rest)
            loader.load((f"{i}.{name}", expert, shard), tensor, hf_name)
        loader.finish()

    # ---- memory plan --------------------------------------------------------------------------------------

    def memory_plan_lines(self, spec: CacheSpec, block_size: int) -> list[str]:
        per_type = bytes_per_token_by_layer_type(spec, block_size)
        counts = {t: self.config.layer_types.count(t) for t in per_type}
        lines = [f"  {t}: {counts[t]} layers x {b:.2f} B per source token (paged)" for t, b in per_type.items()]
        lines.append(f"  paged: {spec.bytes_per_block / block_size:.2f} B per source token, "
                     f"{spec.bytes_per_block} B per block of {block_size}")
        ring = sum(t.nbytes for name, t in spec.state.items() if ".swa_ring" in name)
        lines.append(f"  state: {spec.bytes_per_state_block} B per StateBlock = SWA rings of {self.ring_len} tokens "
                     f"{ring} B + compression accumulators {spec.bytes_per_state_block - ring} B (raw window rows in "
                     f"{str(self.dtype).removeprefix('torch.')}, HCA online softmax in float32), all layers")
        main_fmt, index_fmt, ring_fmt = KV_CACHE_FORMATS[self.kv_cache_dtype]
        lines.insert(0, f"  kv_cache_dtype {self.kv_cache_dtype!r}: compressed main KV {main_fmt}, indexer keys "
                        f"{index_fmt}, SWA ring {ring_fmt} ('auto' = model dtype; fp8 = E4M3 + fp32 scale per row)")
        return lines


def bytes_per_token_by_layer_type(spec: CacheSpec, block_size: int) -> dict[str, float]:
    """{layer_type: paged bytes per source token of ONE layer of that type}. The type is read off the
    spec's names (csa_kv -> CSA, hca_kv -> HCA, ring only -> sliding, whose window lives in the state pool)."""
    kinds = {}
    for name in spec.state:
        if name.startswith("layers."):  # not the MTP rings
            kinds.setdefault(int(name.split(".")[1]), SLIDING)
    per_layer = {}
    for name, t in spec.paged.items():
        i = int(name.split(".")[1])
        if ".csa_kv" in name:
            kinds[i] = CSA
        elif ".hca_kv" in name:
            kinds[i] = HCA
        per_layer[i] = per_layer.get(i, 0) + t.nbytes
    out = {}
    for i, kind in sorted(kinds.items()):
        out.setdefault(kind, per_layer.get(i, 0) / block_size)
    return out
