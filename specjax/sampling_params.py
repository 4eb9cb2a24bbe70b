"""Per-request sampling and stopping parameters, validated before any work starts."""
from __future__ import annotations

import dataclasses

from specjax.validation import check_sampling_fields


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

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # The same checks (and messages) the engine and the HTTP server apply.
        check_sampling_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

