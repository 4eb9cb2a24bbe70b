"""Configs of the parallel drafters (the reference's `is_parallel_draft()`): PARD, DFlash and
DSpark propose all D draft tokens from one forward pass of their drafter."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from specjax.models.dflash_head import DFlashHead
from specjax.models.dspark_head import DSparkHead
from specjax.models.llama import Llama
from specjax.speculative.config.base import (SpeculativeConfig, layer_tuple, model_field,
                                             model_field_to_dict)
from specjax.speculative.config.enhancer import SAEnhanced
from specjax.speculative.modes import SpeculativeDecodingMode


def _mask_field(config) -> None:
    mask = config.mask_token_id
    if mask is not None and (isinstance(mask, bool) or not isinstance(mask, int) or mask < 0):
        raise ValueError(f"mask_token_id must be an int >= 0 or None, got {mask!r}")


@dataclasses.dataclass(frozen=True)
class PARDConfig(SpeculativeConfig, SAEnhanced):
    """PARD: a small draft model of the target's tokenizer reads the accepted tokens followed
    by D - 1 mask tokens and gives D drafts from one pass (target-independent: one draft
    model serves every target of the tokenizer).

    `speculative_model`: a PARD folder (a Hugging Face Llama whose config.json names the mask
    token as `pard_token` or `mask_token_id`) or a `Llama`. `mask_token_id`: overrides the
    folder's; required with a `Llama` instance."""

    speculative_model: Any = None   # folder path (str) or a Llama
    mask_token_id: int | None = None

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.PARD

    def __post_init__(self):
        super().__post_init__()
        if self.speculative_model is None:
            raise ValueError("PARDConfig needs speculative_model: a PARD draft folder or a Llama")
        model_field(self, (Llama,), "a Llama")
        _mask_field(self)

    def to_dict(self) -> dict[str, Any]:
        model_field_to_dict(self, "a Llama", "specjax.models.save_pard_model(model, folder, "
                                             "mask_token_id)")
        return super().to_dict()


@dataclasses.dataclass(frozen=True)
class DFlashConfig(SpeculativeConfig, SAEnhanced):
    """DFlash (block diffusion): a few decoder layers read the target's residual streams at
    `target_layer_ids` (injected as keys and values into every layer) and fill a block of
    [newest token, mask x D] in one bidirectional pass.

    `speculative_model`: a DFlash folder (`specjax.models.dflash_checkpoint`) or a
    `DFlashHead`. `target_layer_ids` (None: the drafter's own, from its config.json) must
    equal the layers the drafter was trained on. `mask_token_id` (None: the drafter's)."""

    speculative_model: Any = None   # folder path (str) or a DFlashHead
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.DFLASH

    def __post_init__(self):
        super().__post_init__()
        if self.speculative_model is None:
            raise ValueError("DFlashConfig needs speculative_model: a DFlash drafter folder or "
                             "a DFlashHead")
        model_field(self, (DFlashHead,), "a DFlashHead")
        if self.target_layer_ids is not None:
            object.__setattr__(self, "target_layer_ids", layer_tuple(
                "target_layer_ids", self.target_layer_ids, None))
        _mask_field(self)

    def layers_for(self, head_layers: tuple[int, ...]) -> tuple[int, ...]:
        """The capture layers: the drafter's own; an explicit list must name the same ones
        (its fc was trained on exactly those streams)."""
        if self.target_layer_ids is not None and self.target_layer_ids != tuple(head_layers):
            raise ValueError(f"target_layer_ids {list(self.target_layer_ids)} differ from the "
                             f"layers the drafter was trained on, {list(head_layers)}: leave "
                             "target_layer_ids unset")
        return tuple(head_layers)

    def to_dict(self) -> dict[str, Any]:
        model_field_to_dict(self, "a DFlashHead", "specjax.models.save_dflash_head(head, folder)")
        return super().to_dict()


@dataclasses.dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DSpark: a DFlash drafter plus a Markov head (each draft conditioned on the one before
    it) and a confidence head. The block is drafted at full width (`max_draft_len`) at every
    step that drafts.

    `confidence_scheduling` (default on): how many drafts a step verifies is chosen from the
    drafter's own confidences (survival c_1 ... c_j) weighed against the measured step costs;
    off, from the engine's online acceptance estimates, as for every other drafter. Either
    way the output is exact. `speculative_model`: a DSpark folder or a `DSparkHead`. The SA
    enhancer is not offered (its drafts would replace a block drafted at full width)."""

    confidence_scheduling: bool = True

    mode: ClassVar[SpeculativeDecodingMode] = SpeculativeDecodingMode.DSPARK

    def __post_init__(self):
        super().__post_init__()
        model_field(self, (DSparkHead,), "a DSparkHead")
        if not isinstance(self.confidence_scheduling, bool):
            raise ValueError(f"confidence_scheduling must be true or false, got "
                             f"{self.confidence_scheduling!r}")
        if self.sa_config is not None:
            raise ValueError("DSpark takes no sa_config: it drafts its block at full width and "
                             "schedules verification by its own confidences")

    def to_dict(self) -> dict[str, Any]:
        model_field_to_dict(self, "a DSparkHead", "specjax.models.save_dflash_head(head, folder)")
        return super().to_dict()
