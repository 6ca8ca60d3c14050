"""DeepSeek-V4's kv_cache_dtype choices against transformers: cache bytes per sequence at 4K context (ours from
the engine's cache spec, transformers' from its cache tensors, the formula checked against a real prefill) and,
for each dtype, accuracy against transformers' fp32 greedy run: how many of the 64 new tokens match before the
first divergence, and the max / mean |log-probability error| over the top 20 tokens at every position up to
it (the logits' error up to the log-softmax's shift).

    python examples/bench_v4_kv.py [--prompts 4] [--new-tokens 64] [--threads 2]

Two models: the embedded default model (a tiny V4 trained on the stdlib, docs/tiny_moe.md; held-out source as
prompts) and the medium V4 of examples/make_medium_v4.py (random weights and prompts: its next-token
distribution is nearly flat, so small errors flip greedy tokens there far more easily than in a trained model).
Writes "DeepSeek-V4: KV cache formats" in docs/benchmarks.md.
"""
import argparse
import gc
import os

import torch

from bench_v4 import hf_cache_bytes, hf_cache_formula, spec_cache_bytes
from deepinfer import LLM, SamplingParams, platform
from deepinfer.docs import write_section
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from make_medium_v4 import DEFAULT_DIR, make

# (kv_cache_dtype, model dtype): fp32 isolates each format's error; the bf16 model with exact pools is the
# yardstick, the error serving in bf16 costs anyway
RUNS = (("auto", "float32"), ("auto", "bfloat16"), ("fp8", "float32"), ("fp4", "float32"), ("fp4_all", "float32"))
TOP = 20
TITLE = "DeepSeek-V4: KV cache formats"


def hf_reference(path: str, prompts: list[list[int]], n: int):
    """transformers' fp32 greedy continuations [P][n] and log-probabilities [P, n, V]; checks hf_cache_formula
    against the cache of a real prefill and returns transformers' cache bytes per sequence at 4K."""
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf.generate(torch.tensor(prompts), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
        cache = hf(torch.tensor(prompts[:1]), use_cache=True, logits_to_keep=1).past_key_values
    assert hf_cache_bytes(cache) == hf_cache_formula(hf.config, len(prompts[0]), 4), "cache formula is off"
    tokens = out.sequences[:, len(prompts[0]):].tolist()
    logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)
    bytes_4k = sum(hf_cache_formula(hf.config, 4096))  # in the bf16 a served model's cache would be
    del hf
    gc.collect()
    return tokens, logprobs, bytes_4k


def ours(path: str, prompts, n: int, kv_cache_dtype: str, dtype: str, threads: int):
    """Our greedy continuations, top-TOP log-probabilities per position, cache bytes per sequence at 4K."""
    llm = LLM(path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_threads=threads, max_num_seqs=len(prompts),
              max_model_len=len(prompts[0]) + n, block_size=128, kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
    del llm
    gc.collect()
    return result, bf16_cache_bytes(path, kv_cache_dtype)


def bf16_cache_bytes(path: str, kv_cache_dtype: str) -> int:
    """The bf16 model's cache per sequence at 4K, blocks of 128, from the cache spec the engine would
    allocate (the model built on the meta device: no weights)."""
    from transformers import AutoConfig

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(AutoConfig.from_pretrained(path), torch.bfloat16)
    return spec_cache_bytes(model.cache_spec(128, kv_cache_dtype), 128, 4096)


def compare(ref_tokens, ref_logprobs, got) -> dict:
    """Matching prefix per sequence and |logprob error| over our top-TOP at positions up to the divergence."""
    prefixes, errors = [], []
    for i, (tokens, logprobs) in enumerate(got):
        k = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens[i])) if a != b), len(tokens))
        prefixes.append(k)
        for j in range(min(k + 1, len(tokens))):
            errors += [abs(lp.logprob - float(ref_logprobs[i, j, t])) for t, lp in logprobs[j].items()]
    errors = torch.tensor(errors)
    return {"identical": sum(k == len(t) for k, (t, _) in zip(prefixes, got)), "prefix": sum(prefixes) / len(got),
            "max_err": float(errors.max()), "mean_err": float(errors.mean())}


