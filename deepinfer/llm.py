"""LLM: the offline batch API. generate() validates every request before any work starts, runs
the engine until all are done and returns outputs in input order."""
import logging
import time

from tqdm.auto import tqdm

from deepinfer.config import EngineConfig, parse_dtype, scheduler_steps
from deepinfer.engine.beam_search import BeamSearch
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.outputs import BeamSearchOutput, RequestOutput
from deepinfer.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("deepinfer")


class LLM:
    """model: an HF model directory, a .gguf file or a directory holding one.
    kv_cache_memory: bytes for both KV pools (paged blocks plus one StateBlock per max_num_seqs).
    block_size: source tokens per KV block; defaults to 16, or what the model's cache layout needs.
    max_model_len: defaults to the model's max_position_embeddings; max_num_batched_tokens to
    max(8192, max_model_len).
    engine_type: "normal" (prefill and decode), "prompt" (prefill, then hand off) or "completion".
    num_threads: CPU threads (process-wide): our kernels' pool, and torch's ops in prefill; see EngineConfig.
    enable_eplb: replan expert placement every eplb_config["step_interval"] steps on the last
    eplb_config["window_size"] steps (see engine/eplb.py for all keys); eplb_plan: a plan JSON from
    `python -m eplb.replan` to start with. Expert load is recorded for every MoE model.
    speculative: {"method": "mtp" | "ngram" | "replay", "num_draft_tokens": k, "verify": "greedy" | "all"}
    (see spec_decode/speculator.py); lossless: the tokens are those decoding without it gives (a seeded
    request's included).
    data_parallel_size: k > 1 runs k DP ranks as Ray actors (attention per rank, routed experts split
    over ranks); ray_address joins a Ray cluster instead of starting one on 127.0.0.1; dp_config: the
    DPConfig keys in engine/dp.py (vote intervals, resources per rank, timeouts).
    enable_chunked_prefill: a prompt longer than what is left of a step's max_num_batched_tokens is prefilled
    in chunks over several prefill steps (a model that cannot, or enable_chunked_prefill=False, needs
    max_num_batched_tokens >= max_model_len); long_prefill_token_threshold: at most this many tokens of
    one prompt per step (0: no cap), so short prompts get their first token beside a long one's chunks.
    batch_invariant: every bf16 GEMM runs our kernel with one reduction order for any batch, so a
    request's tokens do not depend on which requests share its steps (otherwise each GEMM shape takes
    the path measured fastest on this CPU, see layers/gemm_plan.py).
    prefix_cache: a directory (or {"path", "max_bytes"}) for the prefix KV store: prompt blocks are kept there
    content-addressed across runs and processes, and a prompt starting with stored blocks prefills only the
    rest (engine/prefix_cache.py).
    disaggregation: {"prefill": n_p, "decode": n_d, ...} runs n_p prefill and n_d decode engines as Ray
    actors with the KV moving between them (see DisaggConfig in engine/disagg.py for all keys).
    state_transfer: how a prompt engine's handoff carries a StateBlock (DeepSeek-V4): "state" sends it,
    "replay" lets the receiver rebuild it exactly from the last tokens, "auto" picks the fewer bytes.
    async_scheduling: decode step N+1 is scheduled while step N's forward runs on a worker thread, and step N's
    outputs are processed while step N+1's runs (same tokens as without; not with speculative=...). Off by
    default: on CPUs the forward and Python's output processing share cores and the GIL (docs/benchmarks.md).
    num_scheduler_steps: k > 1 runs up to k decode steps back to back in one C++ call (schedule, forward, draw,
    stop checks, logprobs) while every running request draws greedily or samples (temperature, top-k, top-p, min-p)
    with nothing wanted per step in Python (no stop strings, logits processors or structured outputs; others
    run one step per call), so a batch-1 step pays Python's share once per k steps; engine.step() then returns
    the outputs of up to k steps, and the loop ends early as soon as a request waits to be prefilled. Same tokens
    as k = 1; not with speculative=... or async_scheduling=True. Default (None): DEFAULT_SCHEDULER_STEPS (8), or 1
    with speculative=... or async_scheduling=True (the setting the benchmarks measure is the one users get)."""

    def __init__(self, model: str, dtype="auto", max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, kv_cache_memory: int = 2 << 30,
                 block_size: int | None = None, seed: int = 0, kv_cache_dtype: str = "auto",
                 engine_type: str = "normal", num_threads: int | None = None, enable_eplb: bool = False,
                 eplb_config: dict | None = None, eplb_plan: str | None = None, speculative: dict | None = None,
                 data_parallel_size: int = 1, ray_address: str | None = None, dp_config: dict | None = None,
                 batch_invariant: bool = False, enable_chunked_prefill: bool = True,
                 long_prefill_token_threshold: int = 0, prefix_cache: str | dict | None = None,
                 disaggregation: dict | None = None, state_transfer: str = "auto", async_scheduling: bool = False,
                 num_scheduler_steps: int | None = None):
        config = EngineConfig(model=model, dtype=parse_dtype(dtype), max_model_len=max_model_len or 0,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens or 0,
                              kv_cache_memory=kv_cache_memory, block_size=block_size or 0,
                              kv_cache_dtype=kv_cache_dtype, seed=seed, engine_type=engine_type,
                              num_threads=num_threads or EngineConfig.default_num_threads(),
                              enable_eplb=enable_eplb, eplb_config=eplb_config, eplb_plan=eplb_plan,
                              speculative=speculative, batch_invariant=batch_invariant,
                              enable_chunked_prefill=enable_chunked_prefill,
                              long_prefill_token_threshold=long_prefill_token_threshold,
                              prefix_cache=prefix_cache, state_transfer=state_transfer,
                              async_scheduling=async_scheduling,
                              num_scheduler_steps=scheduler_steps(num_scheduler_steps, speculative, async_scheduling))
        if disaggregation is not None:  # prefill and decode engines in their own processes (engine/disagg.py)
            if data_parallel_size != 1:
                raise ValueError("LLM(disaggregation=...) with data_parallel_size > 1 is not supported yet")
            from deepinfer.engine.disagg import DisaggEngine
            self.engine = DisaggEngine(config, disaggregation, ray_address)
        elif data_parallel_size == 1:
            self.engine = LLMEngine(config)
        else:  # DP attention + EP MoE over Ray ranks (engine/dp.py)
            from deepinfer.engine.dp import DPEngine
            self.engine = DPEngine(config, data_parallel_size, ray_address, dp_config)
        self._request_counter = 0

    def get_expert_load(self):
        """[W, L, E] tokens per logical expert per MoE layer for the last W completed steps."""
        return self._eplb().recorder.window_load()

    def dump_expert_load(self, path: str) -> None:
        """Writes get_expert_load() to an .npz (load plus shape metadata) for `python -m eplb.replan`."""
        self._eplb().recorder.dump(path)

    def get_spec_decoding_stats(self):
        """SpecDecodingStats (vLLM's counters: drafts, accepted tokens, acceptance per draft position) of
        every verification since the engine started."""
        if self.engine.spec is None:
            raise ValueError("LLM(speculative=...) is not set, so there are no speculative-decoding stats")
        return self.engine.spec.stats

    def _eplb(self):
        if self.engine.eplb is None:
            raise ValueError("this model has no MoE layers, so it has no expert load")
        return self.engine.eplb

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, a list of token-id lists, or
        dicts with "prompt" or "prompt_token_ids". Returns one RequestOutput per prompt, in order."""
        prompts = self._prompt_list(prompts)
        params = self._normalise_params(sampling_params, len(prompts))
        items = [self.prepare_request(i, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))]
        request_ids = []
        for (text, ids), p in zip(items, params):
            request_ids.append(str(self._request_counter))
            self._request_counter += 1
            self.engine.add_request(request_ids[-1], ids, p, prompt=text)
        try:
            outputs = self._run(len(items), use_tqdm)
        except BaseException:
            self.engine.abort_all()
            raise
        return [outputs[r] for r in request_ids]

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: prompts as generate takes them; one BeamSearchOutput per prompt, in order, its
        beams best first (see engine/beam_search.py); concurrency_limit: at most this many prompts searched at once
        (the engine's max_num_seqs and KV pool bound it too). Runs on a single engine (not data_parallel_size > 1
        or disaggregation), without speculative decoding or async scheduling."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search params must be BeamSearchParams, got {type(params).__name__}")
        search = BeamSearch(self.engine, params)
        prompts = self._prompt_list(prompts)
        ids = [self.prepare_request(i, prompt, search.sampling)[1] for i, prompt in enumerate(prompts)]
        try:
            return search.run(ids, concurrency_limit, use_tqdm)
        except BaseException:
            self.engine.abort_all()
            raise

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of them; the chat
        template comes from the model's tokenizer."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt(c) for c in conversations], sampling_params, use_tqdm)

    def chat_prompt(self, conversation: list[dict]) -> str:
        """One conversation as the prompt text its model's chat template makes of it, ready for a reply."""
        tok = self._require_tokenizer("chat")
        return tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, in_tokens, out_tokens = time.perf_counter(), 0, 0
        while self.engine.has_unfinished():
            finished, _ = self.engine.step()
            for out in finished:
                outputs[out.request_id] = out
                in_tokens += len(out.prompt_token_ids)
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
            if finished:
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"input: {in_tokens / elapsed:.1f} toks/s, output: {out_tokens / elapsed:.1f} toks/s")
                bar.update(len(finished))
        bar.close()
        return outputs

    def prepare_request(self, index: int, prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """One prompt (a string, token ids or a dict, see generate) -> (text, the token ids the engine runs:
        tokenised, cut to truncate_prompt_tokens). Raises ValueError naming request `index` if the engine
        would refuse it; changes no state."""
        text, ids = self._one_prompt(index, prompt)
        ids = self._truncate(ids, params)
        self.engine.validate_request(index, ids, params)
        return text, ids

    @staticmethod
    def _prompt_list(prompts) -> list:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty string, list of strings, or list of token-id lists")
        return list(prompts)

    def _one_prompt(self, index: int, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer(f"request {index}: text prompt").encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"request {index}: prompt must be a string, a token-id list or a dict, got {type(prompt).__name__}")

    def _truncate(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (-1: max_model_len), as vLLM keeps them."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return ids
        return ids[-(self.engine.config.max_model_len if keep == -1 else keep):]

    @staticmethod
    def _normalise_params(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return list(params)

    def _require_tokenizer(self, what: str):
        if self.engine.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and the model directory has none")
        return self.engine.tokenizer
