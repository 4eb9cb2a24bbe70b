"""Configs of drafters that read no target hidden states: NGram and user drafters on the host,
a draft model inside the step."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, ClassVar

from specjax.speculative.config.base import SpeculativeConfig, positive_int
from specjax.speculative.drafters import Drafter
from specjax.speculative.modes import SpeculativeDecodingMode


@dataclasses.dataclass(frozen=True)
class NGramConfig(SpeculativeConfig):
    max_matching_ngram_size: int = 2
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.NGRAM

    def __post_init__(self):
        super().__post_init__()
        positive_int("max_matching_ngram_size", self.max_matching_ngram_size)
        for name in ("is_keep_all", "is_use_oldest", "is_public_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")


@dataclasses.dataclass(frozen=True)
class DraftTargetConfig(SpeculativeConfig):
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
