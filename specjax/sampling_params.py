"""Per-request sampling and stopping parameters, validated before any work starts."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from specjax.validation import GUIDED_FIELDS, check_sampling_fields


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick and when to stop. `temperature=0` (the default) is greedy decoding.

    Filtering order (see `specjax.core.sampling.filter_logits`): temperature, top-k,
    top-p on the top-k-renormalised distribution, then min-p relative to the top token.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities of the target model (log-softmax of its logits, before any
    # temperature, filtering or bias): per generated token the chosen token and the top
    # `logprobs` (0: the chosen one only); per prompt token likewise with `prompt_logprobs`.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # {token id: bias} added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    # vLLM's penalties, after the bias (`specjax.core.penalties`): repetition over prompt and
    # output tokens, frequency and presence over generated ones.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Structured output (`specjax.engine.grammar`), at most one of them: a JSON schema (a dict,
    # or its JSON text; True: any JSON object), a regular expression the whole output
    # matches, one of a list of strings, or a Lark grammar. Every verified position -- and so
    # every draft accepted -- obeys it; the request ends when the grammar is complete.
    guided_json: Mapping[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] | None = None
    guided_grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # Kept as sorted (id, bias) pairs so the parameters stay hashable.
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, Mapping) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in items)))
        # A schema is kept as its JSON text (key order kept: it orders the output), so the
        # parameters stay hashable.
        if isinstance(self.guided_json, Mapping):
            object.__setattr__(self, "guided_json", json.dumps(self.guided_json))
        if isinstance(self.guided_choice, (list, tuple)):
            object.__setattr__(self, "guided_choice", tuple(self.guided_choice))
        # The same checks (and messages) the engine and the HTTP server apply.
        check_sampling_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def guided(self) -> str | None:
        """The name of the structured-output field set (None: unconstrained)."""
        return next((name for name in GUIDED_FIELDS if getattr(self, name) not in (None, False)),
                    None)

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

