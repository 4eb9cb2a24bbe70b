"""Factories chosen by mode predicate: a worker for in-step decoders, a Drafter for host drafters.

The two paths are mutually exclusive: a mode has either a spec decoder or a spec drafter.
"""
from __future__ import annotations

from flax import nnx

from specjax.models import Llama, load_hf_checkpoint
from specjax.models.registry import resolve_model_path
from specjax.speculative.config import (DraftTargetConfig, NGramConfig, SpeculativeConfig,
                                        UserProvidedConfig)
from specjax.speculative.drafters import Drafter, NGramDrafter
from specjax.speculative.modes import SpeculativeDecodingMode


def load_draft_model(config: DraftTargetConfig, target: Llama, dtype: str | None = None) -> Llama:
    draft = config.speculative_model
    if not isinstance(draft, Llama):
        draft = load_hf_checkpoint(resolve_model_path(draft), dtype=dtype or target.config.dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_model vocab_size {draft.config.vocab_size} differs from the "
                         f"target's {target.config.vocab_size}: draft-target needs one tokenizer")
    return draft


def get_spec_worker(config: SpeculativeConfig | None, draft_model: Llama | None = None):
    """The in-step worker for `has_spec_decoder()` modes, else None."""
    if config is None or not config.mode.has_spec_decoder():
        return None
    if config.mode is SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL:
        from specjax.speculative.draft_target import DraftTargetWorker
        if draft_model is None:
            raise ValueError("draft-target needs its draft model")
        return DraftTargetWorker(nnx.split(draft_model)[0],
                                 rejection_sampling=config.use_rejection_sampling)
    raise NotImplementedError(f"speculative mode {config.mode.name} is not implemented yet")


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
