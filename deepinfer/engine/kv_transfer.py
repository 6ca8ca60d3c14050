"""What moves when a prefilled sequence changes engine (PROMPT -> COMPLETION) or a stored prefix enters a
pool: the paged blocks exactly as stored (FP4/FP8 bytes and scales, never dequantised), and the StateBlock
(DeepSeek-V4: SWA rings and compression accumulators) either sent or rebuilt by replaying the last tokens.

Bytes per handoff = blocks_for(context) x bytes_per_block + (bytes_per_state_block, or nothing when the receiver
replays). Replay moves the replayed token ids instead (4 B each, and they travel anyway with the sequence), so it
moves fewer bytes whenever the StateBlock outweighs them; it costs the receiver a prefill of those tokens, which is
why "auto" replays only when the span is shorter than the context. Replay here is exact (it covers every layer's
window, see replay_exact_tokens), so both ways give the same tokens."""
from dataclasses import dataclass, field

import torch

from deepinfer import platform
from deepinfer.formats.cache_spec import CacheSpec
from deepinfer.sampling_params import SamplingParams

@dataclass
class Handoff:
    """A PROMPT engine's finished prefill: what a COMPLETION engine needs to continue it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + the first sampled token
    params: SamplingParams
    seed: int  # the sequence's sampling seed (SeqState.seed)
    kv: dict[str, torch.Tensor]  # "paged.<name>" [n_blocks, ...]; "state.<name>" unless replayed
    index: int = 0  # which of the request's params.n children this is
    replay_tokens: int = 0  # > 0: no StateBlock travels; the receiver replays this many tokens
    logprobs: list = field(default_factory=list)  # the first token's entry, when the request asked for them
    cumulative_logprob: float = 0.0

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv.values())


class StateTransfer:
    """Exports and imports one sequence's KV for a model and cache spec. mode: "state" always sends the
    StateBlock, "replay" always rebuilds it, "auto" picks whichever moves fewer bytes per request (one of
    config.STATE_TRANSFER_MODES, checked by EngineConfig.validate)."""

    def __init__(self, model, spec: CacheSpec, block_size: int, mode: str = "auto"):
        self.model, self.spec, self.block_size, self.mode = model, spec, block_size, mode
        self.can_replay = spec.bytes_per_state_block > 0 and hasattr(model, "replay_exact_tokens")

    def replay_tokens(self, context_len: int) -> int:
        """Tokens the receiver replays for a sequence with `context_len` tokens of KV (0: send the state).
        auto replays when that moves fewer bytes and is a bounded replay: a context shorter than the exact
        replay span (layers x window) would be recomputed whole on the decode engine, redoing the prefill
        there, so its state is sent."""
        if not self.can_replay or self.mode == "state":
            return 0
        r = self.model.replay_exact_tokens(context_len)
        if self.mode == "replay" or (4 * r < self.spec.bytes_per_state_block and r < context_len):
            return r
        return 0

    def expected_bytes(self, context_len: int, replay: bool) -> int:
        """The memory plan's bytes for one handoff: whole blocks of the context, plus the StateBlock."""
        blocks = -(-context_len // self.block_size)
        return blocks * self.spec.bytes_per_block + (0 if replay else self.spec.bytes_per_state_block)

    def export(self, cache, seq, state) -> Handoff:
        """A handed-off sequence (its KV covers num_computed_tokens = the prompt) -> Handoff."""
        context = seq.num_computed_tokens
        replay = self.replay_tokens(context)
        blocks = list(seq.block_table[:-(-context // self.block_size)])
        kv = cache.export(blocks, None if replay else seq.state_slot)
        token_ids = list(seq.token_ids)
        return Handoff(state.request_id, token_ids[:seq.num_prompt_tokens], token_ids, state.params, state.seed,
                       kv, state.index, replay, state.logprobs, state.cumulative_logprob)

    def load(self, cache, seq, h: Handoff) -> None:
        """Writes a handoff into an imported sequence's blocks and slot, replaying the state if it did not come."""
        cache.load(list(seq.block_table), None if h.replay_tokens else seq.state_slot, h.kv)
        if h.replay_tokens:
            self._replay(seq, seq.num_computed_tokens, h.replay_tokens)

    def rebuild(self, seq, context_len: int) -> None:
        """The StateBlock of a sequence whose first context_len tokens' blocks were just written (a prefix hit
        on a model that has one)."""
        self._replay(seq, context_len, self.model.replay_exact_tokens(context_len))

    def _replay(self, seq, context_len: int, num_tokens: int) -> None:
        with platform.torch_parallel():
            self.model.replay_swa_state(torch.tensor(seq.token_ids[:context_len]), context_len,
                                        torch.tensor(seq.block_table), seq.state_slot, num_tokens)
