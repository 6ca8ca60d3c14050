"""Logits processors with vLLM's semantics: hand-computed logits, engine tokens against transformers' logits
processed by an independent reference, speculation lossless with them on, and their bad input."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.layers.logits_processors import LogitsContext, apply_processors, bad_words_token_ids
from tilelang_ops.sampling import sample_ref

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 6, 7, 5, 6, 7, 8, 9]
PENALISED = dict(repetition_penalty=1.6, frequency_penalty=0.9, presence_penalty=0.5, logit_bias={17: 3.0, 40: -2.5})


def processed(logits, params, outputs, prompt=(0,), bad_words=(), stop_ids=()):
    ctx = LogitsContext(params, list(prompt), [list(w) for w in bad_words], list(stop_ids))
    return apply_processors(torch.tensor([logits]), [(ctx, list(outputs))])[0].tolist()


def test_penalties_and_bias_hand_computed():
    """Prompt [0], outputs [1, 1, 2]. Bias first (token 0: 2 + 2 = 4; token 5 clamped to +100), then
    repetition on prompt and output tokens (positive / 2, negative * 2), then frequency (0.5 x count) and
    presence (0.25 once) on output tokens only."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={0: 2.0, 3: -1.5, "5": 200})
    got = processed([2.0, -2.0, 1.0, 3.0, -1.0, 0.0], params, [1, 1, 2])
    assert got == pytest.approx([2.0, -4.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 1.5, -1.0, 100.0])


def test_masks_hand_computed():
    """allowed_token_ids keeps 0, 2, 3, 4, 5; the bad word [4] is always banned, [1, 2, 5] after outputs
    ending in 1, 2, [3, 0] not (outputs do not end in 3); with 3 outputs < min_tokens 4 the stop token 3
    is masked too."""
    inf = float("-inf")
    params = SamplingParams(allowed_token_ids=[0, 2, 3, 4, 5], min_tokens=4)
    got = processed([1.0] * 7, params, [0, 1, 2], bad_words=[[4], [1, 2, 5], [3, 0]], stop_ids=[3])
    assert got == [1.0, inf, 1.0, inf, inf, inf, inf]
    enough = processed([1.0] * 7, params, [0, 1, 2, 6], bad_words=[[1, 2, 5]], stop_ids=[3])
    assert enough == [1.0, inf, 1.0, 1.0, 1.0, 1.0, inf]


def test_rows_without_a_context_and_the_raw_logits_are_untouched():
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    ctx = LogitsContext(SamplingParams(logit_bias={0: 1.0}), [0], [], [])
    out = apply_processors(logits, [None, (ctx, [])])
    assert out.tolist() == [[1.0, 2.0], [4.0, 4.0]] and logits.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def reference_row(logits, params, prompt, outputs):
    """An independent, per-token reading of vLLM's formulas (bias, then penalties)."""
    out = logits.clone()
    for tok, bias in (params.logit_bias or {}).items():
        out[tok] += bias
    for tok in range(out.shape[0]):
        count = outputs.count(tok)
        if tok in prompt or count:
            r = params.repetition_penalty
            out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
        out[tok] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def transformers_tokens(path, prompt, params, n):
    """Greedy or seeded tokens from transformers' logits, processed by reference_row, drawn with the
    engine's documented draw (sample_ref at the sequence's seed and output position)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, outputs = list(prompt), []
    for pos in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        row = reference_row(logits, params, prompt, outputs)[None]
        if params.temperature == 0:
            tok = int(row.argmax())
        else:
            f = lambda x, dt=torch.float32: torch.tensor([x], dtype=dt)  # noqa: E731
            tok = int(sample_ref(row, f(params.temperature), f(params.top_k, torch.int64), f(params.top_p),
                                 f(params.min_p), f(params.seed, torch.int64), f(pos, torch.int64))[0])
        outputs.append(tok)
        ids.append(tok)
    return outputs


@pytest.fixture(scope="module")
def qwen(tiny_qwen3_moe):
    return LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_k=20, seed=7)],
                         ids=["greedy", "seeded"])
def test_engine_tokens_equal_transformers_with_reference_processing(tiny_qwen3_moe, qwen, sampling):
    params = SamplingParams(max_tokens=16, ignore_eos=True, **PENALISED, **sampling)
    got = qwen.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == transformers_tokens(tiny_qwen3_moe, PROMPT, params, 16)
    plain = qwen.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True, **sampling), use_tqdm=False)
    assert got != plain[0].outputs[0].token_ids  # the processors changed something


def test_logprobs_stay_those_of_the_raw_logits(qwen):
    """vLLM's default: the logprob reported for a token is computed before any processor."""
    base = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    plain = qwen.generate([PROMPT], base, use_tqdm=False)[0].outputs[0]
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2,
                            allowed_token_ids=[plain.token_ids[0]])
    out = qwen.generate([PROMPT], forced, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [plain.token_ids[0]] * 6
    assert out.logprobs[0] == plain.logprobs[0]  # same position, same raw logits


def test_allowed_token_ids_and_min_tokens_mask_what_they_name(qwen):
    base = qwen.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    allowed = [3, 30, 60, 90]
    for temperature in (0, 1.2):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=20, ignore_eos=True,
                                allowed_token_ids=allowed)
        assert set(qwen.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids) <= set(allowed)
    stop = base[0]
    out = qwen.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop], min_tokens=3),
                        use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:3] and out.token_ids[0] != base[0]