def model_rows(name: str, path: str, prompts, args) -> list[str]:
    ref_tokens, ref_logprobs, hf_4k = hf_reference(path, prompts, args.new_tokens)
    rows = []
    for dt, dtype in RUNS:
        got, bytes_4k = ours(path, prompts, args.new_tokens, dt, dtype, args.threads)
        c = compare(ref_tokens, ref_logprobs, got)
        rows.append(f"| {name} | {dt}{'' if dtype == 'float32' else ', ' + dtype + ' model'} | {bytes_4k:,} | {hf_4k / bytes_4k:.2f}x | {c['identical']} of {len(prompts)} | "
                    f"{c['prefix']:.1f} of {args.new_tokens} | {c['max_err']:.3f} | {c['mean_err']:.4f} |")
        print(rows[-1], flush=True)
    rows.append(f"| {name} | transformers' cache (bf16) | {hf_4k:,} | 1.00x | - | - | - | - |")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from deepinfer.default_model import default_model_path, held_out_prompts
    from deepinfer.models.loader import load_tokenizer

    tiny = default_model_path()
    g = torch.Generator().manual_seed(0)
    models = [("tiny (default model)", tiny, held_out_prompts(load_tokenizer(tiny), args.prompts, 64)),
              ("medium", make(DEFAULT_DIR), torch.randint(2, 32000, (args.prompts, 32), generator=g).tolist())]
    rows = ["| model | kv_cache_dtype | cache bytes / sequence at 4K (bf16 model) | less than transformers | "
            f"identical over {args.new_tokens} tokens | tokens before first divergence | max abs logprob error | "
            "mean |", "|---|---|---|---|---|---|---|---|"]
    for name, path, prompts in models:
        rows += model_rows(name, path, prompts, args)
    write_section(TITLE, intro(args) + "\n".join(rows) + "\n\n" + NOTE)


def intro(args) -> str:
    return (f"`python examples/bench_v4_kv.py --prompts {args.prompts} --new-tokens {args.new_tokens} --threads "
            f"{args.threads}` on `{platform.cpu_flags()}`, load average {os.getloadavg()[0]:.1f} at the end. "
            "Accuracy against transformers in fp32: ours in fp32 with each kv_cache_dtype, and in bf16 with exact "
            f"pools for scale; greedy, {args.prompts} prompts (held-out stdlib source for the tiny model, "
            "random tokens for the medium one); the log-probability errors are over our top 20 tokens at every "
            "position up to a sequence's first divergence (the same context on both sides). Cache bytes are for "
            "the bf16 model at 4096 tokens with blocks of 128: ours = 32 blocks + one StateBlock from the engine's "
            "cache spec; transformers' = its DeepseekV4 cache tensors at 4096 tokens, from the formula "
            "examples/bench_v4.py checks against a real cache (checked again here on each model's prompt).\n\n")


NOTE = ("What the formats store (examples/bench_v4_kv.py does not assume it; the memory plan the engine logs says "
        "it): 'fp8' = compressed entries, indexer keys and the window ring in FP8 E4M3 with an fp32 scale per row; "
        "'fp4' = entries NVFP4 (E2M1 + an E4M3 scale per 16), indexer keys MXFP4 (E8M0 per 32), ring FP8; "
        "'fp4_all' = the ring in NVFP4 too. The raw rows of the unfinished compression windows stay in the model "
        "dtype and HCA's online-softmax accumulators in fp32 in every mode. Against a bf16 cache no mode can pass "
        "16 / 4.5 = 3.56x on the NVFP4 entries or 16 / 4.25 = 3.76x on the MXFP4 keys, so the ratio at any "
        "context stays below about 3.6x; the 4x and 5x targets of issue 14 are out of reach of these formats."
        " On the trained model FP8 and FP4 entries cost an error of the order of what a bf16 model costs anyway; an "
        "NVFP4 window costs several times more. The medium model's random weights give nearly flat next-token "
        "distributions, where any of these, bf16 included, flips a greedy token within a few steps.")


if __name__ == "__main__":
    main()
