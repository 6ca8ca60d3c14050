"""vLLM's logits processors, in vLLM's order: allowed_token_ids, bad_words, min_tokens, logit_bias, then the
repetition, frequency and presence penalties. They change the logits a token is drawn from (greedy rows
included); logprobs stay those of the raw logits, as vLLM reports them by default.

Every processor reads only the sequence's prompt and the output tokens before the row's position, so a
speculative verify row j sees the outputs plus drafts[:j]: what plain decoding would have seen there."""
from dataclasses import dataclass, field

import torch

from deepinfer.sampling_params import SamplingParams


@dataclass
class LogitsContext:
    """One sequence's fixed inputs to its processors. bad_words_ids: SamplingParams.bad_words as token-id
    lists; stop_ids: the tokens that would end the sequence, masked until min_tokens outputs exist. The
    tensors made from them are built once here, not at every step."""

    params: SamplingParams
    prompt_ids: list[int]
    bad_words_ids: list[list[int]]
    stop_ids: list[int]
    _masks: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        bias = self.params.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.int64)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
        self.stop_tensor = torch.tensor(self.stop_ids, dtype=torch.int64)

    def mask(self, name: str, vocab: int) -> torch.Tensor:
        """[V] bool: the tokens of "prompt" (the repetition penalty's reach besides the outputs) or of
        "allowed" (allowed_token_ids)."""
        if name not in self._masks:
            ids = self.prompt_ids if name == "prompt" else self.params.allowed_token_ids
            self._masks[name] = torch.zeros(vocab, dtype=torch.bool)
            self._masks[name][torch.tensor(ids, dtype=torch.int64)] = True
        return self._masks[name]


def needs_processing(params: SamplingParams) -> bool:
    """Whether any processor changes this request's logits (most requests: no, and they pay nothing)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.allowed_token_ids is not None or params.bad_words
                or params.min_tokens)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word as tokens at the start of a text and, where that tokenises differently into as many
    tokens, after a space (vLLM's rule: a word is banned both where it opens the text and mid-text)."""
    out = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def apply_processors(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """logits [R, V] fp32; rows: per logits row (LogitsContext, output token ids before it) or None (left
    as is). Returns new logits [R, V]; the input is not changed (logprobs read it)."""
    out = logits.clone()
    for r, row in enumerate(rows):
        if row is not None:
            _process_row(out[r], *row)
    return out


def _process_row(logits: torch.Tensor, ctx: LogitsContext, outputs: list[int]) -> None:
    """logits [V] fp32, changed in place."""
    p = ctx.params
    if p.allowed_token_ids is not None:
        logits.masked_fill_(~ctx.mask("allowed", logits.shape[0]), float("-inf"))
    for word in ctx.bad_words_ids:
        prefix = len(word) - 1
        if prefix <= len(outputs) and outputs[len(outputs) - prefix:] == word[:prefix]:
            logits[word[-1]] = float("-inf")
    if len(outputs) < p.min_tokens and ctx.stop_ids:
        logits[ctx.stop_tensor] = float("-inf")
    if p.logit_bias:
        logits[ctx.bias_ids] += ctx.bias_values
    _apply_penalties(logits, ctx, outputs)


def _apply_penalties(logits: torch.Tensor, ctx: LogitsContext, outputs: list[int]) -> None:
    """vLLM's formulas: the repetition penalty divides positive and multiplies negative logits of tokens in
    the prompt or the outputs; frequency subtracts its value times the token's output count, presence its
    value once for every token in the outputs."""
    p, vocab = ctx.params, logits.shape[0]
    if not (p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
        return
    counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=vocab)[:vocab].float()
    if p.repetition_penalty != 1.0:
        seen = ctx.mask("prompt", vocab) | (counts > 0)
        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if p.frequency_penalty:
        logits.sub_(p.frequency_penalty * counts)
    if p.presence_penalty:
        logits.sub_(p.presence_penalty * (counts > 0).float())
