"""Offline throughput in the nano-vllm style: N requests with random prompt and output lengths,
ignore_eos, one seed; prints output tokens/s.

    python examples/bench_offline.py [--model DIR] [--num-seqs 64] [--max-input 256] [--max-output 256]
"""
import argparse
import random
import time

from deepinfer import LLM, SamplingParams
from examples.make_medium_qwen3_moe import make


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the medium Qwen3-MoE checkpoint (made if missing)")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    llm = LLM(args.model or make(), dtype="bfloat16", max_model_len=args.max_input + args.max_output + 1,
              max_num_seqs=args.num_seqs, kv_cache_memory=1 << 30)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, args.max_input))] for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(16, args.max_output))
              for _ in range(args.num_seqs)]
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"Total: {total} output tokens, {elapsed:.1f} s, throughput {total / elapsed:.1f} tok/s "
          f"({sum(map(len, prompts))} prompt tokens)")


if __name__ == "__main__":
    main()
