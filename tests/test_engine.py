"""End-to-end engine behaviour: batching limits, preemption, sampling, stops, errors, handoff."""
import json
import os
import shutil

import pytest
import torch

from deepinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def qwen(tiny_qwen3_moe):
    return LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4)


def test_more_requests_than_max_num_seqs_and_preemption_match_unconstrained(tiny_qwen3_moe, qwen):
    ps = prompts(12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = qwen.generate(ps, params, use_tqdm=False)
    # 3 sequences at most, and a pool of 24 blocks x 4 tokens: decode must evict and recompute.
    small = LLM(tiny_qwen3_moe, dtype="float32", max_num_seqs=3, max_model_len=64,
                kv_cache_memory=24 * small_block_bytes(qwen), block_size=4)
    outs = small.generate(ps, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == small.engine.scheduler.num_preemptions
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert [o.request_id for o in outs] == sorted({o.request_id for o in outs}, key=int)
    assert small.engine.scheduler.block_manager.num_free_blocks == small.engine.cache.num_blocks


def small_block_bytes(llm):
    return llm.engine.cache.spec.bytes_per_block


def test_seeded_sampling_is_reproducible_and_n_gives_n(qwen):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, n=3, ignore_eos=True)
    a = qwen.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    b = qwen.generate([[5, 6, 7], [9, 9, 9, 9]], params, use_tqdm=False)[0]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "n completions should differ when sampling"


def test_greedy_ignores_sampling_knobs_and_sampling_respects_top_k_1(qwen):
    p = [[5, 6, 7, 8]]
    greedy = qwen.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    top1 = qwen.generate(p, SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert top1 == greedy


def test_sampling_goes_through_the_dispatch_point_with_documented_seeds(qwen, monkeypatch):
    """The engine samples with tilelang_ops' "sample" op (the C++ kernel on the CPU): child i of a seeded
    request draws with seed + i at offset = tokens it has generated so far, the token the torch reference
    draws from the same arguments."""
    from deepinfer.layers import cpu_ops
    from tilelang_ops.sampling import sample_ref
    kernel, draws = cpu_ops.sample, {}

    def spy(logits, temperature, top_k, top_p, min_p, seeds, offsets):
        tokens = kernel(logits, temperature, top_k, top_p, min_p, seeds, offsets)
        assert torch.equal(tokens, sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets))
        for s, o, t in zip(seeds.tolist(), offsets.tolist(), tokens.tolist()):
            draws[s, o] = t
        return tokens

    monkeypatch.setattr(cpu_ops, "sample", spy)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=77, n=2, max_tokens=4, ignore_eos=True)
    out = qwen.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert sorted(draws) == [(77 + i, o) for i in range(2) for o in range(4)]
    for c in out.outputs:
        assert c.token_ids == [draws[77 + c.index, o] for o in range(4)]


def test_logprobs_and_cumulative(qwen):
    out = qwen.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1 and len(entry) == 3
        assert max(lp.logprob for lp in entry.values()) == entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_stop_token_ids_and_min_tokens(qwen):
    base = qwen.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = base[3]
    out = qwen.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]),
                        use_tqdm=False)[0].outputs[0]
    first = base.index(stop_tok)
    assert out.token_ids == base[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    late = qwen.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok],
                                                      min_tokens=first + 2), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > first + 1


