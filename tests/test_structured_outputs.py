"""Structured outputs (xgrammar): every output parses and validates against its constraint on the tiny
models and the default model, speculation stays lossless and grammar-valid, bad constraints fail at
generate() before any work."""
import json
import re

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.default_model import smollm2_path

pytestmark = pytest.mark.usefixtures("one_thread")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "tag"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}}}
REGEX = r"[a-c]{2,4}-[0-9]{2}"
CHOICES = ["yes", "no way", "maybe"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= [a-z] | [0-9] [0-9]'
SAMPLED = [dict(temperature=0), dict(temperature=1.0, seed=11), dict(temperature=0.7, top_k=30, seed=12)]


def check(kind, text):
    """Raises unless text satisfies the constraint."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert re.fullmatch(r"\(([a-z]|[0-9]{2})(,([a-z]|[0-9]{2}))?\)", text), text
    else:
        assert isinstance(json.loads(text), dict)


CONSTRAINTS = {"json": dict(json=SCHEMA, disable_any_whitespace=True), "regex": dict(regex=REGEX),
               "choice": dict(choice=CHOICES), "grammar": dict(grammar=GRAMMAR)}


def params(kind, max_tokens=48, **kw):
    return [SamplingParams(max_tokens=max_tokens, structured_outputs=CONSTRAINTS[kind], **s, **kw) for s in SAMPLED]


@pytest.fixture(scope="module")
def qwen(tiny_qwen3_moe):
    return LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_output_satisfies_its_constraint_on_the_tiny_models(qwen, tiny_llama, kind):
    llama = LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20, block_size=4)
    for llm in (qwen, llama):
        outs = llm.generate(["the quick", "hello world", "paris is"], params(kind), use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "stop", (kind, c.text)
            check(kind, c.text)


def test_sampling_varies_within_the_constraint_and_free_requests_are_untouched(qwen):
    """n = 8 seeded draws under one regex differ yet all match; a request without constraints in the same
    batch gets the tokens it gets alone."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = qwen.generate(["the quick"], free, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=1.5, seed=4, n=8, max_tokens=16, structured_outputs={"regex": REGEX})
    both = qwen.generate(["hello world", "the quick"], [constrained, free], use_tqdm=False)
    texts = [c.text for c in both[0].outputs]
    assert len(set(texts)) > 1 and all(re.fullmatch(REGEX, t) for t in texts)
    assert both[1].outputs[0].token_ids == alone


def test_grammar_completion_ends_the_sequence_under_ignore_eos(qwen):
    out = qwen.generate(["the quick"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                      structured_outputs={"choice": CHOICES}), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CHOICES


@pytest.mark.parametrize("method", ["ngram", "replay"])
def test_speculation_with_structured_outputs_is_lossless(tiny_qwen3_moe, qwen, method):
    """Drafts are cut where the grammar refuses them and verify rows are masked by the grammar's state after
    the drafts before them: the same tokens as plain decoding, all valid."""
    ps = ["the quick", "hello world", "paris is"]
    reqs = params("json") + params("grammar")
    plain = [o.outputs[0].token_ids for o in qwen.generate(ps + ps, reqs, use_tqdm=False)]
    spec = {"method": method, "num_draft_tokens": 3, "verify": "all"}
    if method == "replay":  # right drafts mostly, some random ones the grammar refuses
        spec.update(acceptance=0.7, references={tuple(qwen.get_tokenizer().encode(p)): t for p, t in zip(ps, plain)})
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, speculative=spec)
    outs = llm.generate(ps + ps, reqs, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    for kind, o in zip(["json"] * 3 + ["grammar"] * 3, outs):
        check(kind, o.outputs[0].text)
    if method == "replay":
        assert sum(o.metrics.spec_accepted_drafts for o in outs) > 0


def test_the_default_model_writes_valid_json():
    llm = LLM(smollm2_path(), dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)
    chats = [[{"role": "user", "content": f"Reply with a JSON object with keys name and age for {c}."}]
             for c in ("France", "a cat")]
    for kind, so in (("json", CONSTRAINTS["json"]), ("json_object", {"json_object": True}),
                     ("regex", CONSTRAINTS["regex"]), ("choice", CONSTRAINTS["choice"])):
        outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=96, structured_outputs=so), use_tqdm=False)
        for o in outs:
            assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
            check(kind, o.outputs[0].text)


@pytest.mark.parametrize("so, match", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json does not compile"),
    ({"regex": "[a-"}, "structured_outputs.regex does not compile"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar does not compile"),
])
def test_invalid_constraints_fail_at_generate_before_any_work(qwen, so, match):
    good, steps = SamplingParams(max_tokens=2), dict(qwen.engine.num_steps)
    with pytest.raises(ValueError, match=f"request 1: SamplingParams.{match}"):
        qwen.generate([[5, 6], [7, 8]], [good, SamplingParams(max_tokens=2, structured_outputs=so)], use_tqdm=False)
    assert not qwen.engine.has_unfinished() and qwen.engine.num_steps == steps


@pytest.mark.parametrize("so, match", [({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                                       ({"choice": []}, "exactly one"), ({"choice": [1]}, "wrong type"),
                                       ({"jsn": {}}, "unknown keys")])
def test_malformed_structured_outputs_params_name_the_field(so, match):
    with pytest.raises(ValueError, match=f"SamplingParams.structured_outputs.*{match}"):
        SamplingParams(structured_outputs=so)
    assert StructuredOutputsParams(choice=["a"]).kind == "choice"


def test_async_scheduling_with_structured_outputs_matches_sync(tiny_qwen3_moe, qwen):
    """The grammar advances before the next step launches (its mask is that step's sampling input): the same
    tokens as synchronous steps, and a completed grammar ends its sequence before another row is computed."""
    ps = ["the quick", "hello world", "paris is"]
    reqs = params("json") + params("choice")
    plain = [o.outputs[0].token_ids for o in qwen.generate(ps + ps, reqs, use_tqdm=False)]
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, async_scheduling=True)
    outs = llm.generate(ps + ps, reqs, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain and llm.engine.num_steps["ahead"] > 0
    for kind, o in zip(["json"] * 3 + ["choice"] * 3, outs):
        check(kind, o.outputs[0].text)
