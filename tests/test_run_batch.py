"""`python -m deepinfer run-batch`: OpenAI batch lines in, OpenAI results out in input order, each good line
equal to LLM.generate / LLM.chat with the same parameters, each bad line an error object naming its fault."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
CHAT_URL = "/v1/chat/completions"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "the quick"}]}]


@pytest.fixture(scope="module")
def chat_model(tiny_qwen3_moe):
    """The tiny Qwen3-MoE with a chat template in its tokenizer config."""
    path = tiny_qwen3_moe + "_chat"
    shutil.copytree(tiny_qwen3_moe, path, dirs_exist_ok=True)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["chat_template"] = TEMPLATE
    json.dump(cfg, open(cfg_path, "w"))
    return path


def line(custom_id, url, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


GOOD = [
    line("text", "/v1/completions", model="tiny", prompt="the quick", temperature=0, max_tokens=5, logprobs=2),
    line("ids", "/v1/completions", prompt=[5, 6, 7], temperature=0.8, seed=3, max_tokens=7, ignore_eos=True,
         repetition_penalty=1.3, logit_bias={"9": 4.0}),
    line("chat", "/v1/chat/completions", messages=CHAT, temperature=0, max_completion_tokens=6, logprobs=True,
         top_logprobs=2),
]
BAD = {
    "not json": "{oops",
    "url": line("url", "/v1/embeddings", input="x"),
    "temperature": line("temperature", "/v1/completions", prompt="x", temperature=-1),
    "model": line("model", "/v1/completions", model="gpt-4", prompt="x"),
    "vocab": line("vocab", "/v1/completions", prompt=[5, 10 ** 6]),
    "stream": line("stream", "/v1/chat/completions", messages=CHAT, stream=True),
    "messages": line("messages", "/v1/chat/completions", messages=[{"content": "no role"}]),
}


def expected(llm):
    """The good lines run through the Python API."""
    text = llm.generate(["the quick"], SamplingParams(temperature=0, max_tokens=5, logprobs=2), use_tqdm=False)[0]
    ids = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.8, seed=3, max_tokens=7, ignore_eos=True,
                                                   repetition_penalty=1.3, logit_bias={9: 4.0}), use_tqdm=False)[0]
    chat = llm.chat(CHAT[:1] + [{"role": "user", "content": "the quick"}],
                    SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0]
    return text, ids, chat


def run_cli(tmp_path, model, lines, *extra):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n\n")
    cmd = [sys.executable, "-m", "deepinfer", "run-batch", "-i", str(src), "-o", str(dst), "--model", model,
           "--served-model-name", "tiny", model, "--dtype", "float32", "--kv-cache-memory", str(16 << 20),
           "--block-size", "4", "--num-threads", "1", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(t) for t in dst.read_text().splitlines()], proc.stderr


def test_run_batch_answers_every_line_in_order(tmp_path, chat_model):
    lines = [GOOD[0], BAD["not json"], GOOD[1], BAD["url"], BAD["temperature"], GOOD[2], BAD["model"],
             BAD["vocab"], BAD["stream"], BAD["messages"]]
    results, stderr = run_cli(tmp_path, chat_model, lines)
    assert "Processed prompts" in stderr and "10 requests, 7 failed" in stderr
    assert [r["custom_id"] for r in results] == ["text", None, "ids", "url", "temperature", "chat", "model",
                                                 "vocab", "stream", "messages"]
    # the CLI's configuration, threads included: the GEMM plan is per thread count, and another kernel
    # rounds fp32 logprobs differently
    text, ids, chat = expected(LLM(chat_model, dtype="float32", kv_cache_memory=16 << 20, block_size=4,
                                   num_threads=1))

    completion = results[0]["response"]["body"]
    assert results[0]["error"] is None and results[0]["response"]["status_code"] == 200
    assert completion["object"] == "text_completion" and completion["model"] == "tiny"
    choice = completion["choices"][0]
    assert choice["text"] == text.outputs[0].text and choice["finish_reason"] == text.outputs[0].finish_reason
    # to float rounding: the CLI decodes this request beside the others, and fp32 logits move by an ulp with the batch
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [e[t].logprob for t, e in zip(text.outputs[0].token_ids, text.outputs[0].logprobs)], rel=1e-6, abs=0)
    for top, entry in zip(choice["logprobs"]["top_logprobs"], text.outputs[0].logprobs):
        # OpenAI's {token text: logprob}: two tokens that decode alike share a key
        best = [lp.logprob for lp in entry.values() if lp.rank <= 2]
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(max(best), rel=1e-6, abs=0)
        assert all(min(abs(value - b) for b in best) <= 1e-6 * abs(value) for value in top.values())
    assert completion["usage"] == {"prompt_tokens": len(text.prompt_token_ids), "completion_tokens": 5,
                                   "total_tokens": len(text.prompt_token_ids) + 5}

    sampled = results[2]["response"]["body"]["choices"][0]
    assert sampled["text"] == ids.outputs[0].text and results[2]["response"]["body"]["usage"]["completion_tokens"] == 7

    reply = results[5]["response"]["body"]
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": chat.outputs[0].text}
    content = reply["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(
        [e[t].logprob for t, e in zip(chat.outputs[0].token_ids, chat.outputs[0].logprobs)], rel=1e-6, abs=0)
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"]
               for c in content)

    errors = {i: results[i] for i in (1, 3, 4, 6, 7, 8, 9)}
    for r in errors.values():
        assert r["response"]["body"] is None and r["error"]["message"]
    assert errors[1]["error"]["code"] == "invalid_json"
    assert "/v1/embeddings" in errors[3]["error"]["message"]
    assert "SamplingParams.temperature" in errors[4]["error"]["message"]
    assert errors[6]["response"]["status_code"] == 404 and errors[6]["error"]["code"] == "model_not_found"
    assert "outside the vocabulary" in errors[7]["error"]["message"]
    assert "'stream'" in errors[8]["error"]["message"] and "messages[0]" in errors[9]["error"]["message"]
    assert all(r["response"]["status_code"] == 400 for i, r in errors.items() if i != 6)


def test_structured_outputs_in_a_batch_file(tmp_path, chat_model):
    """OpenAI's response_format and vLLM's structured_outputs / guided_* fields constrain the output."""
    schema = {"type": "object", "properties": {"c": {"enum": ["x", "yz"]}}, "required": ["c"],
              "additionalProperties": False}
    # No free whitespace: the random tiny model would spend any budget on it under OpenAI's json_schema.
    lines = [line("schema", "/v1/chat/completions", messages=CHAT, temperature=0, max_tokens=40,
                  structured_outputs={"json": schema, "disable_any_whitespace": True}),
             line("regex", "/v1/completions", prompt="the quick", temperature=0.9, seed=2, max_tokens=20,
                  structured_outputs={"regex": "[a-c]{3}"}),
             line("choice", "/v1/completions", prompt="paris is", temperature=0, max_tokens=20,
                  guided_choice=["yes", "no way"]),
             line("two", "/v1/completions", prompt="x", guided_regex="a", guided_choice=["a"]),
             line("bad schema", "/v1/completions", prompt="x", guided_json={"type": "nonsense"})]
    results, _ = run_cli(tmp_path, chat_model, lines)
    texts = [r["response"]["body"] and r["response"]["body"]["choices"][0] for r in results]
    assert texts[0]["finish_reason"] == "stop" and json.loads(texts[0]["message"]["content"])["c"] in ("x", "yz")
    assert re.fullmatch("[a-c]{3}", texts[1]["text"]) and texts[2]["text"] in ("yes", "no way")
    assert "name one constraint" in results[3]["error"]["message"]
    assert "structured_outputs.json does not compile" in results[4]["error"]["message"]


def test_response_format_maps_to_structured_outputs():
    from deepinfer.entrypoints.openai_protocol import RequestError, sampling_params

    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert sampling_params(CHAT_URL, {"response_format": fmt}).structured_outputs.json == schema
    assert sampling_params(CHAT_URL, {"response_format": {"type": "json_object"}}).structured_outputs.json_object
    assert sampling_params(CHAT_URL, {"response_format": {"type": "text"}}).structured_outputs is None
    with pytest.raises(RequestError, match="response_format"):
        sampling_params(CHAT_URL, {"response_format": {"type": "xml"}})


def test_a_batch_of_only_bad_lines_still_writes_every_result(tmp_path, chat_model):
    results, _ = run_cli(tmp_path, chat_model, [BAD["url"], BAD["not json"]], "--disable-progress-bar")
    assert [r["error"]["code"] for r in results] == ["invalid_request_error", "invalid_json"]


def test_echo_and_prompt_logprobs_as_vllm_gives_them(tmp_path, chat_model):
    """A loglikelihood request as lm-eval sends it (completions, echo, logprobs=1, one new token): text and logprobs
    start with the prompt's, the first prompt token's logprob null; "prompt_logprobs" per choice and per chat
    response in vLLM's form; echo on chat refused."""
    lines = [line("echo", "/v1/completions", prompt="the quick brown", echo=True, logprobs=1, max_tokens=1,
                  temperature=0),
             line("chat", "/v1/chat/completions", messages=CHAT, temperature=0, max_tokens=2, prompt_logprobs=2),
             line("chat-echo", "/v1/chat/completions", messages=CHAT, echo=True)]
    results, _ = run_cli(tmp_path, chat_model, lines)
    llm = LLM(chat_model, dtype="float32", kv_cache_memory=16 << 20, block_size=4, num_threads=1)
    ref = llm.generate(["the quick brown"], SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    choice = results[0]["response"]["body"]["choices"][0]
    prompt_ids, out = ref.prompt_token_ids, ref.outputs[0]
    assert choice["text"] == "the quick brown" + out.text
    lp = choice["logprobs"]
    tok = llm.get_tokenizer()
    assert lp["tokens"] == [tok.decode([t]) for t in prompt_ids + out.token_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [e[t].logprob for t, e in zip(prompt_ids[1:], ref.prompt_logprobs[1:])]
    want.append(out.logprobs[0][out.token_ids[0]].logprob)
    assert lp["token_logprobs"][1:] == pytest.approx(want, rel=1e-6, abs=0)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    served = choice["prompt_logprobs"]
    assert served[0] is None and len(served) == len(prompt_ids)
    for entry, (t, mine) in zip(served[1:], zip(prompt_ids[1:], ref.prompt_logprobs[1:])):
        assert entry[str(t)]["rank"] == mine[t].rank and entry[str(t)]["decoded_token"] == tok.decode([t])
    chat = results[1]["response"]["body"]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(2 <= len(e) <= 3 for e in chat["prompt_logprobs"][1:])
    assert "'echo' is supported for /v1/completions only" in results[2]["error"]["message"]


def test_use_beam_search_lines_as_vllms_server_answers_them(tmp_path, chat_model):
    """vLLM's use_beam_search: n beams from LLM.beam_search (one call per set of beam parameters, beside the sampled
    lines' generate), each a choice with the generated tokens only; fields a search has no use for are refused, and
    length_penalty without it."""
    from deepinfer import BeamSearchParams

    lines = [line("beam", "/v1/completions", prompt="the quick brown", use_beam_search=True, n=3, max_tokens=6,
                  temperature=0, logprobs=2),
             GOOD[0],
             line("beam-chat", CHAT_URL, messages=CHAT, use_beam_search=True, n=2, max_tokens=4, temperature=0,
                  length_penalty=0.5, top_p=1.0),
             line("top-p", "/v1/completions", prompt="x", use_beam_search=True, n=2, top_p=0.5),
             line("penalty", "/v1/completions", prompt="x", length_penalty=0.5),
             line("wide", "/v1/completions", prompt="x", use_beam_search=True, n=120, max_tokens=2)]
    results, _ = run_cli(tmp_path, chat_model, lines, "--max-num-seqs", "64")
    llm = LLM(chat_model, dtype="float32", kv_cache_memory=16 << 20, block_size=4, num_threads=1)
    tok = llm.get_tokenizer()
    searches = [("the quick brown", BeamSearchParams(3, 6, temperature=0), results[0]),
                (llm.chat_prompt(CHAT[:1] + [{"role": "user", "content": "the quick"}]),
                 BeamSearchParams(2, 4, temperature=0, length_penalty=0.5), results[2])]
    for prompt, params, result in searches:
        want = llm.beam_search([prompt], params)[0].sequences
        body, n = result["response"]["body"], len(tok.encode(prompt))
        assert len(body["choices"]) == params.beam_width
        for choice, beam in zip(body["choices"], want):
            generated = beam.tokens[n:]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert text == tok.decode(generated[:-1] if beam.finish_reason == "stop" else generated,
                                      skip_special_tokens=True)
            assert choice["finish_reason"] == beam.finish_reason
        assert body["usage"]["completion_tokens"] == sum(
            len(b.tokens) - n - (b.finish_reason == "stop") for b in want)
    logprobs = results[0]["response"]["body"]["choices"][0]["logprobs"]
    best = llm.beam_search(["the quick brown"], BeamSearchParams(3, 6, temperature=0))[0].sequences[0]
    generated = best.tokens[len(tok.encode("the quick brown")):len(best.tokens) - (best.finish_reason == "stop")]
    assert logprobs["token_logprobs"] == pytest.approx([e[t].logprob for t, e in zip(generated, best.logprobs)],
                                                       abs=1e-6)
    assert results[1]["response"]["status_code"] == 200 and results[2]["response"]["body"]["choices"][0]["logprobs"] \
        is None
    assert "'top_p' is not supported with use_beam_search" in results[3]["error"]["message"]
    assert "'length_penalty' is for use_beam_search only" in results[4]["error"]["message"]
    assert "request 5: 120 beams" in results[5]["error"]["message"]


def test_beam_outputs_as_completions_drop_a_completing_eos():
    """vLLM's server: an EOS-completed beam's text never shows the EOS, its tokens only with
    include_stop_str_in_output; finish_reason "stop" and stop_reason the EOS id, "length" otherwise."""
    from deepinfer import BeamSearchParams
    from deepinfer.entrypoints.openai_protocol import beam_request_output
    from deepinfer.outputs import BeamSearchOutput, BeamSearchSequence, Logprob

    entries = [{7: Logprob(-0.5, 1)}, {2: Logprob(-0.25, 1)}]
    out = BeamSearchOutput([BeamSearchSequence([1, 5, 7, 2], entries, -0.75, finish_reason="stop"),
                            BeamSearchSequence([1, 5, 7, 8], entries, -1.5, finish_reason="length")])
    for keep in (False, True):
        params = BeamSearchParams(2, 2, include_stop_str_in_output=keep)
        req = beam_request_output(out, "p", [1, 5], params, lambda ids: ",".join(map(str, ids)), True)
        stopped, cut = req.outputs
        assert (stopped.text, stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == \
            ("7", [7, 2] if keep else [7], "stop", 2)
        assert (cut.text, cut.token_ids, cut.finish_reason, cut.stop_reason) == ("7,8", [7, 8], "length", None)
        assert stopped.cumulative_logprob == -0.75 and stopped.logprobs == entries and req.prompt_token_ids == [1, 5]