def test_bad_words_never_appear(qwen):
    """A two-token word from the plain greedy output, banned: neither of its tokenisations appears."""
    tok = qwen.get_tokenizer()
    base = qwen.generate(["the quick"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    word = next(w for w in (tok.decode(base[i:i + 2]) for i in range(len(base) - 1))
                if base_pair_in(bad_words_token_ids(tok, [w]), base) and w.strip())
    out = qwen.generate(["the quick"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word]),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert not base_pair_in(bad_words_token_ids(tok, [word]), out)


def base_pair_in(words, tokens):
    return any(tokens[i:i + len(w)] == w for w in words for i in range(len(tokens)))


def test_truncate_prompt_tokens_keeps_the_last_tokens(qwen):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    short = qwen.generate([PROMPT[-3:]], params, use_tqdm=False)[0]
    cut = qwen.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert cut.prompt_token_ids == PROMPT[-3:] and cut.outputs[0].token_ids == short.outputs[0].token_ids
    whole = qwen.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == PROMPT


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=5)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "replay"])
def test_speculation_with_processors_is_lossless(tiny_qwen3_moe, qwen, sampling, method):
    """Verify row j sees the outputs plus drafts[:j], as plain decoding would at that position: the same
    tokens with and without speculation, with accepted drafts in the run."""
    params = SamplingParams(max_tokens=20, ignore_eos=True, bad_words=["the"], **PENALISED, **sampling)
    ps = [PROMPT, [20, 21, 22, 20, 21]]
    plain = [o.outputs[0].token_ids for o in qwen.generate(ps, params, use_tqdm=False)]
    spec = {"method": method, "num_draft_tokens": 3, "verify": "all"}
    if method == "replay":
        spec.update(acceptance=0.8, references={tuple(p): toks for p, toks in zip(ps, plain)})
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, speculative=spec)
    outs = llm.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    if method == "replay":
        assert sum(o.metrics.spec_accepted_drafts for o in outs) > 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_invalid_processor_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [(dict(logit_bias={10 ** 6: 1.0}), "logit_bias"),
                                           (dict(allowed_token_ids=[1, 10 ** 6]), "allowed_token_ids")])
def test_token_ids_outside_the_vocabulary_fail_before_any_work(qwen, kwargs, field):
    good = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=f"request 1: SamplingParams.{field} has token id 1000000"):
        qwen.generate([[5, 6], [7, 8]], [good, SamplingParams(max_tokens=2, **kwargs)], use_tqdm=False)
    assert not qwen.engine.has_unfinished()
