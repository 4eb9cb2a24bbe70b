"""Configs of drafters that read no target hidden states: NGram and user drafters on the host,
SA (the request's own tokens) and a draft model inside the step."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, ClassVar

from specjax.core.suffix import MAX_MATCH
from specjax.speculative.config.base import SpeculativeConfig, positive_int
from specjax.speculative.config.enhancer import SAEnhanced
from specjax.speculative.drafters import Drafter
from specjax.speculative.modes import SpeculativeDecodingMode


@dataclasses.dataclass(frozen=True)
class NGramConfig(SpeculativeConfig):
    """TensorRT-LLM's NGram drafter, plus evidence it may ask of a match before proposing
    (`specjax.speculative.drafters.NGramDrafter`): `min_matching_ngram_size`, the shortest
    matched suffix that proposes, and `min_followed_ratio`, the least share of the matched
    pattern's earlier occurrences that the proposal's first token followed (the defaults,
    1 and 0, are the reference's: any match proposes)."""

    max_matching_ngram_size: int = 2
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True
    min_matching_ngram_size: int = 1
    min_followed_ratio: float = 0.0

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.NGRAM

    def __post_init__(self):
        super().__post_init__()
        positive_int("max_matching_ngram_size", self.max_matching_ngram_size)
        for name in ("is_keep_all", "is_use_oldest", "is_public_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
        positive_int("min_matching_ngram_size", self.min_matching_ngram_size)
        if self.min_matching_ngram_size > self.max_matching_ngram_size:
            raise ValueError(f"min_matching_ngram_size ({self.min_matching_ngram_size}) must be "
                             f"at most max_matching_ngram_size ({self.max_matching_ngram_size})")
        r = self.min_followed_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ValueError(f"min_followed_ratio must be a number in [0, 1], got {r!r}")


@dataclasses.dataclass(frozen=True)
class SAConfig(SpeculativeConfig):
    """SA: each request drafts from its own tokens (prompt and accepted), inside the step --
    the continuation of the earliest earlier occurrence of its longest repeated suffix
    (`max_matching_ngram_size=-1`; matches are counted up to `specjax.core.suffix.MAX_MATCH`
    tokens), or of the first of the suffix sizes N..1 that occurred earlier (N > 0). No
    match: no drafts that step.

    `enable_global_pool`: a request also matches the other requests' tokens and the last
    `global_pool_size` finished requests' (None: as many as `max_batch_size`; oldest
    evicted); its own context wins ties. SA's drafts have no distribution, so sampled
    requests accept by strict matching (`use_rejection_sampling=True` is refused)."""

    max_matching_ngram_size: int = -1
    enable_global_pool: bool = False
    global_pool_size: int | None = None

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.SA

    def __post_init__(self):
        if self.use_rejection_sampling:
            raise ValueError("use_rejection_sampling=True does not apply to SA: its drafts have "
                             "no draft distribution (sampled requests accept by strict "
                             "matching, exact); leave it unset")
        super().__post_init__()
        n = self.max_matching_ngram_size
        if isinstance(n, bool) or not isinstance(n, int) or not (n == -1 or 1 <= n <= MAX_MATCH):
            raise ValueError(f"max_matching_ngram_size must be -1 (the longest suffix) or an int "
                             f"in [1, {MAX_MATCH}], got {n!r}")
        if not isinstance(self.enable_global_pool, bool):
            raise ValueError("enable_global_pool must be a bool")
        if self.global_pool_size is not None:
            if not self.enable_global_pool:
                raise ValueError("global_pool_size is only used with enable_global_pool=True")
            positive_int("global_pool_size", self.global_pool_size)


@dataclasses.dataclass(frozen=True)
class DraftTargetConfig(SpeculativeConfig, SAEnhanced):
    """A smaller model of the same tokenizer drafts D tokens inside the step."""

    speculative_model: Any = None   # a checkpoint folder (str) or a Llama instance

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL

    def __post_init__(self):
        super().__post_init__()
        if self.speculative_model is None:
            raise ValueError("speculative_model is required: a draft checkpoint folder or a Llama")

    def to_dict(self) -> dict[str, Any]:
        if not isinstance(self.speculative_model, str):
            raise ValueError("speculative_model must be a folder path to serialise this config")
        return super().to_dict()


@dataclasses.dataclass(frozen=True)
class UserProvidedConfig(SpeculativeConfig):
    """`drafter` is a `specjax.Drafter` instance or an importable "module:Class" path."""

    drafter: Any = None

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.USER_PROVIDED

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.drafter, str):
            module, _, name = self.drafter.partition(":")
            try:
                drafter = getattr(importlib.import_module(module), name)()
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"drafter {self.drafter!r} cannot be imported: {e}") from None
            object.__setattr__(self, "_instance", drafter)
        else:
            object.__setattr__(self, "_instance", self.drafter)
        if not isinstance(self._instance, Drafter):
            raise ValueError(f"drafter must be a specjax.Drafter or 'module:Class', got "
                             f"{type(self.drafter).__name__}")

    def to_dict(self) -> dict[str, Any]:
        if not isinstance(self.drafter, str):
            raise ValueError("drafter must be a 'module:Class' path to serialise this config")
        return super().to_dict()
