"""Request outputs with vLLM's field names."""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: drafts sent to verification and how many were accepted, over all
    # completions of the request (acceptance rate = accepted / verified).
    spec_verified_drafts: int = 0
    spec_accepted_drafts: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """finish_reason: "stop" | "length" | "error" (None while running). stop_reason: the stop
    string or stop token id that ended it, None for EOS or length. error: message when it failed."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per prompt token, None for the first (nothing
    scores it), then {token id: Logprob} holding the prompt token's and the top ones, as vLLM gives them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default=None)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: tokens include the prompt's; logprobs: per generated token the {token id: Logprob} of
    its step (its candidates); text: the tokens decoded (prompt included; special ones as
    BeamSearchParams.skip_special_tokens says), set on the returned beams."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop": ended by EOS; "length": max_tokens or max_model_len reached


@dataclass
class BeamSearchOutput:
    """A prompt's best beams (at most beam_width), best first."""

    sequences: list[BeamSearchSequence]
