"""Speculative decoding configs: validated at construction, JSON round-trip with the mode as int.

Every config shares the fields of `SpeculativeConfig`; each mode adds its own. Errors name the
field. `SpeculativeConfig.from_dict` dispatches on the stored integer mode.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any, ClassVar, Mapping

from specjax.models.eagle3_head import Eagle3Head
from specjax.models.mtp_head import MTPHeads
from specjax.speculative.drafters import Drafter
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
    # A class whose mode depends on its fields (MTPConfig: `mode` is a property) lists here
    # every mode it stands for; otherwise the class is registered under its `mode`.
    registered_modes: ClassVar[tuple[SpeculativeDecodingMode, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for mode in cls.__dict__.get("registered_modes") or (cls.mode,):
            _REGISTRY[mode] = cls

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
        config = cls(**data)
        if config.mode is not mode:  # only a class registered for several modes can disagree
            raise ValueError(f"stored mode {mode.name} ({int(mode)}) does not match the fields, "
                             f"which give {config.mode.name} ({int(config.mode)})")
        return config

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


# ---- hidden-state drafters: EAGLE-3, MTP, and the data collector that trains them ----------

def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default capture layers for an L-layer target: (1, L//2 - 1, L - 4).

    0-based layer indices: the residual stream after those layers. Refused when the target
    has too few layers for three distinct ones (L <= 5 gives layer indices that collide or
    go below 1; L = 6 gives (1, 2, 2)).
    """
    _positive_int("num_layers", num_layers)
    if num_layers <= 5:
        raise ValueError(f"the target has {num_layers} layers: EAGLE-3's default capture layers "
                         "(1, L//2 - 1, L - 4) need more than 5; pass eagle3_layers_to_capture "
                         "explicitly (3 distinct layers)")
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(layers)) != 3:
        raise ValueError(f"the target has {num_layers} layers: EAGLE-3's default capture layers "
                         f"{layers} repeat a layer; pass eagle3_layers_to_capture explicitly "
                         "(3 distinct layers)")
    return layers


def _layer_tuple(name: str, value, count: int | None) -> tuple[int, ...]:
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


def _check_layers_in_range(name: str, layers: tuple[int, ...], num_layers: int) -> None:
    outside = [layer for layer in layers if layer >= num_layers]
    if outside:
        raise ValueError(f"{name} {list(layers)}: layer(s) {outside} outside the target's "
                         f"{num_layers} layers (0..{num_layers - 1})")


def _model_field(config: SpeculativeConfig, allowed: tuple[type, ...], what: str) -> None:
    """`speculative_model`: None, a folder path (PathLike stored as str), or an instance."""
    value = config.speculative_model
    if isinstance(value, os.PathLike):
        object.__setattr__(config, "speculative_model", os.fspath(value))
    elif value is not None and not isinstance(value, (str, *allowed)):
        raise ValueError(f"speculative_model must be a folder path or {what}, "
                         f"got {type(value).__name__}")


def _model_field_to_dict(config: SpeculativeConfig, what: str, saver: str) -> None:
    value = config.speculative_model
    if value is not None and not isinstance(value, str):
        raise ValueError(f"speculative_model is {what} instance, which cannot be serialised: "
                         f"save it with {saver} and pass the folder path")


