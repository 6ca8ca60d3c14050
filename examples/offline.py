"""Offline batch generation on the embedded default model (SmolLM2-135M-Instruct, GGUF).

    bash scripts/run.sh                       # default model, a few prompts
    bash scripts/run.sh --model DIR --max-tokens 64
"""
import argparse
import logging

from deepinfer import LLM, SamplingParams
from deepinfer.default_model import default_model_path

PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    llm = LLM(args.model or default_model_path(), dtype=args.dtype, max_model_len=2048, kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(PROMPTS, params):
        c = out.outputs[0]
        print(f"{out.prompt!r} -> {c.text!r}  [{c.finish_reason}, {len(c.token_ids)} tokens, "
              f"ttft {out.metrics.time_to_first_token:.3f}s]")
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)
    print(f"chat -> {chat[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
