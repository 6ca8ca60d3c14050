"""EPLB inside the engine: recorded load, placement with redundant slots, replanning that moves
weights without changing outputs, and plan files from the replanning job."""
import subprocess
import sys

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.qwen3_moe import SparseMoeBlock

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21]]


def last_logits(llm, prompts):
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"logits{i}", p, SamplingParams(max_tokens=1))
    logits = engine.runner.logits(engine.scheduler.schedule())
    engine.abort_all()
    return logits


def test_recorded_counts_equal_a_recount_of_router_outputs(tiny_qwen3_moe, monkeypatch):
    seen = {}
    real_route = SparseMoeBlock.route

    def counting_route(self, x, input_ids=None):
        ids, w = real_route(self, x, input_ids)
        seen.setdefault(self.moe_index, []).append(ids.clone())
        return ids, w
    monkeypatch.setattr(SparseMoeBlock, "route", counting_route)
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, eplb_config={"window_size": 64})
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    load = llm.get_expert_load()
    assert load.shape == (llm.engine.eplb.recorder.filled, 2, 8)
    for layer, ids in seen.items():
        recount = torch.bincount(torch.cat(ids).flatten(), minlength=8)
        assert torch.equal(load.sum(0)[layer], recount)
    assert int(load.sum()) == sum(len(p) + 7 for p in PROMPTS) * 2 * 2   # tokens x top-2 x 2 layers


def test_replanning_moves_weights_and_keeps_logits(tiny_qwen3_moe):
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, enable_eplb=True,
              eplb_config={"num_redundant_experts": 4, "num_gpus": 4, "step_interval": 10 ** 6})
    before = last_logits(llm, PROMPTS)
    ref = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20)
    torch.testing.assert_close(before, last_logits(ref, PROMPTS), rtol=1e-5, atol=1e-5)
    eplb = llm.engine.eplb
    skew = torch.zeros(2, 8, dtype=torch.int64)
    skew[:, 3] = 1000
    skew[:, 5] = 400
    eplb.recorder.buf[0] = skew
    eplb.recorder.end_step()
    old = eplb.placement.phy2log.clone()
    eplb.replan()
    assert eplb.num_moved > 0 and not torch.equal(old, eplb.placement.phy2log)
    assert (eplb.placement.logcnt[:, 3] > 1).all(), "the hot expert gets replicas"
    torch.testing.assert_close(last_logits(llm, PROMPTS), before, rtol=1e-5, atol=1e-5)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_dump_replan_job_and_start_from_plan(tiny_qwen3_moe, tmp_path):
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20)
    ref = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats, plan = tmp_path / "stats.npz", tmp_path / "plan.json"
    llm.dump_expert_load(str(stats))
    job = subprocess.run([sys.executable, "-m", "eplb.replan", "--stats", str(stats), "--num-replicas", "12",
                          "--num-nodes", "1", "--num-gpus", "4", "--out", str(plan)],
                         capture_output=True, text=True, check=True)
    assert "moe_lb" in job.stdout
    planned = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, eplb_plan=str(plan))
    assert planned.engine.eplb.placement.num_physical == 12
    assert planned.engine.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 12
    outs = planned.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_plan_that_does_not_match_the_model(tiny_qwen3_moe, tmp_path):
    from eplb.placement import save_plan

    plan = tmp_path / "bad.json"
    save_plan(str(plan), torch.arange(8).repeat(3, 1), num_gpus=1, num_experts=8)
    with pytest.raises(ValueError, match="num_layers"):
        LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, eplb_plan=str(plan))
    with pytest.raises(ValueError, match="eplb_config"):
        LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, eplb_config={"window": 3})


def test_engine_replans_every_step_interval_without_changing_tokens(tiny_qwen3_moe):
    ref = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, enable_eplb=True,
              eplb_config={"num_redundant_experts": 4, "num_gpus": 4, "step_interval": 3, "window_size": 4})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.eplb.num_replans == llm.engine.eplb.recorder.steps // 3 > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
