"""Speculative decoding: the MTPVarlen greedy by hand, lossless outputs with every drafter, seeded
sampling token-identical with and without speculation and in any batch, the sampled distribution, and
bad configurations."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams, _C
from deepinfer.spec_decode.drafters import NgramDrafter, check_proposal

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35, 36]]


def varlen(tokens, ms):
    return _C.MTPVarlen(_C.StepTimeCurve(tokens, ms))


def test_greedy_hand_computed():
    v = varlen([1, 2, 3], [10, 10, 20])
    # tau/time: 1/10 -> (1 + .9)/10 = .19 (admit) -> (1.9 + .45)/20 = .1175 (drop: stop)
    assert v.schedule([[0.9, 0.5]]) == [1]
    assert v.budget([[0.9, 0.5]]) == 1


def test_flat_curve_admits_every_positive_draft_and_no_zero_one():
    v = varlen([1, 1000], [5, 5])
    assert v.schedule([[1.0, 1.0, 1.0], [0.5, 0.2, 0.0], [0.0, 0.9, 0.9]]) == [3, 2, 0]


def test_ties_go_to_the_lower_request_and_one_request_works():
    v = varlen([2, 3, 4], [10, 10, 100])
    assert v.schedule([[0.5], [0.5]]) == [1, 0]
    assert varlen([1, 2], [1, 1]).schedule([[0.3, 0.3]]) == [2]


def test_stale_budget_fresh_distribution():
    v = varlen([1, 4, 8], [10, 10, 40])
    budget = v.budget([[0.9, 0.9], [0.9, 0.9]])
    assert budget == 2
    assert _C.MTPVarlen.distribute(budget, [[0.1, 0.1], [0.95, 0.95]]) == [0, 2]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(conf=st.lists(st.lists(st.floats(0, 1), min_size=1, max_size=5), min_size=1, max_size=8).filter(
    lambda c: len({len(r) for r in c}) == 1),
       slope=st.floats(0.0, 2.0))
def test_greedy_is_prefix_and_stops_at_first_drop(conf, slope):
    tokens = [1.0, 2.0, 64.0]
    ms = [10.0, 10.0 + slope, 10.0 + 63 * slope]
    v = varlen(tokens, ms)
    lens = v.schedule(conf)
    curve = _C.StepTimeCurve(tokens, ms)
    cands = sorted(((torch.tensor(r[:j + 1]).double().prod().item(), i, j)
                    for i, r in enumerate(conf) for j in range(len(r))), key=lambda t: (-t[0], t[1], t[2]))
    tau, best, n = float(len(conf)), len(conf) / curve.ms(len(conf)), 0
    for a, _, _ in cands:
        nxt = (tau + a) / curve.ms(len(conf) + n + 1)
        if nxt <= best:
            break
        tau, best, n = tau + a, nxt, n + 1
    assert sum(lens) == n
    expected = [0] * len(conf)
    for _, i, _ in cands[:n]:
        expected[i] += 1
    assert lens == expected


@pytest.fixture(scope="module")
def references(tiny_qwen3_moe):
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_draft_tokens": 3},
    {"method": "replay", "num_draft_tokens": 5, "acceptance": 0.75},
    {"method": "replay", "num_draft_tokens": 4, "acceptance": 0.0, "verify": "all"},   # random tokens
    {"method": "replay", "num_draft_tokens": 3, "acceptance": 1.0, "verify": "all"},
])
def test_greedy_speculation_is_lossless(tiny_qwen3_moe, references, spec):
    spec = dict(spec, references=references) if spec["method"] == "replay" else spec
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, speculative=spec)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [references[tuple(p)] for p in PROMPTS]
    verified = sum(o.metrics.spec_verified_drafts for o in outs)
    accepted = sum(o.metrics.spec_accepted_drafts for o in outs)
    assert 0 <= accepted <= verified
    if spec.get("acceptance") == 1.0:
        assert accepted == verified > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.cache.num_blocks


def test_logprobs_with_speculation_equal_those_without(tiny_qwen3_moe, references):
    """Each emitted token's logprob comes from the verify row that scored it: same tokens, same logprobs
    (top 3 and ranks) as plain decoding, with accepted drafts in the run. Every draft is verified: the greedy
    verify length follows step times measured at start, and on a busy machine it may verify none."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    plain = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4)
    spec = {"method": "replay", "num_draft_tokens": 3, "acceptance": 0.75, "verify": "all", "references": references}
    fast = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, speculative=spec)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = fast.generate(PROMPTS, params, use_tqdm=False)
    assert sum(o.metrics.spec_accepted_drafts for o in got) > 0
    for a, b in zip(got, want):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == 20
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, rel=1e-4)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            for tok in x:
                assert x[tok].rank == y[tok].rank and x[tok].logprob == pytest.approx(y[tok].logprob, abs=1e-4)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, seed=8, max_tokens=20, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_lossless_on_llama_with_preemption(tiny_llama, params):
    ps = PROMPTS * 2
    ref = LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20, block_size=4).generate(ps, params, use_tqdm=False)
    # 14 blocks of 4 tokens (2 layers x K,V x 2 heads x 16 dims x fp32 = 2048 bytes a block)
    small = LLM(tiny_llama, dtype="float32", kv_cache_memory=14 * 2048, block_size=4,
                max_num_seqs=4, max_model_len=56, speculative={"method": "ngram", "num_draft_tokens": 4, "verify": "all"})
    outs = small.generate(ps, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


SAMPLED = [SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True),
           SamplingParams(temperature=1.3, top_k=5, seed=2 ** 70 + 5, max_tokens=16, ignore_eos=True),
           SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=-4, max_tokens=16, ignore_eos=True),
           SamplingParams(temperature=1.0, n=2, seed=9, max_tokens=16, ignore_eos=True)]


