"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

Python keeps what only Python needs per sequence (sampling parameters, seed, logprobs,
detokenised text); the C++ Scheduler owns tokens, blocks and state slots."""
import hashlib
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import torch

from deepinfer import _C, memory, platform
from deepinfer.config import EngineConfig, hf_get
from deepinfer.engine.cache_engine import CacheEngine
from deepinfer.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from deepinfer.engine.eplb import EplbConfig, EplbState
from deepinfer.engine.kv_transfer import Handoff, StateTransfer
from deepinfer.engine.prefix_cache import PrefixCache
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.layers import cpu_ops, gemm_plan
from deepinfer.layers.linear import packable_linears
from deepinfer.layers.logits_processors import LogitsContext, bad_words_token_ids, needs_processing
from deepinfer.layers.structured_output import GrammarCompiler, SequenceGrammar
from deepinfer.layers.moe import balanced_moe_blocks, packable_experts
from deepinfer.layers.sampler import SamplerOutput, SamplingBatch
from deepinfer.models.loader import load_model, load_tokenizer
from deepinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode.speculator import SpecConfig, Speculator, prepare_model

logger = logging.getLogger("deepinfer")

_ENGINE_TYPES = {"normal": _C.EngineType.NORMAL, "prompt": _C.EngineType.PROMPT,
                 "completion": _C.EngineType.COMPLETION}
_REASONS = {_C.FinishReason.STOP: "stop", _C.FinishReason.LENGTH: "length",
            _C.FinishReason.ERROR: "error", _C.FinishReason.ABORT: "abort"}


@dataclass
class SeqState:
    request_id: str
    index: int
    params: SamplingParams
    seed: int  # sampling seed: every sampled token is a function of it, its position and the logits
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    detokenizer: IncrementalDetokenizer | None = None  # None: the model ships no tokenizer
    logits_ctx: LogitsContext | None = None  # None: no logits processor touches this request
    grammar: SequenceGrammar | None = None  # structured outputs: where the sequence is in its grammar
    cached_prefix: tuple | None = None  # prefix-store (blocks, last block's hash) to write when first scheduled
    beam: bool = False  # LLM.beam_search's: forked or retargeted between steps, so one step per call

    @property
    def plain_draw(self) -> bool:
        """Whether its tokens are the sample op's draw from the raw logits, with at most their logprobs wanted: no
        logits processors or grammar."""
        return self.logits_ctx is None and self.grammar is None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seq_ids: list[int]
    metrics: RequestMetrics
    # SamplingParams.prompt_logprobs: entry p scores prompt token p (None for p = 0), appended as the first child's
    # prefill chunks reach them; None when not wanted
    prompt_logprobs: list | None = None
    # parallel sampling: the children after the first, waiting for its prompt's KV (LLMEngine._add_siblings)
    siblings: list[SeqState] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig, agree=list):
        """agree: [bool] -> [bool], settles which weights are packed (_pack_weights): the ranks of an
        expert-parallel group, whose experts move between them as bytes, must all hold the same layout."""
        config.validate()
        self.config = config
        platform.set_threads(config.num_threads)
        self.model, self.hf_config = load_model(config.model, config.dtype)
        config.fill_defaults(self.hf_config, self.model.block_size_multiple)
        self.tokenizer = load_tokenizer(config.model)
        self.eplb = self._make_eplb()
        self.vocab_size = self.hf_config.vocab_size
        if config.block_size % self.model.block_size_multiple:
            raise ValueError(f"LLM(block_size={config.block_size}) must be a multiple of "
                             f"{self.model.block_size_multiple} for this model")
        self.chunked_prefill = config.enable_chunked_prefill and self.model.supports_chunked_prefill
        if not self.chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
            why = "enable_chunked_prefill=False" if not config.enable_chunked_prefill else \
                f"{type(self.model).__name__} prefills whole prompts"
            raise ValueError(f"LLM(max_num_batched_tokens={config.max_num_batched_tokens}) must be >= max_model_len "
                             f"({config.max_model_len}): {why}")
        spec_cfg = SpecConfig.from_dict(config.speculative) if config.speculative else None
        if spec_cfg is not None:
            prepare_model(self.model, spec_cfg)
        logger.info("weights on huge pages: %.0f MiB", memory.to_huge_pages(self.model) / 2**20)
        gemm_plan.PLAN.invariant = config.batch_invariant
        decode_rows = config.max_num_seqs * (1 + (spec_cfg.num_draft_tokens if spec_cfg else 0))
        max_rows = max(config.max_num_batched_tokens, decode_rows)
        # AVX512-BF16's packed kernel rounds activations to bf16; batch_invariant keeps the exact fp32-input kernel.
        if cpu_ops.PACKED_ISA and config.dtype == torch.bfloat16 and not config.batch_invariant:
            self._pack_weights(max_rows, agree)
        gemm_plan.PLAN.prepare(self.model, config.dtype, max_rows, decode_rows)
        spec = self.model.cache_spec(config.block_size, config.kv_cache_dtype)
        self.cache = CacheEngine(spec, config.kv_cache_memory, config.max_num_seqs, config.block_size)
        self.model.bind_cache(self.cache.paged, self.cache.state)
        self.cache.log_memory_plan(config.max_model_len)
        for line in getattr(self.model, "memory_plan_lines", lambda *_: [])(spec, config.block_size):
            logger.info("memory plan: %s", line)
        self.scheduler = _C.Scheduler(self._scheduler_config())
        self.runner = ModelRunner(self.model, config.block_size)
        self.spec = Speculator(spec_cfg, self) if spec_cfg is not None else None
        if self.eplb is not None:  # the step-time profile's forwards routed tokens of no request
            self.eplb.recorder.discard_step()
        self.seqs: dict[int, SeqState] = {}
        self.requests: dict[str, Request] = {}
        self._parents: set[int] = set()  # sequences whose request's other children wait for their prompt's KV
        self.handoffs: list[Handoff] = []
        self.state_transfer = StateTransfer(self.model, spec, config.block_size, config.state_transfer)
        self.prefix_cache = PrefixCache.from_config(config, spec) if config.prefix_cache else None
        self._seq_counter = itertools.count()
        self._grammars: GrammarCompiler | None = None
        self.num_steps = {"prefill": 0, "decode": 0, "ahead": 0}  # ahead: decode steps scheduled ahead
        # Async scheduling: the worker thread runs the forward and sampling of the decode step in flight;
        # _unprocessed holds the steps scheduled but not processed, which abort_all discards.
        self._pool = ThreadPoolExecutor(1, "deepinfer-forward", platform.set_threads, (config.num_threads,)) \
            if config.async_scheduling else None
        self._flight: tuple | None = None  # (batch, future)
        self._unprocessed: list = []

    def _make_eplb(self) -> EplbState | None:
        blocks = balanced_moe_blocks(self.model)
        if not blocks:
            if self.config.enable_eplb or self.config.eplb_plan:
                raise ValueError("LLM(enable_eplb / eplb_plan): the model has no routed MoE layers")
            return None
        return EplbState(blocks, EplbConfig.from_dict(self.config.eplb_config), self.config.enable_eplb,
                         self.config.eplb_plan)

    def _pack_weights(self, max_rows: int, agree) -> None:
        """Packs in bf16 pairs each expert group and Linear whose shape's plan runs the row buckets up to max_rows
        faster packed (gemm_plan packs_experts / packs_linear), as agree settles it. The buckets of prefill steps
        count too: where AMX tiles read row-major weights, packing could win a few decode rows and lose prefills."""
        rows, dtype = gemm_plan.buckets_up_to(max_rows), self.config.dtype
        experts, linears = packable_experts(self.model), packable_linears(self.model)
        faster = [gemm_plan.PLAN.packs_experts(m.gate_up_proj.data, m.down_proj.data, rows) for m in experts]
        faster += [gemm_plan.PLAN.packs_linear(dtype, m.weight.data, rows) for m in linears]
        for m, pack in zip(experts + linears, agree(faster)):
            if pack:
                m.pack_weights()
        logger.info("weights packed in bf16 pairs (%s) where measured faster: %d of %d expert groups, %d of %d "
                    "linears", cpu_ops.PACKED_ISA, sum(m.packed for m in experts), len(experts),
                    sum(m.packed for m in linears), len(linears))

    def _scheduler_config(self):
        c = _C.SchedulerConfig()
        c.max_num_seqs, c.max_model_len = self.config.max_num_seqs, self.config.max_model_len
        c.max_num_batched_tokens, c.block_size = self.config.max_num_batched_tokens, self.config.block_size
        c.num_blocks, c.num_state_slots = self.cache.num_blocks, self.config.max_num_seqs
        c.chunked_prefill, c.long_prefill_token_threshold = self.chunked_prefill, self.config.long_prefill_token_threshold
        c.engine_type = _ENGINE_TYPES[self.config.engine_type]
        c.eos_token_ids = self.eos_token_ids()
        return c

    def eos_token_ids(self) -> list[int]:
        eos = hf_get(self.hf_config, "eos_token_id")
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        return [int(i) for i in ids if i is not None and i >= 0]

    def validate_request(self, index: int | str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming the request (index, or repr of its id); changes no state."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {index}: sampling params must be SamplingParams, got {type(params).__name__}")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError(f"request {index}: prompt is empty")
        if n >= self.config.max_model_len:
            raise ValueError(f"request {index}: prompt has {n} tokens; max_model_len="
                             f"{self.config.max_model_len} leaves no room for output")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {index}: token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.vocab_size:
                raise ValueError(f"request {index}: SamplingParams.{name}={getattr(params, name)} is more than the "
                                 f"vocabulary ({self.vocab_size} tokens)")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"request {index}: stop strings need a tokenizer and the model ships none")
        self._validate_processors(index, params)

    def _validate_processors(self, index: int, params: SamplingParams) -> None:
        token_lists = {"logit_bias": params.logit_bias or {}, "allowed_token_ids": params.allowed_token_ids or []}
        for name, ids in token_lists.items():
            bad = [t for t in ids if not t < self.vocab_size]
            if bad:
                raise ValueError(f"request {index}: SamplingParams.{name} has token id {bad[0]}, outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        if params.bad_words and self.tokenizer is None:
            raise ValueError(f"request {index}: SamplingParams.bad_words needs a tokenizer and the model ships none")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError(f"request {index}: SamplingParams.structured_outputs needs a tokenizer and the "
                                 "model ships none")
            try:
                self.grammar_compiler().compile(params.structured_outputs)
            except ValueError as e:
                raise ValueError(f"request {index}: {e}") from e

    def grammar_compiler(self) -> GrammarCompiler:
        """Made on the first structured request (xgrammar reads the whole vocabulary once)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids())
        return self._grammars

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, child: tuple[int, int] | None = None, beam: bool = False) -> None:
        """child: (index, seed) to run only that child of a request whose children are spread over engines
        (disaggregation); default: all params.n children, with sequence_seed's seeds. beam: its sequences are
        LLM.beam_search's beams (fork_sequence, set_last_token, drop_sequence)."""
        if isinstance(prompt_token_ids, (str, bytes, dict)) or not hasattr(prompt_token_ids, "__len__"):
            raise TypeError(f"request {request_id!r}: prompt_token_ids must be a sequence of token ids, got "
                            f"{type(prompt_token_ids).__name__} (LLM.generate takes prompt dicts and strings)")
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already running")
        # the fronts validate a whole batch first; checking again here costs ~0.1 us per prompt token and
        # keeps a direct engine user's bad request from failing inside a step shared with others
        self.validate_request(repr(request_id), prompt_token_ids, params)
        limits = self._limits(params)
        logits_ctx = self._logits_context(params, prompt_token_ids)
        children = [child] if child else [(i, self.sequence_seed(request_id, params, i)) for i in range(params.n)]
        # a prompt to score is prefilled whole: cached blocks would skip the logits that score their tokens
        scored = params.prompt_logprobs is not None
        blocks, last_hash = self.prefix_cache.lookup(prompt_token_ids) if self.prefix_cache and not scored \
            else ([], None)
        states = [SeqState(request_id, index, params, seed, detokenizer=self._detokenizer(params),
                           logits_ctx=logits_ctx, grammar=self._grammar(params, []),
                           cached_prefix=(blocks, last_hash) if blocks else None, beam=beam)  # children share blocks
                  for index, seed in children]
        # Children after the first fork from its computed prompt (_add_siblings) where the engine can copy KV
        # between sequences: speculation's drafter ring holds the first child's first token, not theirs.
        siblings = states[1:] if self.spec is None and self.config.engine_type == "normal" else []
        seq_ids = []
        for state in states[:len(states) - len(siblings)]:
            seq_id = next(self._seq_counter)
            # only then is it the engine's
            self.scheduler.add_sequence(seq_id, prompt_token_ids, limits, len(blocks) * self.config.block_size)
            self.seqs[seq_id] = state
            seq_ids.append(seq_id)
        metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(prompt_token_ids))
        self.requests[request_id] = Request(request_id, prompt, list(prompt_token_ids), seq_ids, metrics,
                                            [None] if scored else None, siblings)
        if siblings:
            self._parents.add(seq_ids[0])

    def sequence_seed(self, request_id: str, params: SamplingParams, index: int) -> int:
        """The sampling seed of child `index` of a request, as an int64: the request's seed plus the index,
        or for an unseeded request one derived from the engine's seed and the request id. Nothing else
        (batch, DP rank, speculation, preemption) enters, so `LLM(seed=s)` runs reproduce as seeded ones do."""
        if params.seed is None:
            digest = hashlib.blake2b(f"{self.config.seed}:{request_id}".encode(), digest_size=8).digest()
            base = int.from_bytes(digest, "little")
        else:
            base = params.seed
        return (base + index + 2 ** 63) % 2 ** 64 - 2 ** 63

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        return None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)

    def _logits_context(self, params: SamplingParams, prompt_token_ids: list[int]) -> LogitsContext | None:
        if not needs_processing(params):
            return None
        words = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        stops = ([] if params.ignore_eos else self.eos_token_ids()) + params.stop_token_ids
        return LogitsContext(params, list(prompt_token_ids), words, stops)

    def _grammar(self, params: SamplingParams, outputs: list[int]) -> SequenceGrammar | None:
        """A sequence's matcher, advanced over the outputs it already has (an imported sequence's first token)."""
        if params.structured_outputs is None:
            return None
        grammar = self.grammar_compiler().matcher(params.structured_outputs)
        grammar.accept(outputs)
        return grammar

    def _limits(self, params: SamplingParams):
        """What the C++ output processing needs to stop a sequence."""
        return _C.SamplingLimits(params.max_tokens or self.config.max_model_len, params.min_tokens,
                                 params.ignore_eos, params.stop_token_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._flight is not None

    def step(self, want=_C.StepType.IDLE) -> tuple[list[RequestOutput], int]:
        """Runs one step (of type `want` when a DP group voted one). Returns the requests that
        finished in it and the tokens it processed (0: nothing of that type could run)."""
        if self._flight is not None:
            return self._step_in_flight(want)
        if self.spec is not None:
            self.spec.prepare(self)
        batch = self.scheduler.schedule(want)
        if batch.type == _C.StepType.IDLE:
            if want == _C.StepType.IDLE and self.scheduler.has_unfinished():
                raise RuntimeError("scheduler has unfinished sequences but could schedule none")
            return [], 0
        if self._pool is not None and batch.type == _C.StepType.DECODE and not self._pending_siblings(batch.seq_ids):
            self._launch(batch)
            return self._step_in_flight(want)
        return self._run_step(batch, want)

    def _run_step(self, batch, want=_C.StepType.IDLE) -> tuple[list[RequestOutput], int]:
        """A step run here from start to end: the forward, sampling and output processing; with
        num_scheduler_steps > 1 and want IDLE (no DP vote) maybe more decode steps after it (_run_decode_steps)."""
        self._count_step(batch)
        if batch.type == _C.StepType.PREFILL:
            self._write_cached_prefixes(batch)
        # An unsampled row is a prefill chunk short of its prompt's end: nothing is drawn for it. Every row of a
        # decode step is sampled (no numpy passes for them: a batch-1 step's Python runs on cold caches).
        if batch.type == _C.StepType.DECODE:
            drawn, firsts = batch.seq_ids, range(batch.num_seqs)
        else:
            sampled = batch.sampled.astype(bool)
            drawn = [s for s, d in zip(batch.seq_ids, sampled) if d]
            firsts = (sampled.cumsum() - 1).tolist()
        states = [self.seqs[s] for s in drawn]
        siblings = self._pending_siblings(drawn)
        steps = self._loop_steps(batch, states) if want == _C.StepType.IDLE and not siblings else 1
        ran = self._run_decode_steps(batch, states, steps) if steps > 1 else None
        if ran is not None:
            return ran
        if batch.type == _C.StepType.DECODE and self.spec is not None and batch.draft_lens.sum() > 0:
            sampling = self._sampling_batch(states)
            logits = self.runner.logits_all(batch)
            tokens = self.spec.verify(batch, logits, states, sampling)
            self._count_drafts(states, batch.draft_lens.tolist(), tokens)
            out, firsts = self.spec.token_logprobs(batch, logits, tokens, sampling.num_logprobs)
            results = self.scheduler.process_multi(batch, tokens)
        else:
            scored = self._prompt_rows(batch) if batch.type == _C.StepType.PREFILL else None
            out = self._execute(batch, states + [state for _, _, state in siblings], scored and scored[0],
                                [row for row, _, _ in siblings])
            if scored:
                self._record_prompt_logprobs(*scored, out.prompt)
            if batch.type == _C.StepType.PREFILL and self.prefix_cache is not None:
                self.prefix_cache.save_prompts(self, batch)
            if siblings:
                results, firsts = self._add_siblings(batch, out.tokens.tolist(), siblings, firsts)
            else:
                results = self.scheduler.process(batch, out.tokens.tolist())
        if self.spec is not None:
            self.spec.after_step(self, batch, results)
        if self.eplb is not None:
            self.eplb.end_step()
        states = [self._take_tokens(res) for res in results]
        return self._outputs(firsts, results, states, out), batch.num_tokens

    def _count_step(self, batch) -> None:
        self._count_preemptions(batch.preempted)
        self.num_steps["prefill" if batch.type == _C.StepType.PREFILL else "decode"] += 1

    def _count_preemptions(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.requests[self.seqs[seq_id].request_id].metrics.num_preemptions += 1

    # ---- decode steps back to back in C++ (num_scheduler_steps > 1) --------------------------------------------

    def _loop_steps(self, batch, states: list[SeqState]) -> int:
        """How many decode steps from `batch` on may run in one C++ call: num_scheduler_steps when every row is a
        plain draw (greedy or sampled) and needs no Python per step (stop strings are matched on the text, beams
        forked), up to the step whose end replans the experts (that moves weights between steps); else 1. The rows
        are all the running sequences that decode, and no sequence joins them inside the call."""
        n = self.config.num_scheduler_steps
        if n == 1 or batch.type != _C.StepType.DECODE \
                or not all(s.plain_draw and not s.params.stop_strings and not s.beam for s in states):
            return 1
        replan = None if self.eplb is None else self.eplb.steps_to_replan()
        return n if replan is None else min(n, replan)

    def _run_decode_steps(self, batch, states: list[SeqState],
                          max_steps: int) -> tuple[list[RequestOutput], int] | None:
        """Runs `batch` (states: its rows') and up to max_steps - 1 more decode steps in one C++ call
        (ModelRunner.decode_steps), then each step's bookkeeping in order, also for the steps before one that
        raises. None where the model cannot run them so (nothing ran)."""
        counts = None if self.eplb is None else \
            torch.zeros(max_steps, self.eplb.recorder.step_flat().numel(), dtype=torch.int64)
        done = []
        try:
            evicted = self.runner.decode_steps(self.scheduler, batch, max_steps, self._plain_sampling(states), counts,
                                               done, _num_logprobs(states))
        finally:
            outputs = [out for k, (step, results, drawn) in enumerate(done)
                       for out in self._loop_step_done(k, step, results, drawn, counts)]
        if evicted is None:
            return None
        self._count_preemptions(evicted)
        return outputs, sum(step.num_tokens for step, _, _ in done)

    def _plain_sampling(self, states: list[SeqState]) -> tuple | None:
        """The one-call steps' sampling for plain-draw rows `states`: None when all are greedy, else their
        _draw_params."""
        return None if all(s.params.temperature == 0 for s in states) else self._draw_params(states)

    def _loop_step_done(self, k: int, batch, results, drawn: SamplerOutput,
                        counts: torch.Tensor | None) -> list[RequestOutput]:
        """Step k of a run of decode steps (its tokens already processed by the scheduler): what _run_step does
        after the scheduler's process(); drawn: its rows' logprobs; counts: the run's expert counts, row k this
        step's."""
        if k:
            self._count_step(batch)
        if self.eplb is not None:
            if counts is not None:
                self.eplb.recorder.step_flat().add_(counts[k])
            self.eplb.end_step()
        states = [self._take_tokens(res) for res in results]
        return self._outputs(range(len(results)), results, states, drawn)

    # ---- async scheduling: decode step N+1 is scheduled while step N's forward runs on the worker thread, and
    # launched as soon as N's tokens are appended; N's outputs are processed while N+1 runs. ---------------------

    def _launch(self, batch) -> None:
        """Starts a decode step's forward and sampling on the worker thread. Every row of a decode step is
        sampled, and its sequences' token_ids and grammars stay unchanged until the step is processed."""
        self._count_step(batch)
        states = [self.seqs[s] for s in batch.seq_ids]
        self._unprocessed.append(batch)
        self._flight = (batch, self._pool.submit(self._execute, batch, states))

    def _step_in_flight(self, want) -> tuple[list[RequestOutput], int]:
        """Finishes the step in flight; a DP group's forced step types run synchronously from the next step on."""
        batch, future = self._flight
        ahead = self.scheduler.schedule_ahead(batch) if want == _C.StepType.IDLE else None
        if ahead is not None and ahead.type != _C.StepType.DECODE:
            ahead = None
        if ahead is not None:
            self._unprocessed.append(ahead)
        out = future.result()
        self._flight = None
        self._unprocessed.remove(batch)
        results = self.scheduler.process(batch, out.tokens.tolist())
        if self.eplb is not None:  # before the next forward: a replan moves expert weights
            self.eplb.end_step()
        states = [self._take_tokens(res) for res in results]
        if ahead is not None:
            self.scheduler.complete_ahead(ahead)
            self._unprocessed.remove(ahead)
            if ahead.type == _C.StepType.DECODE:
                self.num_steps["ahead"] += 1
                self._launch(ahead)
        return self._outputs(range(len(results)), results, states, out), batch.num_tokens

    def _outputs(self, firsts, results, states, out) -> list[RequestOutput]:
        """The requests that finished with this step's results (states: _take_tokens of each)."""
        finished = {state.request_id for first, res, state in zip(firsts, results, states)
                    if state is not None and self._apply(first, res, out, state)}
        return [self._finish_request(r) for r in finished if self._request_done(r)]

    def _execute(self, batch, states: list[SeqState], prompt: tuple | None = None,
                 sibling_rows: list[int] = ()) -> SamplerOutput:
        """The forward and the draw of the sampled rows' states. A decode step whose rows are all plain draws tries
        the runner's one-call step first, which builds no tensors and runs no Python sampler (~0.3 ms of a batch-1
        step's Python greedy, ~1 ms sampled, on caches the weight stream has just emptied); a prefill's torch ops
        run on all threads (platform.set_threads). prompt: a prefill's rows that score prompt tokens
        (ModelRunner.execute); sibling_rows: for each state after the sampled rows', the row it draws from too."""
        if batch.type == _C.StepType.DECODE and not sibling_rows and all(s.plain_draw for s in states):
            out = self.runner.draw(batch, self._plain_sampling(states), _num_logprobs(states))
            if out is not None:
                return out
        sampling = self._sampling_batch(states)
        if batch.type != _C.StepType.PREFILL:
            return self.runner.execute(batch, sampling, None, sibling_rows)
        with platform.torch_parallel():
            return self.runner.execute(batch, sampling, prompt, sibling_rows)

    # ---- parallel sampling: a request's children after the first start from its computed prompt -----------------

    def _pending_siblings(self, drawn) -> list[tuple[int, int, SeqState]]:
        """(row in the step's draws, parent seq id, sibling) for every waiting sibling of the sequences drawn (in
        draw order): a parent's prompt ends in this step, a prefill's or, its last token left, a decode's."""
        if not self._parents or self._parents.isdisjoint(drawn):
            return []
        return [(row, seq_id, state) for row, seq_id in enumerate(drawn) if seq_id in self._parents
                for state in self.requests[self.seqs[seq_id].request_id].siblings]

    def _add_siblings(self, batch, tokens: list[int], siblings: list, firsts: list[int]) -> tuple[list, list[int]]:
        """Before process(batch): each sibling becomes a sequence with its drawn token (tokens: the parents' draws,
        then the siblings'), its KV copied from its parent's. Returns the step's results, the siblings' after the
        batch's, and each result's first row in the draws."""
        drawn = len(tokens) - len(siblings)
        added = [self._add_sibling(parent, state, token) for (_, parent, state), token in zip(siblings, tokens[drawn:])]
        for _, parent, _ in siblings:
            self.requests[self.seqs[parent].request_id].siblings = []
            self._parents.discard(parent)
        return self.scheduler.process(batch, tokens[:drawn]) + added, list(firsts) + list(range(drawn, len(tokens)))

    def _add_sibling(self, parent: int, state: SeqState, token: int):
        seq_id = next(self._seq_counter)
        res, copy = self.scheduler.add_sibling(parent, seq_id, token)
        self._copy_kv(*copy)
        self.seqs[seq_id] = state
        self.requests[state.request_id].seq_ids.append(seq_id)
        return res

    # ---- prompt logprobs ----------------------------------------------------------------------------------------

    def _prompt_rows(self, batch) -> tuple | None:
        """The rows of a prefill whose logits score a prompt token still unscored for its request ->
        ((rows [P], targets [P] int64, top n), [(request, its top n) per row]), or None where no row does. Only a
        request's first child scores; a recomputed prefix (after preemption) is not scored again."""
        qsl, positions = batch.query_start_loc, batch.positions
        rows, targets, owners = [], [], []
        for i, seq_id in enumerate(batch.seq_ids):
            state = self.seqs[seq_id]
            req = self.requests[state.request_id]
            if req.prompt_logprobs is None or req.seq_ids[0] != seq_id:
                continue
            done, prompt = len(req.prompt_logprobs), req.prompt_token_ids
            for row in range(int(qsl[i]), int(qsl[i + 1])):
                if done <= int(positions[row]) + 1 < len(prompt):
                    rows.append(row)
                    targets.append(prompt[int(positions[row]) + 1])
                    owners.append((req, state.params.prompt_logprobs))
        if not rows:
            return None
        n = max(n for _, n in owners)
        return (torch.tensor(rows), torch.tensor(targets, dtype=torch.int64), n), owners

    @staticmethod
    def _record_prompt_logprobs(scored: tuple, owners: list[tuple[Request, int]], out: tuple) -> None:
        """Appends each scored row's entry (its target's logprob and rank, then its request's top n) to its
        request's prompt_logprobs, in prompt order."""
        logprob, rank, top_ids, top_logprobs = (t.tolist() for t in out)
        for row, ((req, n), token) in enumerate(zip(owners, scored[1].tolist())):
            req.prompt_logprobs.append(_logprob_entry(token, logprob[row], rank[row], top_ids[row][:n],
                                                      top_logprobs[row][:n]))

    def _count_drafts(self, states, draft_lens, tokens) -> None:
        for state, verified, toks in zip(states, draft_lens, tokens):
            metrics = self.requests[state.request_id].metrics
            metrics.spec_verified_drafts += verified
            metrics.spec_accepted_drafts += max(0, len(toks) - 1)

    @staticmethod
    def _draw_params(states: list[SeqState]) -> tuple[list, ...]:
        """The sample op's per-row arguments as lists: temperature, top_k, top_p, min_p, seeds and offsets (the
        tokens each sequence has generated so far)."""
        p = [s.params for s in states]
        return ([x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p], [x.min_p for x in p],
                [s.seed for s in states], [len(s.token_ids) for s in states])

    def _sampling_batch(self, states: list[SeqState]) -> SamplingBatch:
        temperature, top_k, top_p, min_p, seeds, offsets = self._draw_params(states)
        return SamplingBatch(
            temperature=torch.tensor(temperature, dtype=torch.float32),
            top_k=torch.tensor(top_k, dtype=torch.int64),
            top_p=torch.tensor(top_p, dtype=torch.float32),
            min_p=torch.tensor(min_p, dtype=torch.float32),
            seeds=seeds,
            offsets=torch.tensor(offsets, dtype=torch.int64),
            num_logprobs=_num_logprobs(states),
            logits_rows=self._logits_rows(states),
            grammars=None if all(s.grammar is None for s in states) else [s.grammar for s in states],
        )

    @staticmethod
    def _logits_rows(states: list[SeqState]) -> list | None:
        if all(s.logits_ctx is None for s in states):
            return None
        return [None if s.logits_ctx is None else (s.logits_ctx, s.token_ids) for s in states]

    def _take_tokens(self, res) -> SeqState | None:
        """Appends one sequence's step tokens, advances its grammar and looks for stop strings: what decides
        the next step's rows and what its sampling reads. None for a void row (the sequence was aborted while
        its step ran)."""
        state = self.seqs.get(res.seq_id)
        if state is None or state.finish_reason is not None:
            return None
        if res.tokens:
            state.token_ids.extend(res.tokens)
            metrics = self.requests[state.request_id].metrics
            metrics.num_generation_tokens += len(res.tokens)
            if metrics.first_token_time is None:
                metrics.first_token_time = time.monotonic()
        if res.reason == _C.FinishReason.HANDOFF:
            return state
        if res.finished:
            state.finish_reason = _REASONS[res.reason]
            state.stop_reason = res.stop_token if res.stop_token >= 0 else None
            if res.reason == _C.FinishReason.ERROR:
                state.error = "non-finite logits, or the request's logits processors masked every token"
        if state.grammar is not None and res.tokens:
            self._advance_grammar(res.seq_id, state, res.tokens, res.finished)
        ended = state.finish_reason is not None
        if state.params.stop_strings and self._hit_stop_string(state, res.finished) and not ended:
            self.scheduler.finish(res.seq_id, _C.FinishReason.STOP)
        return state

    def _apply(self, first: int, res, out, state: SeqState) -> bool:
        """The rest of a sequence's step result (its tokens' logprobs are rows first.. of out): logprobs and a
        handoff. Returns whether the sequence finished."""
        if res.tokens:
            self._record_logprobs(state, first, res.tokens, out)
        if res.reason == _C.FinishReason.HANDOFF:
            self._hand_off(res.seq_id, state)
            return True
        return state.finish_reason is not None

    def _advance_grammar(self, seq_id: int, state: SeqState, tokens: list[int], finished: bool) -> None:
        """Accepts the step's tokens; a completed grammar ends the sequence with "stop" (its stop token was
        drawn, also under ignore_eos)."""
        if not state.grammar.accept(tokens):  # only a masked-out draw could do this
            state.finish_reason, state.error = "error", f"token outside the grammar in {tokens}"
        elif state.grammar.terminated and state.finish_reason is None:
            state.finish_reason = "stop"
        else:
            return
        if not finished:
            self.scheduler.finish(seq_id, _C.FinishReason.STOP)

    def _record_logprobs(self, state: SeqState, first: int, tokens: list[int], out) -> None:
        if out.token_logprob is None:
            return
        n = state.params.logprobs
        for row, token in enumerate(tokens, start=first):
            logprob = float(out.token_logprob[row])
            state.cumulative_logprob += logprob
            if n is None:
                continue
            state.logprobs.append(_logprob_entry(token, logprob, int(out.token_rank[row]),
                                                 out.topk_ids[row, :n].tolist(), out.topk_logprobs[row, :n].tolist()))

    def _hit_stop_string(self, state: SeqState, finished: bool) -> bool:
        """Detokenises the step's new tokens (all that is left when finished) and cuts the text at the
        first stop string; True if one was found."""
        detok = state.detokenizer
        new_text = detok.update(state.token_ids, final=finished)
        hit = find_stop_string(detok.text, len(new_text), state.params.stop_strings)
        if hit is None:
            return False
        pos, stop = hit
        state.text = detok.text[:pos + len(stop)] if state.params.include_stop_str_in_output else detok.text[:pos]
        state.finish_reason, state.stop_reason = "stop", stop
        return True

    def _request_done(self, request_id: str) -> bool:
        return all(self.seqs[s].finish_reason is not None for s in self.requests[request_id].seq_ids)

    def _finish_request(self, request_id: str) -> RequestOutput:
        req = self.requests.pop(request_id)
        req.metrics.finished_time = time.monotonic()
        outputs = [self._completion(self.seqs.pop(s)) for s in req.seq_ids]
        self._decode_logprobs(req.prompt_logprobs or [])
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids, outputs, True, req.metrics,
                             req.prompt_logprobs)

    def _completion(self, state: SeqState) -> CompletionOutput:
        if not isinstance(state.stop_reason, str):  # a stop string already cut the text
            state.text = self._final_text(state)
        self._decode_logprobs(state.logprobs)
        return CompletionOutput(state.index, state.text, state.token_ids,
                                state.cumulative_logprob if state.params.logprobs is not None else None,
                                state.logprobs if state.params.logprobs is not None else None,
                                state.finish_reason, state.stop_reason, state.error)

    def _decode_logprobs(self, entries: list[dict | None]) -> None:
        """Sets each Logprob's decoded_token (entries: a list of {token id: Logprob}, None where nothing scored)."""
        for entry in entries:
            for tok, lp in (entry or {}).items():
                lp.decoded_token = self._decode([tok], False)

    @staticmethod
    def _final_text(state: SeqState) -> str:
        """The whole output's text, with any incomplete character the detokeniser still held back.
        Without stop strings nothing reads the text sooner, so this decodes the output in one window."""
        if state.detokenizer is None:
            return ""
        state.detokenizer.update(state.token_ids, final=True)
        return state.detokenizer.text

    def _decode(self, token_ids: list[int], skip_special: bool) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=skip_special)

    def abort_all(self) -> None:
        """Ends every unfinished sequence (after an exception) so the engine stays usable."""
        if self._flight is not None:
            wait([self._flight[1]])
            self._flight = None
        for batch in self._unprocessed:
            self.scheduler.discard(batch)
        self._unprocessed.clear()
        for seq_id in list(self.seqs):
            try:
                self.scheduler.finish(seq_id, _C.FinishReason.ABORT)
            except ValueError:
                pass  # already gone from the scheduler (finished in C++ this step)
        self.seqs.clear()
        self.requests.clear()
        self._parents.clear()

    def abort_request(self, request_id: str) -> bool:
        """Ends a request's sequences (vLLM's abort_request); False if it is not running here."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self._parents.difference_update(req.seq_ids)
        for seq_id in req.seq_ids:
            if self.seqs.pop(seq_id, None) is not None:
                try:
                    self.scheduler.finish(seq_id, _C.FinishReason.ABORT)
                except ValueError:
                    pass  # already gone from the scheduler
        return True

    # ---- beam search (engine/beam_search.py): between steps, on sequences whose newest token is drawn --------------

    def fork_sequence(self, seq_id: int, token: int) -> int:
        """A new sequence of seq_id's request: seq_id with `token` in place of its newest token, sharing its full KV
        blocks (the partial one and the StateBlock copied). Returns the new sequence's id."""
        child = next(self._seq_counter)
        self._copy_kv(*self.scheduler.fork(seq_id, child, token))
        parent = self.seqs[seq_id]
        req = self.requests[parent.request_id]
        self.seqs[child] = replace(parent, index=max(self.seqs[s].index for s in req.seq_ids) + 1,
                                   token_ids=list(parent.token_ids), logprobs=list(parent.logprobs),
                                   detokenizer=self._detokenizer(parent.params))
        req.seq_ids.append(child)
        self._retarget(self.seqs[child], token)
        return child

    def _copy_kv(self, src_block: int, dst_block: int, src_slot: int, dst_slot: int) -> None:
        """A forked sequence's own KV: its parent's partial block and StateBlock copied (-1: none)."""
        if dst_slot >= 0:
            self.cache.load([dst_block] if dst_block >= 0 else [], dst_slot,
                            self.cache.export([src_block] if src_block >= 0 else [], src_slot))

    def set_last_token(self, seq_id: int, token: int) -> None:
        """Replaces seq_id's newest token (drawn, not yet computed) by `token`."""
        self.scheduler.set_last_token(seq_id, token)
        self._retarget(self.seqs[seq_id], token)

    @staticmethod
    def _retarget(state: SeqState, token: int) -> None:
        """The newest token of state's outputs becomes `token`: its logprob, scored at the same step, replaces the
        drawn one's in the sum."""
        drawn, state.token_ids[-1] = state.token_ids[-1], token
        if state.logprobs:
            state.cumulative_logprob += state.logprobs[-1][token].logprob - state.logprobs[-1][drawn].logprob

    def drop_sequence(self, seq_id: int) -> None:
        """Ends one sequence of a request for good (if the scheduler has not ended it already): its blocks return,
        and the request no longer waits for it."""
        state = self.seqs.pop(seq_id)
        self.requests[state.request_id].seq_ids.remove(seq_id)
        if state.finish_reason is None:
            self.scheduler.finish(seq_id, _C.FinishReason.ABORT)

    # ---- prefix store ---------------------------------------------------------------------------------

    def _write_cached_prefixes(self, batch) -> None:
        """Writes prefix-store hits into the blocks the scheduler just gave their sequences (their prefill
        starts after the prefix), with the StateBlock at the prefix's end (PrefixCache.write)."""
        for seq_id in batch.seq_ids:
            state = self.seqs[seq_id]
            if state.cached_prefix is None:
                continue
            (blocks, last_hash), state.cached_prefix = state.cached_prefix, None
            self.prefix_cache.write(self, self.scheduler.sequence(seq_id), blocks, last_hash)

    # ---- disaggregation: PROMPT engines export prefilled sequences, COMPLETION engines import them ------

    def _hand_off(self, seq_id: int, state: SeqState) -> None:
        seq = self.scheduler.sequence(seq_id)
        handoff = self.state_transfer.export(self.cache, seq, state)
        self.scheduler.release(seq_id)
        self.handoffs.append(handoff)
        state.finish_reason = "handoff"

    def import_handoff(self, h: Handoff) -> bool:
        """COMPLETION: admits a prefilled sequence with its KV (and rebuilds its StateBlock by replay when
        the handoff carries none). Keyed by h.request_id. False if the pools are full now."""
        p = h.params
        seq_id = next(self._seq_counter)
        if not self.scheduler.import_sequence(seq_id, h.token_ids, len(h.prompt_token_ids), self._limits(p)):
            return False
        seq = self.scheduler.sequence(seq_id)
        self.state_transfer.load(self.cache, seq, h)
        outputs = h.token_ids[len(h.prompt_token_ids):]
        state = SeqState(h.request_id, h.index, p, h.seed, token_ids=outputs, detokenizer=self._detokenizer(p),
                         logits_ctx=self._logits_context(p, h.prompt_token_ids), grammar=self._grammar(p, outputs),
                         logprobs=list(h.logprobs), cumulative_logprob=h.cumulative_logprob)
        self.seqs[seq_id] = state
        metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(h.prompt_token_ids))
        self.requests[h.request_id] = Request(h.request_id, None, h.prompt_token_ids, [seq_id], metrics)
        return True


def _num_logprobs(states: list[SeqState]) -> int:
    """The most top logprobs any of these sequences wants per token; -1 where none wants logprobs."""
    return max((s.params.logprobs for s in states if s.params.logprobs is not None), default=-1)


def _logprob_entry(token: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]) -> dict:
    """{token id: Logprob} of one position as vLLM reports it: the scored token's, then the top ones in rank order
    (a top token that is the scored one keeps its own entry)."""
    entry = {token: Logprob(logprob, rank)}
    for r, (tok, value) in enumerate(zip(top_ids, top_logprobs)):
        entry.setdefault(tok, Logprob(value, r + 1))
    return entry
