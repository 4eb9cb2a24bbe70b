"""Factories chosen by mode predicate: a worker for in-step decoders, a Drafter for host drafters.

The two paths are mutually exclusive: a mode has either a spec decoder or a spec drafter.
"""
from __future__ import annotations

from flax import nnx

from specjax.models import Llama, load_hf_checkpoint
from specjax.models.config import ModelConfig
from specjax.models.registry import resolve_model_path
from specjax.speculative.config import (DraftTargetConfig, EagleConfig, MTPConfig, NGramConfig,
                                        SpeculativeConfig, UserProvidedConfig)
from specjax.speculative.drafters import Drafter, NGramDrafter
from specjax.speculative.modes import SpeculativeDecodingMode


def load_draft_model(config: SpeculativeConfig, target: Llama, dtype: str | None = None):
    """The drafter module a mode runs beside the target: a `Llama` for draft-target, an
    `Eagle3Head` for EAGLE-3, `MTPHeads` for MTP; None for modes without one. A folder path
    is loaded; an instance is checked against the target the same way."""
    draft = getattr(config, "speculative_model", None)
    if isinstance(config, DraftTargetConfig):
        if not isinstance(draft, Llama):
            draft = load_hf_checkpoint(resolve_model_path(draft), dtype=dtype or target.config.dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"speculative_model vocab_size {draft.config.vocab_size} differs from "
                             f"the target's {target.config.vocab_size}: draft-target needs one "
                             "tokenizer")
        return draft
    if isinstance(config, EagleConfig):
        from specjax.speculative.eagle3_checkpoint import load_eagle3_head
        if draft is None:
            raise ValueError("EagleConfig needs speculative_model: an EAGLE-3 head folder (public "
                             "layout) or an Eagle3Head")
        if isinstance(draft, str):
            draft = load_eagle3_head(resolve_model_path(draft), dtype=dtype or target.config.dtype)
        check_head_matches_target(draft.config.hidden_size, draft.config.vocab_size, target.config,
                                  "the EAGLE-3 head")
        return draft
    if isinstance(config, MTPConfig):
        if draft is None:
            raise ValueError("MTPConfig needs speculative_model: an MTP heads folder or an "
                             "MTPHeads (this target ships no MTP modules)")
        if isinstance(draft, str):
            from specjax.speculative.mtp_checkpoint import load_mtp_heads
            draft = load_mtp_heads(resolve_model_path(draft), target.config,
                                   dtype=dtype or target.config.dtype)
        check_head_matches_target(draft.config.hidden_size, draft.config.vocab_size, target.config,
                                  "the MTP heads")
        if (config.mode is SpeculativeDecodingMode.MTP
                and draft.num_modules < config.max_draft_len):
            raise ValueError(f"MTP with max_draft_len {config.max_draft_len} needs that many "
                             f"modules; the heads have {draft.num_modules}")
        return draft
    return None


def check_head_matches_target(hidden_size: int, vocab_size: int, target: ModelConfig,
                              what: str) -> None:
    if hidden_size != target.hidden_size:
        raise ValueError(f"{what} has hidden_size {hidden_size} but the target's is "
                         f"{target.hidden_size}: it was trained for another target")
    if vocab_size != target.vocab_size:
        raise ValueError(f"{what} has vocab_size {vocab_size} but the target's is "
                         f"{target.vocab_size}: it was trained for another target")


def get_spec_worker(config: SpeculativeConfig | None, draft_model=None,
                    target_config: ModelConfig | None = None):
    """The in-step worker for `has_spec_decoder()` modes, else None. `draft_model` is what
    `load_draft_model` returns; hidden-state drafters also need the target's config."""
    if config is None or not config.mode.has_spec_decoder():
        return None
    mode = config.mode
    rs = config.use_rejection_sampling
    if draft_model is None:
        raise ValueError(f"{mode.name} needs its drafter module (see load_draft_model)")
    graphdef = nnx.split(draft_model)[0]
    if mode is SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL:
        from specjax.speculative.draft_target import DraftTargetWorker
        return DraftTargetWorker(graphdef, draft_model.config, rejection_sampling=rs)
    if target_config is None:
        raise ValueError(f"{mode.name} needs the target's config")
    from specjax.speculative import hidden_workers as hw
    L = target_config.num_layers
    if mode is SpeculativeDecodingMode.EAGLE3_ONE_MODEL:
        if config.use_dynamic_tree:
            raise NotImplementedError("EAGLE-3 dynamic trees are not implemented yet; use a "
                                      "chain (use_dynamic_tree=False)")
        layers = config.layers_to_capture(L, draft_model.config.aux_hidden_state_layers)
        return hw.Eagle3Worker(graphdef, layers, rs, head_config=draft_model.config)
    if mode is SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL:
        return hw.MTPEagleWorker(graphdef, (L - 1,), rs, target_config=target_config)
    if mode is SpeculativeDecodingMode.MTP:
        return hw.MTPWorker(graphdef, (L - 1,), draft_model.num_modules, target_config, rs)
    raise NotImplementedError(f"speculative mode {mode.name} is not implemented yet")


def get_spec_drafter(config: SpeculativeConfig | None,
                     max_sequence_length: int | None = None) -> Drafter | None:
    """The host-side Drafter for `has_spec_drafter()` modes, else None."""
    if config is None or not config.mode.has_spec_drafter():
        return None
    if isinstance(config, NGramConfig):
        return NGramDrafter(config.max_draft_len, config.max_matching_ngram_size,
                            config.is_keep_all, config.is_use_oldest, config.is_public_pool,
                            max_sequence_length)
    if isinstance(config, UserProvidedConfig):
        return config._instance
    raise NotImplementedError(f"no drafter for mode {config.mode.name}")