def sampled_tokens(llm, prompts=PROMPTS, params=SAMPLED):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def plain_sampled(tiny_qwen3_moe):
    return sampled_tokens(LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4))


@pytest.mark.parametrize("method", ["ngram", "replay"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_seeded_sampling_is_identical_with_speculation(tiny_qwen3_moe, plain_sampled, method, k):
    """A sampled token is the Gumbel-max draw of (seed, position) over the target distribution, and
    verification accepts a draft exactly when it equals that draw: speculation changes no token, also
    once the drafter has adapted its acceptance over earlier requests (the second generate)."""
    spec = {"method": method, "num_draft_tokens": k, "verify": "all"}
    if method == "replay":  # drafts from the sampled continuations themselves: most are accepted
        spec.update(acceptance=0.8, references={tuple(p): toks[0] for p, toks in zip(PROMPTS, plain_sampled)})
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, speculative=spec)
    for _ in range(2):
        outs = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == plain_sampled
        assert sum(o.metrics.spec_verified_drafts for o in outs) > 0
        if method == "replay":
            assert sum(o.metrics.spec_accepted_drafts for o in outs) > 0  # drafts did replace target steps
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.cache.num_blocks


def test_seeded_sampling_is_identical_alone_and_in_a_batch(tiny_qwen3_moe):
    """fp32: the same seeded request alone and among 16 others (different prompts and parameters), with
    and without speculation, gives the same tokens."""
    params = SamplingParams(temperature=0.8, seed=21, max_tokens=16, ignore_eos=True)
    others = [[40 + i, 41 + i, 42] for i in range(16)]
    other_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12 + i % 5, ignore_eos=True) for i in range(16)]
    for spec in (None, {"method": "ngram", "num_draft_tokens": 3}):
        llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, speculative=spec)
        alone = sampled_tokens(llm, [PROMPTS[0]], [params])[0]
        batch = sampled_tokens(llm, others[:7] + [PROMPTS[0]] + others[7:], other_params[:7] + [params] + other_params[7:])
        assert batch[7] == alone


