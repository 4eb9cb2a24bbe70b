"""Host-side request state and what the user gets back."""
from __future__ import annotations

import dataclasses
import enum
import time

from specjax.engine.grammar import Grammar
from specjax.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # queued; holds no KV blocks
    RUNNING = "running"      # has a slot and KV blocks
    FINISHED = "finished"


@dataclasses.dataclass
class RequestStats:
    """Per-request figures. Padding never counts: only this request's real tokens do."""

    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    decoding_iterations: int = 0   # target steps that produced tokens for this request
    num_preemptions: int = 0
    num_draft_tokens: int = 0      # drafts verified (real length, before padding)
    num_steps_with_drafts: int = 0 # decoding iterations that verified at least one draft
    num_accepted_draft_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0     # prompt tokens whose K/V came from the prefix cache

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to the last token."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    def __repr__(self) -> str:
        # The *_time fields are perf_counter readings (meaningful only as differences), so
        # show the durations and ratios a reader wants instead.
        def fmt(value):
            return f"{value:.4g}" if isinstance(value, float) else repr(value)
        shown = {
            "time_to_first_token": self.time_to_first_token, "latency": self.latency,
            "num_generated_tokens": self.num_generated_tokens,
            "decoding_iterations": self.decoding_iterations,
            "tokens_per_iteration": self.tokens_per_iteration,
            "num_steps_with_drafts": self.num_steps_with_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.acceptance_rate, "num_preemptions": self.num_preemptions}
        return "RequestStats(" + ", ".join(f"{k}={fmt(v)}" for k, v in shown.items()) + ")"

    @property
    def acceptance_rate(self) -> float | None:
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_draft_tokens / self.num_draft_tokens

    @property
    def acceptance_length(self) -> float | None:
        """(accepted drafts + n) / n over this request's n decoding iterations that verified
        at least one draft: the same figure as `EngineStats.acceptance_length`, for one
        request. None before any draft."""
        n = self.num_steps_with_drafts
        return (self.num_accepted_draft_tokens + n) / n if n else None

    @property
    def tokens_per_iteration(self) -> float | None:
        """Tokens generated per decoding iteration, with or without drafts (1.0 without
        speculation; the first token, from the prompt's prefill, counts as one iteration)."""
        if not self.decoding_iterations:
            return None
        return self.num_generated_tokens / self.decoding_iterations


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None      # "stop", "length", "abort", "error"; None while running
    stats: RequestStats
    error: str | None = None       # with "error": what failed (this request alone)
    # With SamplingParams.logprobs: per generated token {token id: logprob}, the top k in
    # descending order, then the chosen token if it is not among them.
    logprobs: list[dict[int, float]] | None = None
    # With SamplingParams.prompt_logprobs: the same per prompt token (None for the first,
    # which has no context).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, request: "Request") -> "RequestOutput":
        """The request as it stands, in O(1) for its tokens: the engine returns one per
        advanced request every step, and copying a long output each time would cost the host
        loop time quadratic in its length. `output_ids` is only ever appended to, so its
        first n entries, sliced when `token_ids` is first read, are the snapshot; the prompt
        is shared. (Logprobs, asked for by few requests, are copied.)"""
        copy = lambda entries: None if entries is None else list(entries)
        out = cls.__new__(cls)
        out.__dict__.update(request_id=request.request_id, prompt_token_ids=request.prompt_ids,
                            text=request.text, finish_reason=request.finish_reason,
                            stats=request.stats, error=request.error,
                            logprobs=copy(request.logprobs),
                            prompt_logprobs=copy(request.prompt_logprobs),
                            _output=(request.output_ids, len(request.output_ids)))
        return out

    def token_ids_from(self, start: int) -> list[int]:
        """token_ids[start:], without copying the tokens before `start` (a streaming client
        reads only what is new)."""
        lazy = self.__dict__.get("_output")
        if lazy is not None and "token_ids" not in self.__dict__:
            return lazy[0][start:lazy[1]]
        return self.token_ids[start:]

    def __getattr__(self, name: str):
        # Reached only for a snapshot's `token_ids` not read yet (`of`).
        source = self.__dict__.get("_output") if name == "token_ids" else None
        if source is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = self.__dict__["token_ids"] = source[0][:source[1]]
        return value


@dataclasses.dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_len: int                  # prompt + output may not exceed this (the context limit)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0         # leading tokens whose K/V are in the pool
    prefilled: bool = False       # every token went through a step since (re)admission
    status: Status = Status.WAITING
    slot: int | None = None
    draft_tokens: list[int] = dataclasses.field(default_factory=list)
    drafts_held: int = 0   # drafts its slot holds for the next step (in-step drafters)
    # The drafter's confidence in each of those drafts (DSpark), once read; else None
    draft_confidence: list[float] | None = None
    grammar: Grammar | None = None  # structured output: the state after the output so far
    latest_step: int = 0          # id of the newest generation step dispatched for it
    latest_reserve: int = 0       # positions that step may write past the newest token
    latest_advance: int = 0       # tokens that step may add
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None      # why the engine failed this request (finish_reason "error")
    stats: RequestStats = dataclasses.field(default_factory=RequestStats)
    # As in RequestOutput, while they are asked for: one entry per output token; one per
    # prompt token, filled while the prompt's chunks run (the first prompt token's is None).
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self):
        self.stats.arrival_time = time.perf_counter()
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, index: int) -> int:
        """Token `index` of prompt + output, without building the whole list."""
        P = len(self.prompt_ids)
        return self.prompt_ids[index] if index < P else self.output_ids[index - P]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start .. end-1 of prompt + output."""
        P = len(self.prompt_ids)
        return (self.prompt_ids[start:min(end, P)]
                + self.output_ids[max(start - P, 0):max(end - P, 0)])

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities were asked for and some are still missing (a prompt
        recomputed after preemption does not add them again)."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_ids))

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens not yet in the KV pool (1 while decoding: the last sampled token)."""
        return self.num_tokens - self.num_computed

    def output(self) -> RequestOutput:
        return RequestOutput.of(self)
