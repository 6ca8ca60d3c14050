"""LLM.beam_search: vLLM's beam search, with the beams as forked sequences of one engine.

Each step every live beam of a prompt draws one token with the 2 * beam_width top logprobs of its position; each
(beam, candidate token) is a continuation, scored by cumulative logprob / length ** length_penalty (the length
counts the prompt, as vLLM's get_beam_search_score does). A continuation ending in EOS is complete; the best
beam_width others are the next step's beams. At the end the completed ones and the live beams compete on the same
score for the beam_width places.

vLLM runs every step as a new one-token generate of each beam's whole text and leans on its prefix cache. Here a
kept continuation takes over its parent's sequence (its newest token, drawn but not yet computed, replaced) or is
forked from it: the full KV blocks shared, the partial block and the StateBlock copied (Scheduler::fork). A step of
search is one decode step of all beams, whatever their length.

Prompts run in waves that fit the engine at their longest (beam_width sequences each, of prompt + max_tokens
tokens, without counting shared blocks), so no beam is ever evicted and the beams of a prompt advance together."""
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.outputs import BeamSearchOutput, BeamSearchSequence
from deepinfer.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class _Search:
    """One prompt's search: beams[i] lives as engine sequence seq_ids[i], its request's output indices[i]."""

    request_id: str
    steps: int  # tokens to search: max_tokens, or what max_model_len leaves
    beams: list[BeamSearchSequence]
    seq_ids: list[int]
    indices: list[int]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    done: int = 0  # steps taken


def beam_sampling(params: BeamSearchParams) -> SamplingParams:
    """What each beam draws per step: one token (greedy or at the temperature) with the 2 * beam_width top logprobs
    of its position, EOS not ending it (the search decides)."""
    return SamplingParams(temperature=params.temperature, logprobs=2 * params.beam_width, ignore_eos=True)


