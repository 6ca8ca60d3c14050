"""Greedy tokens and last-position logits against transformers' own implementations (fp32)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from deepinfer import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56,
                                                57, 58, 59, 60], [100]]


def hf_greedy(path, prompts, max_new_tokens):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = []
    for ids in prompts:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs, model


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_moe"])
def test_greedy_matches_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    llm = LLM(path, dtype="float32", kv_cache_memory=32 << 20, block_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    expected, _ = hf_greedy(path, PROMPTS, 12)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_moe"])
def test_last_logits_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    llm = LLM(path, dtype="float32", kv_cache_memory=32 << 20, block_size=4)
    engine = llm.engine
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=1))
    ours = engine.runner.logits(engine.scheduler.schedule())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for i, ids in enumerate(PROMPTS):
        ref = model(torch.tensor([ids])).logits[0, -1]
        rel = (ours[i] - ref).norm() / ref.norm()
        assert rel < 1e-4, f"prompt {i}: relative logits error {rel:.2e}"


def test_transformers_4_config_spelling(tiny_qwen3_moe, tmp_path):
    """A config.json as transformers 4 wrote it (rope_theta at top level, num_experts) loads the same."""
    import json
    import shutil

    old = tmp_path / "v4_style"
    shutil.copytree(tiny_qwen3_moe, old)
    cfg = json.loads((old / "config.json").read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["num_experts"] = cfg.pop("num_local_experts", cfg.get("num_experts"))
    (old / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    new_out = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20).generate(PROMPTS, params, use_tqdm=False)
    old_out = LLM(str(old), dtype="float32", kv_cache_memory=16 << 20).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in old_out] == [o.outputs[0].token_ids for o in new_out]
