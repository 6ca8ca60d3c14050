"""Writes the "medium" DeepSeek-V4 checkpoint the V4 benchmark uses: vocab 32000, hidden 1024, 16 layers
mixing the three attention types (2 sliding, 7 CSA, 7 HCA; rates 4 / 128, window 128), 16 query heads of
128 sharing one KV head, 64 routed experts top-6 (moe_intermediate 512) plus one shared expert, 3 hash-routed
layers, 4 hyper-connection streams, bf16 (1.65B params, ~0.3B active per token). Random weights with a
random tid2eid table, so routing spreads over the experts as in a trained model.

    python examples/make_medium_v4.py [OUT_DIR]     # default ~/.cache/deepinfer/medium-v4
"""
import os
import sys

import torch

DEFAULT_DIR = os.path.expanduser("~/.cache/deepinfer/medium-v4")
SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = [SWA, HCA] + [CSA, HCA] * 6 + [SWA, CSA]


def make(out_dir: str = DEFAULT_DIR) -> str:
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=32000, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=16,
        num_attention_heads=16, head_dim=128, q_lora_rank=384, partial_rotary_factor=0.5,
        num_experts_per_tok=6, n_routed_experts=64, n_shared_experts=1, o_groups=4, o_lora_rank=256,
        index_n_heads=16, index_head_dim=64, index_topk=128, sliding_window=128,
        layer_types=LAYER_TYPES, compress_rates={CSA: 4, HCA: 128},
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 13, hc_mult=4, max_position_embeddings=8192,
        num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, dtype="bfloat16")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.gate
            if hasattr(router, "tid2eid"):  # zeros would send every token to expert 0, k times
                router.tid2eid.copy_(torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(32000)]))
            layer.self_attn.sinks.normal_(0, 0.5, generator=g)
    model.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    print(make(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
