"""The SA enhancer (`sa_config`), a field of every in-step neural drafter's config: where a
request's context repeats, drafts from its own tokens replace the drafter's."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from specjax.core.suffix import MAX_MATCH


@dataclasses.dataclass(frozen=True)
class SAEnhancerConfig:
    """After the neural drafter drafts, each request whose longest earlier-occurring suffix is
    at least `threshold` tokens long takes SA's draft instead (the tokens that followed that
    suffix's earliest occurrence), inside the step.

    SA's drafts have no draft distribution, so a sampled request's step that verifies them
    accepts by strict matching (the target's own draw at each position); steps verifying the
    drafter's drafts keep rejection sampling. Greedy requests are exact either way."""

    threshold: int = 4

    def __post_init__(self):
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_MATCH:
            raise ValueError(f"sa_config.threshold must be an int in [1, {MAX_MATCH}] (the longest "
                             f"match the matcher counts), got {t!r}")

    @staticmethod
    def of(value: Any) -> "SAEnhancerConfig | None":
        """A field value: None, an SAEnhancerConfig, or its dict (JSON)."""
        if value is None or isinstance(value, SAEnhancerConfig):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(SAEnhancerConfig)})
            if unknown:
                raise ValueError(f"unknown field(s) for sa_config: {', '.join(unknown)}")
            return SAEnhancerConfig(**value)
        raise ValueError(f"sa_config must be a specjax.SAEnhancerConfig, a dict such as "
                         f"{{\"threshold\": 4}}, or None; got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class SAEnhanced:
    """Mixin: the `sa_config` field (None: the drafter's drafts only). `SpeculativeConfig`
    normalises it (a dict from JSON becomes an SAEnhancerConfig) and serialises it."""

    sa_config: SAEnhancerConfig | None = None
