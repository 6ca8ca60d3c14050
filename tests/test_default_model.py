"""The embedded default model (a tiny DeepSeek-V4 trained on the stdlib, deepinfer/assets/tiny-moe): greedy
outputs equal transformers' on held-out source, it is trained (held-out perplexity), its MTP drafts are
accepted and lossless, and the expert load the engine records counts exactly the routed tokens."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from deepinfer import LLM, SamplingParams
from deepinfer.default_model import default_model_path, held_out_prompts
from deepinfer.spec_decode.speculator import SpecDecodingStats

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf():
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    from deepinfer.models.loader import load_tokenizer

    return held_out_prompts(load_tokenizer(default_model_path()), 4, 48)


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def generate(llm, prompts, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(prompts):
    llm = LLM(default_model_path(), dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=4)
    return llm, generate(llm, prompts, 24)


def test_greedy_outputs_equal_transformers(hf, prompts, plain):
    assert plain[1] == [hf_greedy(hf, p, 24) for p in prompts]


def test_the_model_is_trained(hf, prompts):
    """Held-out perplexity far below the vocabulary's 4096: 21.7 on these four 48-token windows when it
    was trained (docs/tiny_moe.md reports 30.2 over 64 windows of 256 tokens)."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert math.exp(float(loss)) < 30


# kv_cache_dtype -> (least mean count of the 24 greedy tokens before the first divergence from transformers,
# most |log-probability error| over the first new token's top 20). Measured: see the test's docstring.
QUANT_ACCURACY = {"fp8": (20, 0.3), "fp4": (20, 0.3), "fp4_all": (8, 2.5)}


@pytest.mark.parametrize("kv_cache_dtype", list(QUANT_ACCURACY))
def test_quantised_pools_stay_close_to_transformers(hf, prompts, plain, kv_cache_dtype):
    """Quantised pools on the trained model (fp32, 4 held-out prompts): measured mean tokens before the first
    divergence / max |logprob error|: fp8 24 / 0.09, fp4 24 / 0.10, fp4_all 15.5 / 1.46: an NVFP4 window costs
    far more than FP4 compressed entries, which each pool many tokens (docs/benchmarks.md, "DeepSeek-V4: KV
    cache formats", has a 64-token run)."""
    llm = LLM(default_model_path(), dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=4,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(prompts)).logits[:, -1].log_softmax(-1)
    err = max(abs(lp.logprob - float(ref[i, t])) for i, o in enumerate(outs) for t, lp in o.outputs[0].logprobs[0].items())
    prefix = [next((j for j, (a, b) in enumerate(zip(o.outputs[0].token_ids, ref_tokens)) if a != b), 24)
              for o, ref_tokens in zip(outs, plain[1])]  # plain's tokens are transformers' (the first test)
    print(f"{kv_cache_dtype}: tokens before divergence {prefix}, first-token max |logprob error| {err:.3f}")
    least_prefix, most_err = QUANT_ACCURACY[kv_cache_dtype]
    assert sum(prefix) / len(prefix) >= least_prefix and err <= most_err


def test_mtp_drafts_are_accepted_and_lossless(prompts, plain):
    llm = LLM(default_model_path(), dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=4,
              speculative={"method": "mtp", "num_draft_tokens": 3, "verify": "all"})
    assert int(llm.engine.eplb.recorder.buf.sum()) == 0  # profiling forwards are not counted as load
    assert generate(llm, prompts, 24) == plain[1]
    stats = llm.get_spec_decoding_stats()
    rates = stats.acceptance_per_position()
    assert stats.num_drafts > 0 and rates[0] > 0.3
    assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos, reverse=True)
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)


def test_expert_load_counts_every_routed_token(prompts, plain):
    """Per MoE layer, top_k picks for every token forwarded: each prompt token and each output token but
    the last (which is sampled and never fed back)."""
    llm, outputs = plain
    k = llm.engine.hf_config.num_experts_per_tok
    forwarded = sum(len(p) for p in prompts) + sum(len(o) - 1 for o in outputs)
    load = llm.get_expert_load().sum(0)
    assert load.sum(1).tolist() == [k * forwarded] * load.shape[0]


def test_spec_decoding_stats_count_per_position():
    stats = SpecDecodingStats(3)
    for verified, accepted in ((3, 1), (3, 3), (2, 0), (0, 0)):
        stats.observe(verified, accepted)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.num_draft_tokens_per_pos == [3, 3, 2]
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert stats.acceptance_per_position() == [2 / 3, 1 / 3, 1 / 2]
    assert stats.mean_acceptance_length == 1 + 4 / 3


def test_no_stats_without_speculation(plain):
    with pytest.raises(ValueError, match="speculative"):
        plain[0].get_spec_decoding_stats()


def test_main_job_prints_generations_expert_load_and_acceptance():
    """examples/offline.py (what scripts/run.sh runs): every prompt continued, every MoE layer's load, and
    MTP acceptance (speculation is on by default for a checkpoint with an MTP layer)."""
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "offline.py")
    out = subprocess.run([sys.executable, script, "--max-tokens", "8"], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert len(re.findall(r"^--- .*\[length, 8 tokens", out, flags=re.M)) == 8
    layers = re.findall(r"^expert load, MoE layer (\d+): imbalance ([\d.]+)", out, flags=re.M)
    assert [int(i) for i, _ in layers] == [0, 1, 2, 3] and all(float(x) >= 1.0 for _, x in layers)
    assert re.search(r"^MTP acceptance per draft position: [\d.]+ ", out, flags=re.M)
