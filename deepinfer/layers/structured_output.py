"""Structured outputs with xgrammar: each constraint is compiled once per engine (cached by its text), each
sequence walks its own GrammarMatcher, and before a token is drawn the matcher's allowed tokens become a
bitmask that tilelang_ops' "apply_token_mask" op applies to the logits (xgrammar's layout: bit j of word i
allows token 32 i + j).

Speculative decoding: drafts are cut at the first token the grammar refuses before they are verified; a
verify row j is masked by the matcher's state after drafts[:j], and the matcher is rolled back before the
emitted tokens are accepted, so the output equals plain decoding's."""
import json

import torch

from deepinfer.sampling_params import StructuredOutputsParams
from tilelang_ops.dispatch import get_op


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary; raises ValueError on a constraint
    xgrammar cannot compile."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.xgr, self.vocab_size = xgr, vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.compiled: dict[str, object] = {}

    def compile(self, spec: StructuredOutputsParams):
        key = spec.key()
        if key not in self.compiled:
            try:
                self.compiled[key] = self._compile(spec)
            except (RuntimeError, ValueError, TypeError) as e:
                raise ValueError(f"SamplingParams.structured_outputs.{spec.kind} does not compile: {e}") from e
        return self.compiled[key]

    def _compile(self, spec: StructuredOutputsParams):
        c, ws = self.compiler, not spec.disable_any_whitespace
        if spec.json is not None:
            return c.compile_json_schema(spec.json if isinstance(spec.json, str) else json.dumps(spec.json),
                                         any_whitespace=ws)
        if spec.json_object:
            return c.compile_builtin_json_grammar()
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:  # EBNF string literals take JSON's escapes
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(choice) for choice in spec.choice))
        return c.compile_grammar(spec.grammar)

    def matcher(self, spec: StructuredOutputsParams) -> "SequenceGrammar":
        return SequenceGrammar(self.xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)


class SequenceGrammar:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.words = matcher, (vocab_size + 31) // 32

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask [R, ceil(V/32)] int32: row `row` becomes the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, tokens: list[int]) -> bool:
        """Advances over tokens; False (and stops there) at the first the grammar refuses."""
        return all(self.matcher.accept_token(t) for t in tokens)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts, short of one that completes it: the stop token ends the
        sequence, so it is the target's draw, never a draft (the matcher is left where it was)."""
        n, completes = 0, False
        while n < len(drafts) and not completes and self.matcher.accept_token(drafts[n]):
            n += 1
            completes = self.matcher.is_terminated()
        self.matcher.rollback(n)
        return n - completes

    def masks_along(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, ceil(V/32)] int32: the allowed tokens at the sequence's next position and after
        each draft (drafts already cut to valid_prefix; the matcher is left where it was)."""
        masks = torch.empty(len(drafts) + 1, self.words, dtype=torch.int32)
        for j in range(len(drafts) + 1):
            self.fill(masks, j)
            if j < len(drafts):
                self.matcher.accept_token(drafts[j])
        self.matcher.rollback(len(drafts))
        return masks


def batch_bitmask(grammars: list, vocab_size: int) -> torch.Tensor:
    """grammars: per row a SequenceGrammar or None (everything allowed) -> [R, ceil(V/32)] int32."""
    masks = torch.full((len(grammars), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill(masks, row)
    return masks


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32 (changed in place and returned), bitmask [R, ceil(V/32)] int32."""
    return get_op("apply_token_mask")(logits, bitmask)