def test_stop_strings_cut_text(qwen):
    full = qwen.generate(["the quick"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = qwen.generate(["the quick"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
                        use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:full.text.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = qwen.generate(["the quick"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop,
                                                       include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_eos_stops_unless_ignored(tiny_qwen3_moe, qwen):
    base = qwen.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    cfg_path = os.path.join(tiny_qwen3_moe, "config.json")
    cfg = json.load(open(cfg_path))
    eos_dir = tiny_qwen3_moe + "_eos"
    shutil.copytree(tiny_qwen3_moe, eos_dir, dirs_exist_ok=True)
    cfg["eos_token_id"] = base[2]
    json.dump(cfg, open(os.path.join(eos_dir, "config.json"), "w"))
    llm = LLM(eos_dir, dtype="float32", kv_cache_memory=16 << 20, block_size=4)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:base.index(base[2]) + 1] and out.finish_reason == "stop" and out.stop_reason is None


def test_metrics(qwen):
    out = qwen.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_prompt_tokens == 3 and out.metrics.num_generation_tokens == 10
    assert 0 < out.metrics.time_to_first_token <= out.metrics.finished_time - out.metrics.arrival_time


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"), (dict(n=0), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("bad, message", [
    ([], "request 1: prompt is empty"), ([5] * 600, "request 1: prompt has 600 tokens"),
    ([5, 99999], "request 1: token id 99999"), ([5, -1], "request 1: token id -1"),
])
def test_generate_validates_everything_before_running(qwen, bad, message):
    before = qwen.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        qwen.generate([[5, 6, 7], bad, [8, 9]], GREEDY, use_tqdm=False)
    assert not qwen.engine.has_unfinished() and not qwen.engine.seqs
    assert qwen.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


def test_non_finite_logits_fail_one_request_only(qwen, monkeypatch):
    runner = qwen.engine.runner
    real = runner._logits

    target = []

    def poisoned(batch, input_ids, meta, decodes_all):
        logits = real(batch, input_ids, meta, decodes_all)
        target[:] = target or [min(qwen.engine.seqs)]  # the first request's sequence
        for row, seq_id in enumerate(batch.seq_ids):
            if seq_id == target[0]:
                logits[row] = float("nan")
        return logits
    monkeypatch.setattr(runner, "_logits", poisoned)
    outs = qwen.generate([[5, 6, 7], [8, 9, 10]], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "non-finite" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 10


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=10,
                                                            ignore_eos=True)], ids=["greedy", "sampled"])
def test_non_finite_decode_in_one_call_fails_one_request_only(tiny_qwen3_moe, monkeypatch, params):
    """A bf16 decode step that draws its tokens inside its C++ call (decode_drawn), greedy or sampled: a sequence
    whose cached keys turned NaN gets token -1 there and ends with "error"; the other sequence of the batch runs to
    its end."""
    from deepinfer.layers import cpu_ops, gemm_plan
    from tests.conftest import our_kernel_path

    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)
    llm = LLM(tiny_qwen3_moe, dtype="bfloat16", kv_cache_memory=16 << 20, block_size=4,
              num_scheduler_steps=1)  # a Python call per step, which the test counts
    engine, drawn, real = llm.engine, [], cpu_ops.decode_drawn
    monkeypatch.setattr(cpu_ops, "decode_drawn", lambda *a: drawn.append(1) or real(*a))
    monkeypatch.setattr(cpu_ops, "decode_step", lambda *a: pytest.fail("a plain decode step left decode_drawn"))
    for i, ids in enumerate(([5, 6, 7], [8, 9, 10])):
        engine.add_request(f"r{i}", ids, params)
    engine.step()  # the prefill
    target = min(engine.seqs)
    for name, cache in engine.cache.paged.items():
        cache[engine.scheduler.sequence(target).block_table] = float("nan")
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o.outputs[0] for o in engine.step()[0]})
    assert len(drawn) == 9  # every decode step drew in the call
    assert finished["r0"].finish_reason == "error" and "non-finite" in finished["r0"].error
    assert finished["r1"].finish_reason == "length" and len(finished["r1"].token_ids) == 10


def test_model_errors_name_the_file(tmp_path, tiny_llama):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(broken))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(corrupt))
    gguf = tmp_path / "bad.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ValueError, match="bad.gguf"):
        LLM(str(gguf))


def test_missing_and_misshapen_weights_name_the_tensor(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file
    weights = load_file(os.path.join(tiny_llama, "model.safetensors"))
    for name, mutate in [("missing", lambda w: w.pop("model.layers.1.mlp.down_proj.weight")),
                         ("misshapen", lambda w: w.__setitem__("model.norm.weight", torch.ones(3)))]:
        d = tmp_path / name
        shutil.copytree(tiny_llama, d)
        w = dict(weights)
        mutate(w)
        save_file(w, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match="down_proj" if name == "missing" else "model.norm.weight"):
            LLM(str(d), dtype="float32")


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                    SamplingParams(temperature=0.9, seed=4, max_tokens=8, ignore_eos=True),
                                    SamplingParams(temperature=1.1, top_k=8, max_tokens=8, ignore_eos=True),
                                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                   repetition_penalty=1.5, presence_penalty=1.0)],
                         ids=["greedy", "seeded", "unseeded", "penalties"])