@dataclasses.dataclass(frozen=True)
class EagleConfig(SpeculativeConfig):
    """EAGLE-3 in the one-model step: a head fed with target hidden states at three layers.

    `speculative_model`: a folder in the public EAGLE-3 layout (see
    `specjax.models.eagle3_checkpoint`) or an `Eagle3Head`; None leaves the choice to the
    factory. `eagle3_layers_to_capture`: 3 distinct ascending 0-based layer indices, or None for
    the default (1, L//2 - 1, L - 4) -- see `layers_to_capture`.

    Dynamic tree: `use_dynamic_tree` with `dynamic_tree_max_topK` = K; `max_total_draft_tokens`
    (draft tokens verified per step) defaults to K * D and must lie in [D, K * D]. Without a
    tree it is D (None or D accepted). `total_draft_tokens` gives the effective value.
    """

    speculative_model: Any = None   # folder path (str) or an Eagle3Head
    eagle3_layers_to_capture: tuple[int, ...] | None = None
    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: int | None = None
    max_total_draft_tokens: int | None = None

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.EAGLE3_ONE_MODEL

    def __post_init__(self):
        super().__post_init__()
        _model_field(self, (Eagle3Head,), "an Eagle3Head")
        if self.eagle3_layers_to_capture is not None:
            object.__setattr__(self, "eagle3_layers_to_capture", _layer_tuple(
                "eagle3_layers_to_capture", self.eagle3_layers_to_capture, 3))
        if not isinstance(self.use_dynamic_tree, bool):
            raise ValueError("use_dynamic_tree must be a bool")
        D, K, total = self.max_draft_len, self.dynamic_tree_max_topK, self.max_total_draft_tokens
        if total is not None:
            _positive_int("max_total_draft_tokens", total)
        if not self.use_dynamic_tree:
            if K is not None:
                raise ValueError("dynamic_tree_max_topK is only used with use_dynamic_tree=True")
            if total is not None and total != D:
                raise ValueError(f"max_total_draft_tokens ({total}) must equal max_draft_len ({D}) "
                                 "for a chain; set use_dynamic_tree=True for a tree")
            return
        if K is None:
            raise ValueError("dynamic_tree_max_topK is required with use_dynamic_tree=True")
        _positive_int("dynamic_tree_max_topK", K)
        if total is not None and not D <= total <= K * D:
            raise ValueError(f"max_total_draft_tokens ({total}) must lie in [max_draft_len, "
                             f"dynamic_tree_max_topK * max_draft_len] = [{D}, {K * D}]")

    @property
    def total_draft_tokens(self) -> int:
        """Draft tokens verified per step: D for a chain, `max_total_draft_tokens` (default
        K * D) for a dynamic tree."""
        if not self.use_dynamic_tree:
            return self.max_draft_len
        return self.max_total_draft_tokens or self.dynamic_tree_max_topK * self.max_draft_len

    def layers_to_capture(self, num_layers: int,
                          head_layers: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The target layers (0-based) whose residual streams feed the head, for an
        L-layer target: the explicit list, else the layers the head records it was trained on
        (`head_layers`, from its config.json), else the default; checked against L."""
        layers = self.eagle3_layers_to_capture
        name = "eagle3_layers_to_capture"
        if layers is None and head_layers is not None:
            layers = _layer_tuple("the head's eagle_aux_hidden_state_layer_ids", head_layers, 3)
            name = "the head's eagle_aux_hidden_state_layer_ids"
        if layers is None:
            return default_eagle3_layers(num_layers)
        _positive_int("num_layers", num_layers)
        _check_layers_in_range(name, layers, num_layers)
        return layers

    def to_dict(self) -> dict[str, Any]:
        _model_field_to_dict(self, "an Eagle3Head", "save_eagle3_head(head, folder)")
        return super().to_dict()


@dataclasses.dataclass(frozen=True)
class MTPConfig(SpeculativeConfig):
    """Multi-token prediction (DeepSeek-V3 style MTP modules on the target's hidden state).

    The mode follows the fields: one module and not `use_mtp_vanilla` -> MTP_EAGLE_ONE_MODEL
    (the module is reused for each of the D draft steps); otherwise MTP, where module k drafts
    token k, so `max_draft_len` may not exceed `num_nextn_predict_layers`.

    `speculative_model`: None (the MTP modules ship with the target), a folder path, or an
    `MTPHeads` instance.
    """

    num_nextn_predict_layers: int = 1
    use_mtp_vanilla: bool = False
    speculative_model: Any = None   # None, folder path (str) or an MTPHeads

    registered_modes: ClassVar[tuple[SpeculativeDecodingMode, ...]] = (
        SpeculativeDecodingMode.MTP, SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL)

    @property
    def mode(self) -> SpeculativeDecodingMode:  # type: ignore[override]
        if self.num_nextn_predict_layers == 1 and not self.use_mtp_vanilla:
            return SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL
        return SpeculativeDecodingMode.MTP

    def __post_init__(self):
        super().__post_init__()
        _positive_int("num_nextn_predict_layers", self.num_nextn_predict_layers)
        if not isinstance(self.use_mtp_vanilla, bool):
            raise ValueError("use_mtp_vanilla must be a bool")
        _model_field(self, (MTPHeads,), "an MTPHeads")
        if (self.mode is SpeculativeDecodingMode.MTP
                and self.max_draft_len > self.num_nextn_predict_layers):
            raise ValueError(
                f"max_draft_len ({self.max_draft_len}) exceeds num_nextn_predict_layers "
                f"({self.num_nextn_predict_layers}): MTP drafts one token per module; use one "
                "module without use_mtp_vanilla (MTP-Eagle) to reuse it for every draft step")

    def to_dict(self) -> dict[str, Any]:
        _model_field_to_dict(self, "an MTPHeads", "its save function")
        return super().to_dict()


@dataclasses.dataclass(frozen=True)
class SaveHiddenStatesConfig(SpeculativeConfig):
    """Not a drafter: the target runs normally and the residual streams after `layers` are
    written to `output_directory` (files `{file_prefix}_*`) every `write_interval` steps --
    training data for hidden-state drafters. `layers=None` means the EAGLE-3 default capture
    layers plus the last layer (see `layers_to_capture`). Nothing is drafted, so
    `max_draft_len` (default 1 here) is unused."""

    max_draft_len: int = 1
    output_directory: str | None = None
    write_interval: int = 20
    file_prefix: str = "data"
    layers: tuple[int, ...] | None = None

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.SAVE_HIDDEN_STATES

    def __post_init__(self):
        super().__post_init__()
        directory = self.output_directory
        if isinstance(directory, os.PathLike):
            directory = os.fspath(directory)
            object.__setattr__(self, "output_directory", directory)
        if not isinstance(directory, str) or not directory:
            raise ValueError(f"output_directory is required: a folder path, got {directory!r}")
        _positive_int("write_interval", self.write_interval)
        prefix = self.file_prefix
        if not isinstance(prefix, str) or not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"file_prefix must be a non-empty file name without a path "
                             f"separator, got {prefix!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", _layer_tuple("layers", self.layers, None))

    def layers_to_capture(self, num_layers: int) -> tuple[int, ...]:
        """The explicit `layers` (checked against L), or EAGLE-3's default three plus the
        last layer L - 1 (whose output gives the target's own predictions)."""
        if self.layers is None:
            return (*default_eagle3_layers(num_layers), num_layers - 1)
        _positive_int("num_layers", num_layers)
        _check_layers_in_range("layers", self.layers, num_layers)
        return self.layers
