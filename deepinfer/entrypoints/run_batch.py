"""`python -m deepinfer run-batch -i requests.jsonl -o results.jsonl --model M`, as `vllm run-batch`: OpenAI
batch-format lines in ({"custom_id", "method": "POST", "url", "body"}, url /v1/completions or
/v1/chat/completions), one result line out per input line, in input order: {"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}. A line that cannot run gets status 400 (404 for an unknown
model) and an error object {"code", "message"}; the other lines still run, in one generate() call, and those with
vLLM's "use_beam_search" in LLM.beam_search calls (one per distinct set of beam parameters)."""
import argparse
import json
import sys
import uuid
from dataclasses import dataclass

from deepinfer.engine.beam_search import BeamSearch, beam_sampling
from deepinfer.entrypoints import openai_protocol as protocol
from deepinfer.entrypoints.openai_protocol import RequestError
from deepinfer.llm import LLM
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BatchLine:
    """One input line: what to run, or why it cannot."""

    custom_id: str | None
    url: str = ""
    params: SamplingParams | BeamSearchParams | None = None
    top: int | None = None  # top logprobs per output token in the response; None: no logprobs
    prompt: tuple[str | None, list[int]] | None = None
    error: RequestError | None = None
    status: int = 400
    echo: bool = False  # completions: the prompt starts the text (and logprobs)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run-batch", help="run an OpenAI batch file offline")
    p.add_argument("-i", "--input-file", required=True, help="OpenAI batch requests, one JSON object per line")
    p.add_argument("-o", "--output-file", required=True, help="where the results go, one JSON object per line")
    p.add_argument("--model", required=True, help="HF model directory or .gguf file")
    p.add_argument("--served-model-name", nargs="*", help="names a body's 'model' may use (default: --model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes for the KV pools")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--block-size", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int)
    p.add_argument("--speculative-config", type=json.loads, help="JSON, as LLM(speculative=...)")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--disable-progress-bar", action="store_true")
    p.set_defaults(func=run_batch)


def run_batch(args) -> int:
    """Writes the results; returns 0 (a line's failure is in its result, as vllm run-batch does)."""
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
              kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size, seed=args.seed,
              num_threads=args.num_threads, speculative=args.speculative_config,
              data_parallel_size=args.data_parallel_size)
    with open(args.input_file) as f:
        texts = [t for t in f.read().splitlines() if t.strip()]
    served = args.served_model_name or [args.model]
    lines = [parse_line(i, text, llm, served) for i, text in enumerate(texts)]
    results = run_lines(llm, lines, served[0], not args.disable_progress_bar)
    with open(args.output_file, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    failed = sum(r["error"] is not None for r in results)
    print(f"run-batch: {len(results)} requests, {failed} failed, results in {args.output_file}", file=sys.stderr)
    return 0


def parse_line(index: int, text: str, llm: LLM, served: list[str]) -> BatchLine:
    """One input line -> a BatchLine ready to run (prompt tokenised and checked by the engine) or with its error."""
    try:
        request = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(None, error=RequestError(f"line {index + 1} is not JSON: {e}", "invalid_json"))
    if not isinstance(request, dict):
        return BatchLine(None, error=RequestError(f"line {index + 1} is not a JSON object"))
    line = BatchLine(request.get("custom_id"), request.get("url", ""))
    try:
        body = _check_envelope(request, served)
        line.params = protocol.beam_search_params(line.url, body, llm.engine.config.max_model_len) or \
            protocol.sampling_params(line.url, body)
        line.top, line.echo = protocol.top_logprobs(line.url, body), bool(body.get("echo"))
        prompt = protocol.prompt_of(line.url, body, llm.chat_prompt)
        if isinstance(line.params, BeamSearchParams):
            line.prompt = llm.prepare_request(index, prompt, beam_sampling(line.params))
            BeamSearch(llm.engine, line.params).blocks_needed(index, line.prompt[1])
        else:
            line.prompt = llm.prepare_request(index, prompt, line.params)
    except RequestError as e:
        line.error, line.status = e, 404 if e.code == "model_not_found" else 400
    except ValueError as e:  # the engine's refusal names the request and the field
        line.error = RequestError(str(e))
    return line


def _check_envelope(request: dict, served: list[str]) -> dict:
    if request.get("method", "POST") != "POST":
        raise RequestError(f"method {request.get('method')!r}: only POST is supported")
    if request.get("url") not in (protocol.COMPLETIONS, protocol.CHAT):
        raise RequestError(f"url {request.get('url')!r}: supported are {protocol.COMPLETIONS} and {protocol.CHAT}")
    body = request.get("body")
    if not isinstance(body, dict):
        raise RequestError("'body' must be a JSON object")
    if body.get("model") is not None and body["model"] not in served:
        raise RequestError(f"The model `{body['model']}` does not exist.", "model_not_found")
    return body


def run_lines(llm: LLM, lines: list[BatchLine], model: str, use_tqdm: bool) -> list[dict]:
    """Runs every good line (one generate() call for the sampled ones, one beam_search() per set of beam
    parameters); result objects in input order."""
    good = [line for line in lines if line.error is None]
    outputs = {id(line): out for line, out in [*_generate(llm, good, use_tqdm), *_beam_search(llm, good)]}
    tok = llm.get_tokenizer()
    decode = (lambda t: tok.decode([t])) if tok is not None else str
    results = []
    for line in lines:
        if line.error is not None:
            results.append(_result(line.custom_id, line.status, None, line.error))
            continue
        out = outputs[id(line)]
        failed = [c.error for c in out.outputs if c.finish_reason == "error"]
        if failed:
            results.append(_result(line.custom_id, 500, None, RequestError(failed[0], "generation_error")))
        else:
            body = protocol.response_body(line.url, out, line.top, model, decode, line.echo)
            results.append(_result(line.custom_id, 200, body, None))
    return results


def _prompt(line: BatchLine) -> dict:
    text, ids = line.prompt
    return {"prompt": text, "prompt_token_ids": ids}


def _generate(llm: LLM, lines: list[BatchLine], use_tqdm: bool) -> list[tuple[BatchLine, RequestOutput]]:
    sampled = [line for line in lines if isinstance(line.params, SamplingParams)]
    if not sampled:
        return []
    return list(zip(sampled, llm.generate([_prompt(line) for line in sampled], [line.params for line in sampled],
                                          use_tqdm=use_tqdm)))


def _beam_search(llm: LLM, lines: list[BatchLine]) -> list[tuple[BatchLine, RequestOutput]]:
    """The use_beam_search lines, one LLM.beam_search per distinct BeamSearchParams, as RequestOutputs."""
    groups: dict[str, list[BatchLine]] = {}
    for line in lines:
        if isinstance(line.params, BeamSearchParams):
            groups.setdefault(repr(line.params), []).append(line)
    tok, done = llm.get_tokenizer(), []
    for group in groups.values():
        params = group[0].params
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=params.skip_special_tokens)) if tok else str
        for line, out in zip(group, llm.beam_search([_prompt(line) for line in group], params)):
            text, ids = line.prompt
            done.append((line, protocol.beam_request_output(out, text, ids, params, decode, line.top is not None)))
    return done


def _result(custom_id, status: int, body: dict | None, error: RequestError | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
            "error": None if error is None else {"code": error.code, "message": str(error)}}

