"""Configs of the hidden-state drafters (EAGLE-3, MTP) and of the collector whose files train
them (SAVE_HIDDEN_STATES)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

from specjax.core.tree import MAX_TREE_NODES, TreeShape
from specjax.models.eagle3_head import Eagle3Head
from specjax.models.mtp_head import MTPHeads
from specjax.speculative.config.base import (SpeculativeConfig, layer_tuple, model_field,
                                             model_field_to_dict, positive_int)
from specjax.speculative.config.enhancer import SAEnhanced
from specjax.speculative.modes import SpeculativeDecodingMode


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default capture layers for an L-layer target: (1, L//2 - 1, L - 4).

    0-based layer indices: the residual stream after those layers. Refused when the target
    has too few layers for three distinct ones (L <= 5 gives layer indices that collide or
    go below 1; L = 6 gives (1, 2, 2)).
    """
    positive_int("num_layers", num_layers)
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


def check_layers_in_range(name: str, layers: tuple[int, ...], num_layers: int) -> None:
    outside = [layer for layer in layers if layer >= num_layers]
    if outside:
        raise ValueError(f"{name} {list(layers)}: layer(s) {outside} outside the target's "
                         f"{num_layers} layers (0..{num_layers - 1})")


@dataclasses.dataclass(frozen=True)
class DynamicTreeFields:
    """The dynamic-tree fields EAGLE-3 and MTP-Eagle share (the reference's
    `use_dynamic_tree`): `use_dynamic_tree` with `dynamic_tree_max_topK` = K;
    `max_total_draft_tokens` (draft tokens verified per step) defaults to K * D and must lie in
    [D, min(K * D, 31)]. Without a tree it is D (None or D accepted); `total_draft_tokens`
    gives the effective value. `use_rejection_sampling` means what it means for a chain: sampled
    rows draw each node's children without replacement from the head's filtered distribution
    and are accepted by recursive rejection sampling (the default); False keeps top-K children
    and the walk that accepts the target's own token (token for token what seeded plain
    sampling draws; see `specjax.core.tree`)."""

    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: int | None = None
    max_total_draft_tokens: int | None = None

    def _check_tree(self) -> None:
        if not isinstance(self.use_dynamic_tree, bool):
            raise ValueError("use_dynamic_tree must be a bool")
        D, K, total = self.max_draft_len, self.dynamic_tree_max_topK, self.max_total_draft_tokens
        if total is not None:
            positive_int("max_total_draft_tokens", total)
        if not self.use_dynamic_tree:
            if K is not None:
                raise ValueError("dynamic_tree_max_topK is only used with use_dynamic_tree=True")
            if total is not None and total != D:
                raise ValueError(f"max_total_draft_tokens ({total}) must equal max_draft_len ({D}) "
                                 "for a chain; set use_dynamic_tree=True for a tree")
            return
        if K is None:
            raise ValueError("dynamic_tree_max_topK is required with use_dynamic_tree=True")
        positive_int("dynamic_tree_max_topK", K)
        if total is not None and not D <= total <= K * D:
            raise ValueError(f"max_total_draft_tokens ({total}) must lie in [max_draft_len, "
                             f"dynamic_tree_max_topK * max_draft_len] = [{D}, {K * D}]")
        if self.total_draft_tokens > MAX_TREE_NODES:
            raise ValueError(f"a dynamic tree verifies at most {MAX_TREE_NODES} draft tokens per "
                             f"step (its attention mask is one 32-bit word per row); "
                             f"max_total_draft_tokens is {self.total_draft_tokens}"
                             + ("" if total is not None else " (K * D)") + ": set it lower")

    @property
    def total_draft_tokens(self) -> int:
        """Draft tokens verified per step: D for a chain, `max_total_draft_tokens` (default
        K * D) for a dynamic tree."""
        if not self.use_dynamic_tree:
            return self.max_draft_len
        return self.max_total_draft_tokens or self.dynamic_tree_max_topK * self.max_draft_len

    @property
    def tree_shape(self) -> TreeShape | None:
        """The dynamic tree's static shape, None for a chain."""
        if not self.use_dynamic_tree:
            return None
        return TreeShape(self.dynamic_tree_max_topK, self.max_draft_len, self.total_draft_tokens)