def test_prompt_to_completion_handoff_matches_normal(tiny_llama, params):
    """The sequence's sampling seed travels with the handoff: sampled outputs match a NORMAL engine's
    (for unseeded requests both derive it from the engine seed and the request id); so do the prompt and
    first token that the penalties read."""
    ps = prompts(4, seed=3)
    kw = dict(dtype="float32", kv_cache_memory=16 << 20, block_size=4)
    normal = LLM(tiny_llama, **kw).generate(ps, params, use_tqdm=False)
    prefill = LLM(tiny_llama, engine_type="prompt", **kw)
    handed = prefill.generate(ps, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "handoff" for o in handed)
    assert prefill.engine.scheduler.block_manager.num_free_blocks == prefill.engine.cache.num_blocks
    decode = LLM(tiny_llama, engine_type="completion", **kw)
    for h in prefill.engine.handoffs:
        assert decode.engine.import_handoff(h)
    done = {}
    while decode.engine.has_unfinished():
        for out in decode.engine.step()[0]:
            done[out.request_id] = out.outputs[0].token_ids
    by_id = {h.request_id: i for i, h in enumerate(prefill.engine.handoffs)}
    for rid, tokens in done.items():
        assert tokens == normal[by_id[rid]].outputs[0].token_ids


def test_finite_rows_flags_nan_and_both_infinities_but_not_huge_finite_logits():
    """The sampler's finiteness check (amax / amin instead of isfinite over [B, V]) agrees with isfinite on
    NaN, +inf and -inf anywhere in a row, and keeps rows of finite logits near float32's max (whose sum
    would overflow)."""
    from deepinfer.layers.sampler import finite_rows

    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 500] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, 999] = float("-inf")
    logits[4] = 3e38
    logits[5, 7] = -3e38
    assert finite_rows(logits).tolist() == torch.isfinite(logits).all(-1).tolist() == [True, False, False, False, True, True]


def test_engine_add_request_refuses_a_prompt_dict_and_keeps_no_half_request(tiny_llama):
    """The engine-level API takes token ids; a prompt dict (what LLM.generate takes) is refused by request and
    field before anything is registered, and the engine then serves the same request correctly."""
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20)
    engine, ids = llm.engine, prompts(1)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(TypeError, match=r"request 'r0': prompt_token_ids must be a sequence of token ids, got dict"):
        engine.add_request("r0", {"prompt_token_ids": ids}, params)
    assert not engine.seqs and not engine.requests and not engine.has_unfinished()
    engine.add_request("r0", ids, params)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()[0]})
    assert done["r0"] == llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("ids, params, message", [
    ([5, 99999], GREEDY, r"request 'bad': token id 99999 is outside the vocabulary"),
    ([], GREEDY, r"request 'bad': prompt is empty"),
    ([5, 6], SamplingParams(logit_bias={99999: 1.0}), r"request 'bad': SamplingParams.logit_bias has token id 99999"),
    ([5, 6], {"temperature": 0}, r"request 'bad': sampling params must be SamplingParams, got dict"),
    ([5, 6], SamplingParams(logprobs=10**6), r"request 'bad': SamplingParams.logprobs=1000000 is more than the vocab"),
])
def test_engine_add_request_validates_and_the_others_run_on(tiny_llama, ids, params, message):
    """A direct engine user gets the same checks LLM.generate makes, naming the request id, before anything
    is registered; a request added beside it is served as if alone."""
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20)
    engine, good = llm.engine, prompts(1)[0]
    params_good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("good", good, params_good)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", ids, params)
    assert list(engine.requests) == ["good"]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()[0]})
    assert done == {"good": llm.generate([good], params_good, use_tqdm=False)[0].outputs[0].token_ids}
