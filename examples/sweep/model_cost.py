"""Bytes moved and FLOPs of one decode step, from a model's config.json.

Covers decoder-only models with GQA attention and a dense or routed-expert MLP (Llama, Qwen3-MoE,
Mixtral shapes). Other architectures return None: a wrong floor is worse than none."""
import json
import os

from examples.sweep.metrics import experts_touched

SUPPORTED = ("llama", "qwen3_moe", "qwen2_moe", "mixtral", "qwen3", "qwen2", "mistral")


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def load_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def shape(cfg: dict) -> dict | None:
    """The numbers the cost needs, or None for an architecture this file does not model."""
    if cfg.get("model_type") not in SUPPORTED:
        return None
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    s = dict(h=h, layers=cfg["num_hidden_layers"], heads=heads, vocab=cfg["vocab_size"],
             kv_heads=_get(cfg, "num_key_value_heads", default=heads),
             head_dim=_get(cfg, "head_dim", default=h // heads),
             experts=_get(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0),
             top_k=_get(cfg, "num_experts_per_tok", default=0),
             moe_inter=_get(cfg, "moe_intermediate_size", "intermediate_size"),
             dense_inter=cfg.get("intermediate_size", 0))
    step, dense_only = _get(cfg, "decoder_sparse_step", default=1), set(cfg.get("mlp_only_layers") or [])
    s["moe_layers"] = 0 if not s["experts"] else sum(
        1 for i in range(s["layers"]) if i not in dense_only and (i + 1) % step == 0)
    return s


def decode_step_cost(s: dict, batch: int, context: float, weight_bytes: float, kv_bytes: float) -> dict:
    """Weights read once per step (only the experts some token routes to), KV read for every
    sequence's context, and 2 FLOPs per weight per token plus attention's QK and PV products."""
    h, hd = s["h"], s["head_dim"]
    attn = h * s["heads"] * hd * 2 + h * s["kv_heads"] * hd * 2
    expert = 3 * h * s["moe_inter"]
    dense_layers = s["layers"] - s["moe_layers"]
    touched = experts_touched(s["experts"], s["top_k"], batch) if s["moe_layers"] else 0
    weights_read = (s["layers"] * attn + s["moe_layers"] * (h * s["experts"] + touched * expert)
                    + dense_layers * 3 * h * s["dense_inter"] + s["vocab"] * h)
    active = (s["layers"] * attn + s["moe_layers"] * (h * s["experts"] + s["top_k"] * expert)
              + dense_layers * 3 * h * s["dense_inter"] + s["vocab"] * h)
    kv = batch * s["layers"] * 2 * s["kv_heads"] * hd * (context + 1) * kv_bytes
    attn_flops = batch * s["layers"] * 4 * s["heads"] * hd * context
    return {"bytes": weights_read * weight_bytes + kv + batch * h * weight_bytes,
            "flops": 2 * active * batch + attn_flops, "experts_touched_per_layer": touched,
            "weight_params_read": weights_read, "active_params_per_token": active}
