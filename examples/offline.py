"""Offline batch generation on the embedded default model: a tiny DeepSeek-V4 MoE trained on the Python
standard library (docs/tiny_moe.md), drafting with its own MTP layer. Prints the generations, each MoE
layer's expert load and imbalance, and the MTP drafter's measured acceptance per draft position.

    bash scripts/run.sh                                   # default model, MTP speculation on
    bash scripts/run.sh --model DIR_OR_GGUF --speculative none --max-tokens 64
"""
import argparse
import json
import logging
import os

from deepinfer import LLM, SamplingParams
from deepinfer.default_model import default_model_path

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "    def __repr__(self):\n",
    "def read_lines(path):\n    \"\"\"Return the lines of the file at *path*.\"\"\"\n",
    "try:\n    import threading\nexcept ImportError:\n",
    "    if not isinstance(name, str):\n",
    "# Copyright (C) 2001 Python Software Foundation\n",
]


def has_mtp_layer(path: str) -> bool:
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        return False
    with open(config) as f:
        return (json.load(f).get("num_nextn_predict_layers") or 0) > 0


def speculative_config(args, path: str) -> dict | None:
    use = args.speculative == "mtp" or (args.speculative == "auto" and has_mtp_layer(path))
    return {"method": "mtp", "num_draft_tokens": args.num_draft_tokens, "verify": "all"} if use else None


def print_expert_load(llm: LLM) -> None:
    """Tokens routed to each expert over the run, per MoE layer, and max / mean (1.0 is balanced)."""
    load = llm.get_expert_load().sum(0)
    for layer, row in enumerate(load.tolist()):
        mean = sum(row) / len(row)
        print(f"expert load, MoE layer {layer}: imbalance {max(row) / mean:.2f}  [{' '.join(str(int(x)) for x in row)}]")


def print_acceptance(llm: LLM) -> None:
    stats = llm.get_spec_decoding_stats()
    rates = " ".join("-" if r is None else f"{r:.2f}" for r in stats.acceptance_per_position())
    print(f"MTP acceptance per draft position: {rates}  ({stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts "
          f"accepted over {stats.num_drafts} verifications; {stats.mean_acceptance_length:.2f} tokens per step)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded tiny MoE)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--speculative", choices=["auto", "mtp", "none"], default="auto",
                        help="auto: MTP when the checkpoint has an MTP layer")
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    path = args.model or default_model_path()
    spec = speculative_config(args, path)
    llm = LLM(path, dtype=args.dtype, max_model_len=2048, kv_cache_memory=256 << 20, speculative=spec)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(PROMPTS, params):
        c = out.outputs[0]
        print(f"--- {out.prompt!r} [{c.finish_reason}, {len(c.token_ids)} tokens, "
              f"ttft {out.metrics.time_to_first_token:.3f}s]\n{out.prompt}{c.text}")
    if getattr(llm.get_tokenizer(), "chat_template", None):
        chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)
        print(f"chat -> {chat[0].outputs[0].text!r}")
    try:
        print_expert_load(llm)
    except ValueError as e:  # a dense model
        print(f"no expert load: {e}")
    if spec is not None:
        print_acceptance(llm)


if __name__ == "__main__":
    main()
