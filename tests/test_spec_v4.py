"""DeepSeek-V4 speculative decoding: verify steps and the rollback of rejected drafts, which is free
because every piece of per-sequence state is a ring indexed by position (v4_attention.write_ring).
Tiny random checkpoints from test_deepseek_v4 (fp32, rates CSA 4 / HCA 16, window 8, blocks of 16)."""
import pytest
import torch

from deepinfer import LLM, SamplingParams, _C
from deepinfer.spec_decode import speculator
from test_deepseek_v4 import (CONFIG_B, Driver, hf_greedy, load_ours, make_checkpoint, prompt_of, run_schedule,
                              teacher_forced_logits)

# lengths below a CSA window, across blocks and HCA windows; 40 new tokens cross several of each
PROMPTS = [prompt_of(5, 41), prompt_of(21, 42), prompt_of(38, 43), prompt_of(13, 44)]
N_NEW = 40


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4spec") / "tiny"
    hf = make_checkpoint(path, seed=1)
    return str(path), hf


@pytest.fixture(scope="module")
def references(v4):
    """transformers' greedy continuations, which the engine without speculation reproduces."""
    path, hf = v4
    refs = {tuple(p): hf_greedy(hf, p, N_NEW) for p in PROMPTS}
    plain = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=4).generate(PROMPTS, greedy(),
                                                                                          use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in plain] == [refs[tuple(p)] for p in PROMPTS]
    return refs


def greedy():
    return SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


@pytest.mark.parametrize("config", ["default", "B"])
def test_verify_steps_and_rollback_match_decode_steps(v4, tmp_path, config):
    """Model level, teacher-forced: steps of the next token plus 0..5 drafts (a random number of them
    right, then random ones), rolled back to the right prefix as the scheduler does, give the logits
    one-token decode steps give at every position they keep (to fp32 rounding: the paths sum in other
    orders). Two sequences at once, across CSA and HCA windows and blocks. Config B (rates 2 / 8, two
    indexer heads) has exact-zero indexer score ties, which verify steps must break as decode does."""
    if config == "B":
        make_checkpoint(tmp_path / "b", seed=5, **CONFIG_B)
    model = load_ours(v4[0] if config == "default" else tmp_path / "b")
    prompts = PROMPTS[0::2]
    cont = run_schedule(model, prompts, N_NEW)
    exact = teacher_forced_logits(model, prompts, cont, "auto")  # [N_NEW + 1, B, V]: positions len(p) - 1 ..
    truth = [p + c for p, c in zip(prompts, cont)]
    model.max_backtracking = 6
    d = Driver(model, num_slots=3)
    for i, p in enumerate(prompts):
        d.add(i, p)
    d.step([0, 1], True)
    g = torch.Generator().manual_seed(0)
    live, kept = [0, 1], 0
    while live:
        for i in live:
            p0 = d.seqs[i]["cached"]
            n = min(int(torch.randint(0, 6, (), generator=g)), len(truth[i]) - 1 - p0)  # exact ends there
            right = int(torch.randint(0, n + 1, (), generator=g))
            drafts = truth[i][p0 + 1:p0 + 1 + right] + torch.randint(2, 96, (n - right,), generator=g).tolist()
            d.seqs[i]["tokens"] = truth[i][:p0 + 1] + drafts
        meta = d._meta(live, False)
        ids = torch.tensor([t for i in live for t in d.seqs[i]["tokens"][d.seqs[i]["cached"]:]])
        logits = model.compute_logits(model(ids, meta))
        for row, i in enumerate(live):
            p0, toks, first = d.seqs[i]["cached"], d.seqs[i]["tokens"], int(meta.query_start_loc[row])
            accepted = 0
            while p0 + accepted + 1 < len(toks) and toks[p0 + accepted + 1] == truth[i][p0 + accepted + 1]:
                accepted += 1
            lo = p0 - len(prompts[i]) + 1
            torch.testing.assert_close(logits[first:first + accepted + 1], exact[lo:lo + accepted + 1, i],
                                       rtol=0, atol=1e-4)
            kept += accepted + 1
            d.seqs[i]["tokens"] = truth[i][:p0 + accepted + 2]  # the accepted drafts and the target's token
            d.seqs[i]["cached"] = p0 + accepted + 1  # rollback: the sequence just ends there
        live = [i for i in live if d.seqs[i]["cached"] < len(truth[i])]
    assert kept == sum(len(c) for c in cont)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_draft_tokens": 3},
    {"method": "ngram", "num_draft_tokens": 5, "verify": "all"},
    {"method": "replay", "num_draft_tokens": 5, "acceptance": 0.75},
    {"method": "replay", "num_draft_tokens": 5, "acceptance": 0.75, "verify": "all"},
    {"method": "replay", "num_draft_tokens": 4, "acceptance": 0.0, "verify": "all"},  # random drafts
    {"method": "replay", "num_draft_tokens": 2, "acceptance": 1.0, "verify": "all"},
])
def test_greedy_speculation_is_lossless(v4, references, spec, monkeypatch):
    """Greedy outputs equal transformers' with every drafter and verify rule. The step-time curve is a fixed
    gentle slope: this tiny model's measured curve is noise on a shared 2-vCPU box, and once a spike at 2-4
    query tokens made the greedy verify none of the ngram drafts (CI, stop 33). The greedy against a curve
    is tested in test_spec.py; here every case must verify drafts."""
    monkeypatch.setattr(speculator, "step_time_curve",
                        lambda engine, k: _C.StepTimeCurve([1.0, 64.0], [1.0, 1.63]))
    path, _ = v4
    spec = dict(spec, references=references) if spec["method"] == "replay" else spec
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=4, speculative=spec)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [references[tuple(p)] for p in PROMPTS]
    verified = sum(o.metrics.spec_verified_drafts for o in outs)
    accepted = sum(o.metrics.spec_accepted_drafts for o in outs)
    assert 0 <= accepted <= verified and verified > 0
    if spec.get("acceptance") == 1.0:
        assert accepted == verified
    # every ring sized for the drafts, and the memory plan is what was allocated
    cache, mb = llm.engine.cache, spec["num_draft_tokens"] + 1
    assert llm.engine.model.max_backtracking == mb
    assert cache.state["layers.2.hca_acc"].shape[1] == mb
    assert cache.state["layers.1.csa_kv_ring"].shape[1] == 2 * 4 + mb
    assert cache.allocated_bytes == (cache.num_blocks * cache.spec.bytes_per_block
                                     + cache.num_state_slots * cache.spec.bytes_per_state_block)
    assert llm.engine.scheduler.block_manager.num_free_blocks == cache.num_blocks


