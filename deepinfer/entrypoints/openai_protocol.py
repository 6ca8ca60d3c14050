"""OpenAI request bodies (/v1/completions, /v1/chat/completions) to a prompt and SamplingParams, and
RequestOutputs back to OpenAI response bodies, with vLLM's extra sampling fields accepted as vLLM does."""
import time
import uuid
from dataclasses import fields

from deepinfer.outputs import BeamSearchOutput, CompletionOutput, RequestOutput
from deepinfer.sampling_params import BeamSearchParams, SamplingParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Body fields that map one to one onto SamplingParams (OpenAI's and vLLM's extra ones).
_SAME_NAME = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
              "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
              "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "skip_special_tokens",
              "include_stop_str_in_output", "prompt_logprobs")
# Fields whose non-default values this offline runner cannot honour.
_UNSUPPORTED = {"stream": False, "suffix": None, "tools": None, "structural_tag": None}
# vLLM's older per-constraint fields -> StructuredOutputsParams keys.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class RequestError(ValueError):
    """A request the runner answers with an error object: code is OpenAI's error code."""

    def __init__(self, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.code = code


def sampling_params(url: str, body: dict) -> SamplingParams:
    """An OpenAI body -> SamplingParams. Raises RequestError naming the field."""
    for name, default in _UNSUPPORTED.items():
        if body.get(name, default) != default:
            raise RequestError(f"'{name}' is not supported by deepinfer run-batch")
    if body.get("best_of") not in (None, body.get("n", 1)):
        raise RequestError("'best_of' other than n is not supported")
    if body.get("length_penalty", 1.0) != 1.0:
        raise RequestError("'length_penalty' is for use_beam_search only")
    kwargs = {k: body[k] for k in _SAME_NAME if body.get(k) is not None}
    kwargs["max_tokens"], kwargs["logprobs"] = _max_tokens(url, body), top_logprobs(url, body)
    if body.get("echo"):
        if url != COMPLETIONS:
            raise RequestError("'echo' is supported for /v1/completions only")
        if kwargs["logprobs"] is not None:  # the echoed prompt's tokens get logprobs as the completion's do
            kwargs.setdefault("prompt_logprobs", kwargs["logprobs"])
    kwargs["structured_outputs"] = _structured_outputs(body)
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from e


def _max_tokens(url: str, body: dict) -> int | None:
    """OpenAI's defaults: 16 tokens for completions; chat runs up to max_model_len (None)."""
    limit = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    return 16 if limit is None and url == COMPLETIONS else limit


def top_logprobs(url: str, body: dict) -> int | None:
    """Top logprobs per output token: completions' "logprobs", chat's "top_logprobs" once "logprobs" is true."""
    if url == COMPLETIONS:
        return body.get("logprobs")
    return (body.get("top_logprobs") or 0) if body.get("logprobs") else None


# With use_beam_search, the body fields besides the limits and logprobs that the search honours (n is the width).
_BEAM_FIELDS = ("n", "temperature", "ignore_eos", "length_penalty", "include_stop_str_in_output",
                "skip_special_tokens")
_SAMPLING_DEFAULTS = {f.name: f.default for f in fields(SamplingParams) if f.init}


def beam_search_params(url: str, body: dict, max_model_len: int) -> BeamSearchParams | None:
    """vLLM's use_beam_search: n beams, temperature 1 unless given (OpenAI's default), max_tokens as generation's
    (up to max_model_len for chat). A sampling field the search has no use for is refused (vLLM ignores it), as
    are echo and constrained outputs. None without use_beam_search. Raises RequestError naming the field."""
    if not body.get("use_beam_search"):
        return None
    defaults = {**_SAMPLING_DEFAULTS, "best_of": body.get("n", 1)}
    unused = [k for k in (*_SAME_NAME, "best_of") if k not in _BEAM_FIELDS and body.get(k) not in (None, defaults[k])]
    unused += [k for k in ("echo", "response_format", "structured_outputs", *_GUIDED) if body.get(k)]
    if unused:
        raise RequestError(f"'{unused[0]}' is not supported with use_beam_search")
    kwargs = {k: body[k] for k in _BEAM_FIELDS[1:] if body.get(k) is not None}
    try:
        return BeamSearchParams(beam_width=body.get("n") or 1, max_tokens=_max_tokens(url, body) or max_model_len,
                                **{"temperature": 1.0, **kwargs})
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from e


def beam_request_output(out: BeamSearchOutput, prompt: str | None, prompt_token_ids: list[int],
                        params: BeamSearchParams, decode_text, logprobs: bool) -> RequestOutput:
    """A search's beams as a request's completions, as vLLM's server returns them: the generated tokens only, a
    completing EOS dropped from them unless include_stop_str_in_output (finish_reason "stop", stop_reason its id)
    and from the text in any case; decode_text(token ids) -> text; logprobs: keep each step's candidates."""
    completions = []
    for index, beam in enumerate(out.sequences):
        generated = beam.tokens[len(prompt_token_ids):]
        stop = beam.finish_reason == "stop"  # the search ends a beam so only on an EOS token
        text = decode_text(generated[:-1] if stop else generated)
        tokens = generated[:-1] if stop and not params.include_stop_str_in_output else generated
        completions.append(CompletionOutput(index, text, tokens, beam.cum_logprob,
                                            beam.logprobs if logprobs else None, beam.finish_reason,
                                            generated[-1] if stop else None))
    return RequestOutput("", prompt, prompt_token_ids, completions, True)


def _structured_outputs(body: dict) -> dict | None:
    """The one constraint a body names: OpenAI's response_format (json_schema, json_object), vLLM's
    structured_outputs object or its guided_* fields."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append({"json_object": True})
        elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict) and "schema" in fmt["json_schema"]:
            found.append({"json": fmt["json_schema"]["schema"]})
        elif kind != "text":
            raise RequestError("'response_format' must be {'type': 'text' | 'json_object'} or "
                               "{'type': 'json_schema', 'json_schema': {'schema': ...}}")
    if body.get("structured_outputs") is not None:
        found.append(body["structured_outputs"])
    found += [{key: body[name]} for name, key in _GUIDED.items() if body.get(name) is not None]
    if len(found) > 1:
        raise RequestError("name one constraint: response_format, structured_outputs or one guided_* field")
    return found[0] if found else None


def prompt_of(url: str, body: dict, chat_prompt):
    """The prompt to generate from: completions' "prompt" (one string or one token-id list), or chat
    "messages" rendered by chat_prompt (LLM.chat_prompt) after text parts are joined."""
    if url == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise RequestError("'prompt' must be one string or one list of token ids per batch line")
        return prompt
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    return chat_prompt([_message(i, m) for i, m in enumerate(messages)])


def _message(index: int, message) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{index}] must be an object with a 'role'")
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise RequestError(f"messages[{index}].content: only 'text' parts are supported")
        content = "".join(p.get("text", "") for p in content)
    if not isinstance(content, str):
        raise RequestError(f"messages[{index}].content must be a string or a list of text parts")
    return {"role": message["role"], "content": content}


def response_body(url: str, out: RequestOutput, top: int | None, model: str, decode, echo: bool = False) -> dict:
    """An OpenAI completion or chat.completion object for the request's output; top: the top logprobs asked for
    (top_logprobs); decode(token_id) -> its text (for logprob entries). echo (completions): each choice's text and
    logprobs start with the prompt's. With prompt_logprobs, vLLM's "prompt_logprobs" field (per choice for
    completions, per response for chat)."""
    completions = url == COMPLETIONS
    top = top or 0
    prompt_lp = _prompt_logprobs(out.prompt_logprobs)
    if completions:
        echoed = _Echo(out, decode) if echo else None
        choices = [dict(_completion_choice(c, top, decode, echoed), prompt_logprobs=prompt_lp) for c in out.outputs]
    else:
        choices = [_chat_choice(c, top, decode) for c in out.outputs]
    generated = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    body = {"id": f"{'cmpl' if completions else 'chatcmpl'}-{uuid.uuid4().hex}",
            "object": "text_completion" if completions else "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}}
    return body if completions else dict(body, prompt_logprobs=prompt_lp)


class _Echo:
    """The prompt as an echoed completion starts: its text, tokens and (where scored) their logprob entries, the
    first token's None as OpenAI gives it."""

    def __init__(self, out: RequestOutput, decode):
        ids = out.prompt_token_ids
        self.tokens = [decode(t) for t in ids]
        self.text = out.prompt if out.prompt is not None else "".join(self.tokens)
        self.entries = out.prompt_logprobs or [None] * len(ids)
        self.token_logprobs = [None if e is None else e[t].logprob for t, e in zip(ids, self.entries)]


def _completion_choice(c, top: int, decode, echo: _Echo | None = None) -> dict:
    def keyed(entry):
        return None if entry is None else _text_keyed(_top(entry, top, lambda tok, lp: (decode(tok), lp.logprob)))

    logprobs = None
    if c.logprobs is not None:
        tokens = [decode(t) for t in c.token_ids]
        token_logprobs = [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)]
        top_logprobs = [keyed(e) for e in c.logprobs]
        if echo is not None:
            tokens, token_logprobs = echo.tokens + tokens, echo.token_logprobs + token_logprobs
            top_logprobs = [keyed(e) for e in echo.entries] + top_logprobs
        logprobs = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                    "text_offset": _offsets(tokens)}
    text = c.text if echo is None else echo.text + c.text
    return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def _prompt_logprobs(entries: list | None) -> list | None:
    """RequestOutput.prompt_logprobs as vLLM serialises them: per prompt token None or {token id: {"logprob",
    "rank", "decoded_token"}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]


def _chat_choice(c, top: int, decode) -> dict:
    logprobs = None
    if c.logprobs is not None:
        def entry(tok, lp):
            text = decode(tok)
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}
        logprobs = {"content": [dict(entry(t, e[t]), top_logprobs=_top(e, top, entry))
                                for t, e in zip(c.token_ids, c.logprobs)]}
    return {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def _top(entry: dict, n: int, make) -> list:
    """The n most likely tokens of one position, in rank order (the entry also holds the sampled token)."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [make(tok, lp) for tok, lp in ranked if lp.rank <= n]


def _text_keyed(pairs: list) -> dict:
    """OpenAI's {token text: logprob}; where two tokens decode alike (partial UTF-8 bytes) the likelier stays."""
    out = {}
    for text, logprob in pairs:
        out.setdefault(text, logprob)
    return out


def _offsets(tokens: list[str]) -> list[int]:
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return offsets