def test_unseeded_requests_follow_the_engine_seed(tiny_qwen3_moe):
    """An unseeded request draws from (engine seed, request id): two LLMs with one seed agree, with or
    without speculation; another seed differs."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def run(seed, spec=None):
        llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, seed=seed, speculative=spec)
        return sampled_tokens(llm, PROMPTS, params)

    first = run(5)
    assert run(5, {"method": "ngram", "num_draft_tokens": 4}) == first
    assert run(6) != first


def test_sampled_speculation_keeps_the_target_distribution(tiny_qwen3_moe):
    """Empirical distribution of the 2nd sampled token, with and without speculation, against the
    exact target marginal computed from transformers (total variation)."""
    from transformers import AutoModelForCausalLM

    prompt = [5, 6, 7]
    params = SamplingParams(temperature=1.5, top_k=6, max_tokens=2, ignore_eos=True, n=1500, seed=11)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32)
    with torch.no_grad():
        p1 = _filtered(model(torch.tensor([prompt])).logits[0, -1], 1.5, 6)
        firsts = p1.nonzero()[:, 0]
        nxt = model(torch.cat([torch.tensor([prompt]).repeat(len(firsts), 1), firsts[:, None]], 1)).logits[:, -1]
        exact = (p1[firsts, None] * torch.stack([_filtered(r, 1.5, 6) for r in nxt])).sum(0)
    # a drafter proposing the most likely token half the time exercises accepts and rejects
    greedy = {tuple(prompt): [int(p1.argmax()), int(exact.argmax())]}
    for spec in (None, {"method": "replay", "num_draft_tokens": 1, "acceptance": 0.5, "references": greedy,
                        "verify": "all"}):
        llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=256, speculative=spec)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        second = torch.bincount(torch.tensor([c.token_ids[1] for c in out.outputs]), minlength=exact.numel())
        tv = 0.5 * (second.double() / second.sum() - exact.double()).abs().sum()
        assert tv < 0.08, f"speculative={spec is not None}: total variation {tv:.3f}"
        if spec:
            assert 0 < out.metrics.spec_accepted_drafts < out.metrics.spec_verified_drafts


def _filtered(logits, temperature, top_k):
    scaled = logits / temperature
    kth = scaled.topk(top_k).values[-1]
    return scaled.masked_fill(scaled < kth, float("-inf")).softmax(-1)


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "num_draft_tokens": 0}, "num_draft_tokens"),
    ({"method": "ngram", "num_draft_tokens": 17}, "num_draft_tokens"),
    ({"method": "mtp", "num_draft_tokens": 2}, "MTP"),
    ({"method": "eagle", "num_draft_tokens": 2}, "method"),
    ({"method": "ngram", "num_draft_tokens": 2, "verify": "some"}, "verify"),
    ({"method": "ngram", "num_draft_tokens": 2, "bogus": 1}, "unknown keys"),
])
def test_bad_speculative_config(tiny_llama, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20, speculative=spec)


def test_bad_drafter_output_is_refused():
    with pytest.raises(ValueError, match="expected"):
        check_proposal(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2), 2, 3, 100)
    with pytest.raises(ValueError, match="non-finite"):
        check_proposal(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[0.5, float("nan")]]), 1, 2, 100)
    with pytest.raises(ValueError, match="vocabulary"):
        check_proposal(torch.tensor([[5, 100]]), torch.zeros(1, 2), 1, 2, 100)


def test_ngram_lookup_finds_the_latest_match():
    d = NgramDrafter(k=3)
    tokens, conf = d.propose(SimpleNamespace(histories=[[1, 2, 3, 9, 1, 2, 3, 4, 1, 2]]))
    assert tokens.tolist() == [[3, 4, 1]] and (conf > 0).all()
    tokens, conf = d.propose(SimpleNamespace(histories=[[7, 8, 9]]))
    assert (conf == 0).all()


def test_models_that_cannot_roll_back_drafts_refuse_speculation(tiny_llama, monkeypatch):
    from deepinfer.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "supports_draft_rollback", False)  # every model here can now
    with pytest.raises(ValueError, match="roll back"):
        LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20,
            speculative={"method": "ngram", "num_draft_tokens": 2})