def test_lossless_with_preemption(v4, references):
    """Room for 2 sequences and 7 blocks of 16 tokens: sequences are preempted mid-speculation and
    re-prefilled into other sequences' stale blocks and state slots."""
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    from test_deepseek_v4 import tiny_config

    path, _ = v4
    spec = {"method": "replay", "num_draft_tokens": 3, "acceptance": 0.5, "verify": "all", "references": references}
    sizing = DeepseekV4ForCausalLM(tiny_config())
    sizing.max_backtracking = 4
    cache = sizing.cache_spec(16)
    memory = 2 * cache.bytes_per_state_block + 7 * cache.bytes_per_block
    llm = LLM(path, dtype="float32", kv_cache_memory=memory, max_num_seqs=2, max_model_len=96, block_size=16,
              speculative=spec)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert llm.engine.cache.num_blocks == 7
    assert llm.engine.scheduler.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == [references[tuple(p)] for p in PROMPTS]


def test_seeded_sampling_with_speculation_equals_plain_sampling(v4):
    """Sampled tokens depend only on (seed, position, target distribution): ngram and replay drafts on
    DeepSeek-V4 change none of them."""
    path, _ = v4
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=16, ignore_eos=True) for i in range(len(PROMPTS))]
    kwargs = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=4)
    want = [list(o.outputs[0].token_ids) for o in LLM(path, **kwargs).generate(PROMPTS, params, use_tqdm=False)]
    replay = {tuple(p): w for p, w in zip(PROMPTS, want)}
    for spec in ({"method": "ngram", "num_draft_tokens": 3, "verify": "all"},
                 {"method": "replay", "num_draft_tokens": 5, "acceptance": 0.7, "references": replay, "verify": "all"}):
        outs = LLM(path, speculative=spec, **kwargs).generate(PROMPTS, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert sum(o.metrics.spec_verified_drafts for o in outs) > 0


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp4", "fp4_all"])
def test_quantised_pools_are_rollback_safe(v4, kv_cache_dtype):
    """With FP8 / FP4 entries and an FP8 / NVFP4 window ring, rejected drafts' rows are overwritten as in the
    exact pools: speculation (mostly right drafts, then all-wrong ones) gives plain decoding's tokens with
    the same pools, and so does a run that preempts sequences mid-speculation."""
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    from test_deepseek_v4 import tiny_config

    path, _ = v4
    kw = dict(dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=16)
    plain = LLM(path, kv_cache_memory=4 << 20, max_num_seqs=4, **kw).generate(PROMPTS, greedy(), use_tqdm=False)
    refs = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, plain)}
    for acceptance in (0.75, 0.0):
        spec = {"method": "replay", "num_draft_tokens": 4, "acceptance": acceptance, "verify": "all", "references": refs}
        outs = LLM(path, kv_cache_memory=4 << 20, max_num_seqs=4, speculative=spec, **kw).generate(
            PROMPTS, greedy(), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [refs[tuple(p)] for p in PROMPTS]
    sizing = DeepseekV4ForCausalLM(tiny_config())
    sizing.max_backtracking = 5
    cache = sizing.cache_spec(16, kv_cache_dtype)
    llm = LLM(path, kv_cache_memory=2 * cache.bytes_per_state_block + 7 * cache.bytes_per_block, max_num_seqs=2,
              max_model_len=96, speculative=spec, **kw)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert llm.engine.cache.num_blocks == 7 and llm.engine.scheduler.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == [refs[tuple(p)] for p in PROMPTS]
