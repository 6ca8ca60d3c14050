"""Sampling parameters with vLLM's field names and meanings."""
import json
import math
from dataclasses import dataclass, field, fields


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint, as in vLLM: json (a JSON schema, as a dict or its text), regex, choice (the
    output is one of these strings), grammar (EBNF, xgrammar's dialect) or json_object (any JSON object).
    disable_any_whitespace: JSON without free whitespace between tokens."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        set_ = self._constraints()
        if len(set_) != 1:
            raise ValueError(f"SamplingParams.structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {set_ or 'none'}")
        kind = set_[0]
        value = getattr(self, kind)
        ok = {"json": isinstance(value, (dict, str)), "regex": isinstance(value, str),
              "choice": isinstance(value, list) and all(isinstance(c, str) and c for c in value),
              "grammar": isinstance(value, str), "json_object": value is True}[kind]
        if not ok:
            raise ValueError(f"SamplingParams.structured_outputs.{kind} has the wrong type: {value!r}")

    def _constraints(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "disable_any_whitespace" and getattr(self, f.name)]

    @property
    def kind(self) -> str:
        return self._constraints()[0]

    def key(self) -> str:
        """A text that names the constraint exactly (compiled grammars are cached by it)."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True)


@dataclass
class SamplingParams:
    """n: completions per prompt. temperature: 0 means greedy. top_k: 0 or -1 disables.
    max_tokens: None means up to max_model_len. logprobs: number of top logprobs per token
    (the sampled token's is always included). prompt_logprobs: the same for each prompt token from the second on,
    scored by the model's logits at the token before it (RequestOutput.prompt_logprobs). stop: strings that end
    the text (excluded from it unless include_stop_str_in_output). stop_token_ids: tokens that end generation (kept
    in token_ids). presence_penalty / frequency_penalty in [-2, 2] and repetition_penalty > 0 as in vLLM
    (repetition reaches prompt and output tokens, the other two output tokens only). logit_bias: {token id:
    bias} added to the logits, each bias clamped to [-100, 100]. allowed_token_ids: only these may be drawn.
    bad_words: words never generated (their last token is banned after the rest). truncate_prompt_tokens:
    keep only the prompt's last k tokens (-1: max_model_len). min_tokens: EOS and stop tokens are masked
    until this many tokens exist. structured_outputs: a StructuredOutputsParams (or a dict of its fields)
    constraining the output to a JSON schema, regex, choice or EBNF grammar."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    _stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self):
        self._stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured_outputs(self.structured_outputs)
        self._validate()
        if self.logit_bias is not None:
            self.logit_bias = {int(t): min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}

    def _validate(self):
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be finite and >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                bad(name, "must be None or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be None or an integer")
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must hold non-negative integers")
        self._validate_processors(bad)

    def _validate_processors(self, bad):
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                bad(name, "must be in [-2, 2]")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty < math.inf:
            bad("repetition_penalty", "must be finite and > 0")
        if self.logit_bias is not None and (not isinstance(self.logit_bias, dict) or not all(
                _is_bias(t, b) for t, b in self.logit_bias.items())):
            bad("logit_bias", "must map token ids (>= 0; OpenAI's digit strings too) to numbers")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not _is_token(t) for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be None or a non-empty list of token ids (>= 0)")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", "must hold non-empty strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be None, a StructuredOutputsParams or a dict of its fields")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or not (t >= 1 or t == -1)):
            bad("truncate_prompt_tokens", "must be None, -1 (max_model_len) or an integer >= 1")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _is_bias(token, bias) -> bool:
    """A logit_bias entry: token id as an int or OpenAI's digit string, bias a number."""
    is_id = _is_token(token) or isinstance(token, str) and token.isdigit()
    return is_id and isinstance(bias, (int, float)) and not math.isnan(bias)


def _structured_outputs(d: dict) -> StructuredOutputsParams:
    unknown = set(d) - {f.name for f in fields(StructuredOutputsParams)}
    if unknown:
        raise ValueError(f"SamplingParams.structured_outputs has unknown keys {sorted(unknown)}")
    return StructuredOutputsParams(**d)


@dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters, as vLLM's: beam_width beams per prompt, each searched for max_tokens tokens
    (fewer where max_model_len ends it); ignore_eos: EOS continues a beam instead of completing it; temperature: the
    draw whose token joins the 2 * beam_width top-logprob candidates of each step (0: the most likely, already one of
    them); length_penalty: a beam's score is its cumulative logprob / length ** length_penalty, the length counting
    the prompt (and not a final EOS); skip_special_tokens: left out of the beams' text;
    include_stop_str_in_output: a beam that EOS completed keeps the EOS in its completion (run-batch's
    use_beam_search, as vLLM's server; LLM.beam_search's tokens always end with it)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not _is_token(value) or value < 1:
                raise ValueError(f"BeamSearchParams.{name} must be an integer >= 1, got {value!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"BeamSearchParams.temperature must be finite and >= 0, got {self.temperature!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"BeamSearchParams.length_penalty must be finite, got {self.length_penalty!r}")
