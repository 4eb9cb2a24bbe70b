"""The fields every speculative config shares, the JSON round trip (the mode stored as its
integer; `SpeculativeConfig.from_dict` dispatches on it) and the field checks mode configs
share. Configs validate at construction; errors name the field."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, ClassVar, Mapping

from specjax.speculative.config.enhancer import SAEnhancerConfig
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
    # Sampled requests: accept drafts by rejection sampling (lossless: the output follows the
    # target distribution) rather than strict matching. None -> on wherever a draft
    # distribution exists (in-step drafters), off for host drafters (they have none).
    use_rejection_sampling: bool | None = None

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.NONE
    # A class whose mode depends on its fields (MTPConfig: `mode` is a property) lists here
    # every mode it stands for; otherwise the class is registered under its `mode`.
    registered_modes: ClassVar[tuple[SpeculativeDecodingMode, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for mode in cls.__dict__.get("registered_modes") or (cls.mode,):
            _REGISTRY[mode] = cls

    def __post_init__(self):
        positive_int("max_draft_len", self.max_draft_len)
        if self.draft_len_schedule is not None:
            schedule = validate_draft_len_schedule(dict(self.draft_len_schedule), self.max_draft_len)
            object.__setattr__(self, "draft_len_schedule", tuple(schedule.items()))
        window = self.acceptance_rate_window_size
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"acceptance_rate_window_size must be an int >= 0, got {window!r}")
        if not 0 <= self.acceptance_rate_threshold <= 1:
            raise ValueError(f"acceptance_rate_threshold must be in [0, 1], got "
                             f"{self.acceptance_rate_threshold!r}")
        if hasattr(self, "sa_config"):  # the SA enhancer (`config.enhancer.SAEnhanced`)
            object.__setattr__(self, "sa_config", SAEnhancerConfig.of(self.sa_config))
        if self.use_rejection_sampling is None:
            object.__setattr__(self, "use_rejection_sampling", self.mode.has_draft_module())
        elif not isinstance(self.use_rejection_sampling, bool):
            raise ValueError("use_rejection_sampling must be a bool or None (the mode's default)")

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
            elif isinstance(value, SAEnhancerConfig):
                value = dataclasses.asdict(value)
            out[f.name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "SpeculativeConfig":
        data = dict(data)
        if "mode" not in data:
            raise ValueError("speculative config needs a 'mode' field (an integer or a name "
                             "such as \"eagle3\")")
        try:
            mode = SpeculativeDecodingMode.parse(data.pop("mode"))
        except ValueError as e:
            raise ValueError(str(e) if "unknown speculative decoding mode" in str(e)
                             else f"unknown speculative decoding mode: {e}") from None
        if mode is SpeculativeDecodingMode.MTP and "use_mtp_vanilla" not in data:
            # Asked for by name, MTP (one module per draft) is what "mtp" means: with a single
            # module the fields would otherwise give MTP-Eagle.
            data["use_mtp_vanilla"] = True
        cls = _REGISTRY.get(mode)
        if cls is None:
            raise ValueError(f"mode {mode.name} ({int(mode)}) is not implemented in this version")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown field(s) for {cls.__name__}: {', '.join(unknown)}")
        if data.get("draft_len_schedule") is not None:
            data["draft_len_schedule"] = {int(k): v for k, v in data["draft_len_schedule"].items()}
        config = cls(**data)
        if config.mode is not mode:  # only a class registered for several modes can disagree
            raise ValueError(f"stored mode {mode.name} ({int(mode)}) does not match the fields, "
                             f"which give {config.mode.name} ({int(config.mode)})")
        return config

    @staticmethod
    def from_json(text: str) -> "SpeculativeConfig":
        return SpeculativeConfig.from_dict(json.loads(text))


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def layer_tuple(name: str, value, count: int | None) -> tuple[int, ...]:
    """Validate a list of 0-based layer indices: ints >= 0, strictly increasing, `count` long."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of layer indices, got {value!r}")
    layers = tuple(value)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"{name} must hold ints >= 0 (0-based layer indices), got {value!r}")
    if count is not None and len(layers) != count:
        raise ValueError(f"{name} must name exactly {count} layers (the EAGLE-3 fc fuses "
                         f"{count} hidden states), got {len(layers)}: {list(layers)}")
    if not layers:
        raise ValueError(f"{name} must name at least one layer")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name} must name distinct layers, got {list(layers)}")
    if list(layers) != sorted(layers):
        raise ValueError(f"{name} must be sorted ascending, got {list(layers)}")
    return layers


def model_field(config: SpeculativeConfig, allowed: tuple[type, ...], what: str) -> None:
    """`speculative_model`: None, a folder path (PathLike stored as str), or an instance."""
    value = config.speculative_model
    if isinstance(value, os.PathLike):
        object.__setattr__(config, "speculative_model", os.fspath(value))
    elif value is not None and not isinstance(value, (str, *allowed)):
        raise ValueError(f"speculative_model must be a folder path or {what}, "
                         f"got {type(value).__name__}")


def model_field_to_dict(config: SpeculativeConfig, what: str, saver: str) -> None:
    value = config.speculative_model
    if value is not None and not isinstance(value, str):
        raise ValueError(f"speculative_model is {what} instance, which cannot be serialised: "
                         f"save it with {saver} and pass the folder path")
