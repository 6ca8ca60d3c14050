"""Writes the "medium" Qwen3-MoE checkpoint the benchmarks share: vocab 32000, hidden 1024, 16 layers,
16 q / 4 kv heads of 64, 32 experts top-4, moe_intermediate 512, bf16 (913M params, 176M active).

    python examples/make_medium_qwen3_moe.py [OUT_DIR]     # default ~/.cache/deepinfer/medium-qwen3-moe
"""
import os
import sys

import torch

DEFAULT_DIR = os.path.expanduser("~/.cache/deepinfer/medium-qwen3-moe")


def make(out_dir: str = DEFAULT_DIR) -> str:
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                         num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                         num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # zero-initialised routers would send every token to the same experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    print(make(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
