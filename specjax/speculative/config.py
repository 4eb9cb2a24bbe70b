"""Speculative decoding configs: validated at construction, JSON round-trip with the mode as int.

Every config shares the fields of `SpeculativeConfig`; each mode adds its own. Errors name the
field. `SpeculativeConfig.from_dict` dispatches on the stored integer mode.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any, ClassVar, Mapping

from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.schedule import validate_draft_len_schedule

_REGISTRY: dict[SpeculativeDecodingMode, type["SpeculativeConfig"]] = {}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    max_draft_len: int = 4
    # {batch-size threshold: draft length}; stored as sorted pairs so the config stays hashable.
    draft_len_schedule: Mapping[int, int] | tuple[tuple[int, int], ...] | None = None
    acceptance_rate_window_size: int = 0       # 0 = gate off
    acceptance_rate_threshold: float = 0.0
    use_rejection_sampling: bool = False

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.NONE

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.mode] = cls

    def __post_init__(self):
        _positive_int("max_draft_len", self.max_draft_len)
        if self.draft_len_schedule is not None:
            schedule = validate_draft_len_schedule(dict(self.draft_len_schedule), self.max_draft_len)
            object.__setattr__(self, "draft_len_schedule", tuple(schedule.items()))
        window = self.acceptance_rate_window_size
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"acceptance_rate_window_size must be an int >= 0, got {window!r}")
        if not 0 <= self.acceptance_rate_threshold <= 1:
            raise ValueError(f"acceptance_rate_threshold must be in [0, 1], got "
                             f"{self.acceptance_rate_threshold!r}")
        if not isinstance(self.use_rejection_sampling, bool):
            raise ValueError("use_rejection_sampling must be a bool")

    @property
    def schedule(self) -> dict[int, int] | None:
        return dict(self.draft_len_schedule) if self.draft_len_schedule else None

    # -- serialisation -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": int(self.mode)}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "draft_len_schedule" and value is not None:
                value = {str(k): v for k, v in value}
            out[f.name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "SpeculativeConfig":
        data = dict(data)
        if "mode" not in data:
            raise ValueError("speculative config needs a 'mode' field (an integer)")
        try:
            mode = SpeculativeDecodingMode(int(data.pop("mode")))
        except ValueError as e:
            raise ValueError(f"unknown speculative decoding mode: {e}") from None
        cls = _REGISTRY.get(mode)
        if cls is None:
            raise ValueError(f"mode {mode.name} ({int(mode)}) is not implemented in this version")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown field(s) for {cls.__name__}: {', '.join(unknown)}")
        if data.get("draft_len_schedule") is not None:
            data["draft_len_schedule"] = {int(k): v for k, v in data["draft_len_schedule"].items()}
        return cls(**data)

    @staticmethod
    def from_json(text: str) -> "SpeculativeConfig":
        return SpeculativeConfig.from_dict(json.loads(text))


@dataclasses.dataclass(frozen=True)
class NGramConfig(SpeculativeConfig):
    max_matching_ngram_size: int = 2
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.NGRAM

    def __post_init__(self):
        super().__post_init__()
        _positive_int("max_matching_ngram_size", self.max_matching_ngram_size)
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
        from specjax.speculative.drafters import Drafter
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


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
