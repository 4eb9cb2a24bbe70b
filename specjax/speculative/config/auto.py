"""AUTO: speculation chosen when the engine starts (`specjax.speculative.defaults.resolve_auto`)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.speculative.config.base import SpeculativeConfig, positive_int
from specjax.speculative.modes import SpeculativeDecodingMode


@dataclasses.dataclass(frozen=True)
class AutoConfig(SpeculativeConfig):
    """Let the engine choose, by the reference's heuristic: a drafter trained for the model
    when one ships with it (the bundled target: EAGLE-3 with its head), else NGram with
    D = 5 and n-grams up to 3 for max_batch_size <= 4, D = 3 and n-grams up to 5 above; either
    way speculation is off while more than `max_concurrency` requests run. The choice is logged
    and is what `LLM.speculative_config` / `Engine.speculation.config` hold. The shared fields
    (max_draft_len, ...) are not used: the chosen config has its own."""

    max_concurrency: int = 32

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.AUTO

    def __post_init__(self):
        super().__post_init__()
        positive_int("max_concurrency", self.max_concurrency)