@dataclasses.dataclass(frozen=True)
class EagleConfig(SpeculativeConfig, DynamicTreeFields, SAEnhanced):
    """EAGLE-3 in the one-model step: a head fed with target hidden states at three layers.

    `speculative_model`: a folder in the public EAGLE-3 layout (see
    `specjax.models.eagle3_checkpoint`) or an `Eagle3Head`; None leaves the choice to the
    factory. `eagle3_layers_to_capture`: 3 distinct ascending 0-based layer indices, or None for
    the default (1, L//2 - 1, L - 4) -- see `layers_to_capture`. A chain by default, or a
    dynamic tree (`DynamicTreeFields`).
    """

    speculative_model: Any = None   # folder path (str) or an Eagle3Head
    eagle3_layers_to_capture: tuple[int, ...] | None = None

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.EAGLE3_ONE_MODEL

    def __post_init__(self):
        super().__post_init__()
        model_field(self, (Eagle3Head,), "an Eagle3Head")
        if self.eagle3_layers_to_capture is not None:
            object.__setattr__(self, "eagle3_layers_to_capture", layer_tuple(
                "eagle3_layers_to_capture", self.eagle3_layers_to_capture, 3))
        self._check_tree()

    def layers_to_capture(self, num_layers: int,
                          head_layers: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The target layers (0-based) whose residual streams feed the head, for an
        L-layer target: the explicit list, else the layers the head records it was trained on
        (`head_layers`, from its config.json), else the default; checked against L."""
        layers = self.eagle3_layers_to_capture
        name = "eagle3_layers_to_capture"
        if layers is None and head_layers is not None:
            layers = layer_tuple("the head's eagle_aux_hidden_state_layer_ids", head_layers, 3)
            name = "the head's eagle_aux_hidden_state_layer_ids"
        if layers is None:
            return default_eagle3_layers(num_layers)
        positive_int("num_layers", num_layers)
        check_layers_in_range(name, layers, num_layers)
        return layers

    def to_dict(self) -> dict[str, Any]:
        model_field_to_dict(self, "an Eagle3Head", "save_eagle3_head(head, folder)")
        return super().to_dict()


@dataclasses.dataclass(frozen=True)
class MTPConfig(SpeculativeConfig, DynamicTreeFields, SAEnhanced):
    """Multi-token prediction (DeepSeek-V3 style MTP modules on the target's hidden state).

    The mode follows the fields: one module and not `use_mtp_vanilla` -> MTP_EAGLE_ONE_MODEL
    (the module is reused for each of the D draft steps, as a chain or a dynamic tree:
    `DynamicTreeFields`); otherwise MTP, where module k drafts token k, so `max_draft_len` may
    not exceed `num_nextn_predict_layers`.

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
        positive_int("num_nextn_predict_layers", self.num_nextn_predict_layers)
        if not isinstance(self.use_mtp_vanilla, bool):
            raise ValueError("use_mtp_vanilla must be a bool")
        self._check_tree()
        if self.use_dynamic_tree and self.mode is SpeculativeDecodingMode.MTP:
            raise ValueError("use_dynamic_tree needs MTP-Eagle (num_nextn_predict_layers=1, "
                             "use_mtp_vanilla=False): a tree reuses one module at every depth")
        model_field(self, (MTPHeads,), "an MTPHeads")
        if (self.mode is SpeculativeDecodingMode.MTP
                and self.max_draft_len > self.num_nextn_predict_layers):
            raise ValueError(
                f"max_draft_len ({self.max_draft_len}) exceeds num_nextn_predict_layers "
                f"({self.num_nextn_predict_layers}): MTP drafts one token per module; use one "
                "module without use_mtp_vanilla (MTP-Eagle) to reuse it for every draft step")

    def to_dict(self) -> dict[str, Any]:
        model_field_to_dict(self, "an MTPHeads", "its save function")
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
        positive_int("write_interval", self.write_interval)
        prefix = self.file_prefix
        if not isinstance(prefix, str) or not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"file_prefix must be a non-empty file name without a path "
                             f"separator, got {prefix!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", layer_tuple("layers", self.layers, None))

    def layers_to_capture(self, num_layers: int) -> tuple[int, ...]:
        """The explicit `layers` (checked against L), or EAGLE-3's default three plus the
        last layer L - 1 (whose output gives the target's own predictions)."""
        if self.layers is None:
            return (*default_eagle3_layers(num_layers), num_layers - 1)
        positive_int("num_layers", num_layers)
        check_layers_in_range("layers", self.layers, num_layers)
        return self.layers