class BeamSearch:
    def __init__(self, engine, params: BeamSearchParams):
        if not isinstance(engine, LLMEngine):
            raise ValueError(f"beam search runs on a single engine, not on {type(engine).__name__}")
        if engine.config.async_scheduling or engine.spec is not None or engine.config.engine_type != "normal":
            raise ValueError("LLM.beam_search runs on a normal engine (engine_type='normal') without "
                             "async_scheduling and speculative decoding")
        self.engine, self.params = engine, params
        self.eos = set() if params.ignore_eos else set(engine.eos_token_ids())
        self.sampling = beam_sampling(params)

    def run(self, prompts: list[list[int]], concurrency_limit: int | None = None,
            use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """prompts: token ids, each validated -> one BeamSearchOutput per prompt, in order. concurrency_limit: at
        most this many prompts searched at once (besides what the engine holds); use_tqdm: a bar of prompts done."""
        if self.engine.has_unfinished():
            raise RuntimeError("LLM.beam_search needs an idle engine")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"beam_search concurrency_limit must be None or an integer >= 1, "
                             f"got {concurrency_limit!r}")
        outputs = []
        with tqdm(total=len(prompts), desc="Beam search", dynamic_ncols=True, disable=not use_tqdm) as bar:
            for wave in self._waves(prompts, concurrency_limit or len(prompts)):
                outputs += self._run_wave(wave, bar)
        return outputs

    def _steps(self, prompt: list[int]) -> int:
        return min(self.params.max_tokens, self.engine.config.max_model_len - len(prompt))

    def blocks_needed(self, index, prompt: list[int]) -> int:
        """KV blocks the prompt's beams hold at most (none shared); raises ValueError naming request `index` if the
        engine cannot hold them, or the beams, at once."""
        width, config = self.params.beam_width, self.engine.config
        blocks = self.engine.scheduler.block_manager
        tokens = len(prompt) + self._steps(prompt)
        need = width * blocks.blocks_for(tokens)
        if width > config.max_num_seqs or need > blocks.num_blocks:
            raise ValueError(f"request {index}: {width} beams of {tokens} tokens need {need} KV blocks and {width} "
                             f"sequences; the engine has {blocks.num_blocks} blocks and "
                             f"max_num_seqs={config.max_num_seqs}")
        return need

    def _waves(self, prompts: list[list[int]], limit: int) -> list[list[tuple[int, list[int]]]]:
        """(index, prompt) groups, in order, of at most `limit` prompts whose beams fit the engine's sequences and KV
        blocks at full length."""
        width, config = self.params.beam_width, self.engine.config
        num_blocks = self.engine.scheduler.block_manager.num_blocks
        waves, used = [[]], 0
        for i, prompt in enumerate(prompts):
            need = self.blocks_needed(i, prompt)
            full = len(waves[-1]) == limit or width * (len(waves[-1]) + 1) > config.max_num_seqs
            if waves[-1] and (full or used + need > num_blocks):
                waves.append([])
                used = 0
            waves[-1].append((i, prompt))
            used += need
        return waves

    def _run_wave(self, wave: list[tuple[int, list[int]]], bar: tqdm) -> list[BeamSearchOutput]:
        searches = [self._start(i, prompt) for i, prompt in wave]
        live = list(searches)
        while live:
            finished, _ = self.engine.step()
            ended = {out.request_id: out for out in finished}
            for search in list(live):
                newest = self._newest(search, ended.get(search.request_id))
                if newest is None:
                    continue  # its beams did not run in this step (another prompt's prefill chunk)
                self._advance(search, newest)
                if search.done == search.steps or not search.beams:
                    self.engine.abort_request(search.request_id)
                    live.remove(search)
                    bar.update(1)
        return [self._output(search) for search in searches]

    def _start(self, index: int, prompt: list[int]) -> _Search:
        request_id = f"beam-{index}"
        steps = self._steps(prompt)
        # the engine ends the beams itself at their last step (max_tokens or max_model_len): their request's output
        # then carries that step's candidates
        self.engine.add_request(request_id, prompt, replace(self.sampling, max_tokens=steps), beam=True)
        seq_ids = list(self.engine.requests[request_id].seq_ids)
        return _Search(request_id, steps, [BeamSearchSequence(list(prompt), [])], seq_ids, [0])

    def _newest(self, search: _Search, ended) -> list[dict | None] | None:
        """Per beam the candidates {token id: Logprob} of its newest token if the beams drew one this step (None
        for a beam whose row failed: it has none), else None; ended: the request's RequestOutput if it ended in the
        step."""
        if ended is not None:
            states = {out.index: out for out in ended.outputs}
            states = [states[i] for i in search.indices]
        else:
            states = [self.engine.seqs[s] for s in search.seq_ids]
        alive = [s for s in states if s.finish_reason != "error"]
        drawn = [len(s.token_ids) == search.done + 1 for s in alive]
        if alive and not any(drawn):
            return None
        if not all(drawn):
            raise RuntimeError(f"beam search {search.request_id}: its beams fell out of step")
        return [s.logprobs[-1] if s.finish_reason != "error" else None for s in states]

    def _advance(self, search: _Search, newest: list[dict | None]) -> None:
        """One step of search: the beams' continuations scored, the best kept and carried by engine sequences."""
        candidates = []  # (beam index, continuation)
        for i, (beam, entry) in enumerate(zip(search.beams, newest)):
            for token, logprob in (entry or {}).items():
                cont = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry],
                                          beam.cum_logprob + logprob.logprob)
                if token in self.eos:
                    cont.finish_reason = "stop"
                    search.completed.append(cont)
                else:
                    candidates.append((i, cont))
        candidates.sort(key=lambda c: self._score(c[1]), reverse=True)
        kept = candidates[:self.params.beam_width]
        search.done += 1
        if search.done < search.steps and kept:
            search.seq_ids = self._carry(search.seq_ids, [(i, cont.tokens[-1]) for i, cont in kept])
            search.indices = [self.engine.seqs[s].index for s in search.seq_ids]
        search.beams = [cont for _, cont in kept]

    def _carry(self, seq_ids: list[int], kept: list[tuple[int, int]]) -> list[int]:
        """kept: (parent beam, token) per new beam -> its engine sequence: the parent's first kept continuation
        takes the parent's sequence, the others fork it; parents with none end first, so their blocks return."""
        parents = {i for i, _ in kept}
        for i, seq_id in enumerate(seq_ids):
            if i not in parents:
                self.engine.drop_sequence(seq_id)
        carried, taken = [], set()
        for i, token in kept:
            if i in taken:
                carried.append(self.engine.fork_sequence(seq_ids[i], token))
            else:
                taken.add(i)
                self.engine.set_last_token(seq_ids[i], token)
                carried.append(seq_ids[i])
        return carried

    def _score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (beam.tokens[-1] in self.eos)
        return beam.cum_logprob / length ** self.params.length_penalty

    def _output(self, search: _Search) -> BeamSearchOutput:
        for beam in search.beams:
            beam.finish_reason = "length"
        best = sorted(search.completed + search.beams, key=self._score, reverse=True)[:self.params.beam_width]
        tokenizer = self.engine.tokenizer
        for beam in best:
            beam.text = None if tokenizer is None else \
                tokenizer.decode(beam.tokens, skip_special_tokens=self.params.skip_special_tokens)
        return BeamSearchOutput(best)
