"""From a speculative config to what the engine runs: `build_speculation(config, target)`.

The mode's predicates decide every piece, never a chain of mode names:

- `has_draft_module()`: the drafter module is loaded by the loader its worker module registered
  (`workers.registry.DRAFTERS`), put once in the layout the steps run, and its parameters ride
  in the step (`Speculation.draft_model`) with an in-step worker (`get_spec_worker`), which
  writes the drafter's K/V past the verified window: the KV reservation covers it
  (`Speculation.drafts_in_step`);
- `has_spec_decoder()`: the step drafts -- a worker, SA (`Speculation.suffix`: the request's own
  tokens, `specjax.core.suffix`), or both (a worker's config with `sa_config`: the enhancer);
- `has_spec_drafter()`: a host drafter (`get_spec_drafter`) -- the two are mutually exclusive;
- `support_overlap_scheduler()`: steps with drafts may be dispatched before the previous one
  is read (`Speculation.overlap`);
- `needs_kv_cache_rewind()`: rejected draft positions go back to the KV pool after each step
  (`Speculation.rewinds`).

SAVE_HIDDEN_STATES drafts nothing: its Speculation only names the layers to save.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from specjax.core.suffix import SuffixSpec
from specjax.core.tree import TreeShape
from specjax.core.worker import DraftWorker, tree_of
from specjax.models import Llama, read_mask_token
from specjax.models.config import ModelConfig
from specjax.models.linear import packed_for_cpu
from specjax.models.registry import resolve_model_path
from specjax.speculative.config import (AutoConfig, NGramConfig, PARDConfig, SAConfig,
                                        SaveHiddenStatesConfig, SpeculativeConfig,
                                        UserProvidedConfig)
from specjax.speculative.drafters import Drafter, NGramDrafter
from specjax.speculative.schedule import SpeculationGate, get_draft_len_for_batch_size
from specjax.speculative.workers import DRAFTERS, WORKERS


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Everything the engine needs to know about speculation, decided once."""

    config: SpeculativeConfig | None = None
    worker: DraftWorker | None = None      # drafts inside the jitted step
    draft_model: Any = None                # the worker's module, in the layout the steps run
    drafter: Drafter | None = None         # proposes on the host
    save_hidden_states: SaveHiddenStatesConfig | None = None
    save_layers: tuple[int, ...] = ()      # target layers whose residual streams are saved
    suffix: SuffixSpec | None = None       # SA drafting in the step (alone, or the enhancer)

    @property
    def drafting(self) -> bool:
        return self.worker is not None or self.drafter is not None or self.suffix is not None

    @property
    def max_draft_len(self) -> int:
        """The longest draft a step verifies (0: plain decoding); a tree's depth."""
        return self.config.max_draft_len if self.drafting else 0

    @property
    def tree(self) -> TreeShape | None:
        """The draft tree's shape, None for chains."""
        return tree_of(self.worker)

    def verify_len(self, draft_len: int) -> int:
        """Draft tokens a step of this draft length verifies after the newest one: the draft
        length for a chain, the node count for a tree (`TreeShape.nodes_for`)."""
        return draft_len if self.tree is None else self.tree.nodes_for(draft_len)

    @property
    def drafts_in_step(self) -> bool:
        """An in-step drafter writes its K/V up to D positions past the verified window
        (TensorRT-LLM's extra KV tokens of one-engine modes); SA alone writes none."""
        return self.worker is not None

    @property
    def overlap(self) -> bool:
        """Steps with drafts may be dispatched before the previous step is read."""
        return self.drafting and self.config.mode.support_overlap_scheduler()

    @property
    def rewinds(self) -> bool:
        """Rejected draft positions are given back to the KV pool after each step."""
        return self.drafting and self.config.mode.needs_kv_cache_rewind()

    def draft_len_for(self, batch_size: int) -> int:
        """The runtime draft length for a generation batch of this size (0 = plain decoding),
        from the config's per-batch-size schedule."""
        if not self.drafting:
            return 0
        return get_draft_len_for_batch_size(self.config.schedule, batch_size, self.max_draft_len)

    def make_gate(self) -> SpeculationGate | None:
        """The acceptance gate, when the config asks for one."""
        if not self.drafting or self.config.acceptance_rate_window_size <= 0:
            return None
        return SpeculationGate(self.config.acceptance_rate_window_size,
                               self.config.acceptance_rate_threshold)


def build_speculation(config: SpeculativeConfig | None, target: Llama,
                      max_sequence_length: int | None = None,
                      scan_layers: bool = True, packed: bool = False) -> Speculation:
    """Load the drafter module (a folder path in the config is read from disk, in the target's
    dtype) in the layout the steps run (its target-style layers scanned or unrolled as the
    target's: `scan_layers`), make the worker or host drafter, and check them against
    `target`; every error is a ValueError naming the field, raised before any request starts.
    `max_sequence_length`: the context limit host drafters propose within. `packed`: the
    drafter's projections packed for the CPU matmul kernel, as the target's
    (`specjax.models.linear.packed_for_cpu`), before its worker takes its graph definition."""
    if config is None:
        return Speculation()
    if not isinstance(config, SpeculativeConfig):
        raise ValueError(f"speculative_config must be a SpeculativeConfig (e.g. "
                         f"specjax.NGramConfig), got {type(config).__name__}")
    if isinstance(config, AutoConfig):
        raise ValueError("AutoConfig is resolved by LLM, with the model's name "
                         "(specjax.speculative.defaults.resolve_auto), not built directly")
    if isinstance(config, SaveHiddenStatesConfig):
        return Speculation(config, save_hidden_states=config,
                           save_layers=config.layers_to_capture(target.config.num_layers))
    draft_model = None
    if config.mode.has_draft_module():
        config = with_drafter_fields(config)
        draft_model = load_draft_model(config, target)
        if draft_model is not None:  # the layout the steps run, made once
            draft_model = DRAFTERS[config.mode].for_inference(draft_model, scan_layers)
            if packed:
                draft_model = packed_for_cpu(draft_model)
    worker = get_spec_worker(config, draft_model, target.config)
    if target.config.is_hybrid:
        check_hybrid_target(config, worker, draft_model)
    return Speculation(config, worker=worker, draft_model=draft_model,
                       drafter=get_spec_drafter(config, max_sequence_length),
                       suffix=suffix_spec(config))


def check_hybrid_target(config: SpeculativeConfig, worker, draft_model) -> None:
    """What a target with recurrent layers cannot verify: a draft tree (its nodes would need a
    recurrent state per path, not per depth); and a drafter with recurrent layers of its own
    (the in-step workers roll back K/V only)."""
    if tree_of(worker) is not None:
        raise ValueError(f"{type(config).__name__}: draft trees cannot be verified on a hybrid "
                         "(recurrent-layer) target; use a chain (no dynamic_tree / tree)")
    if getattr(getattr(draft_model, "config", None), "is_hybrid", False):
        raise ValueError(f"{type(config).__name__}: the draft model has recurrent (Mamba) "
                         "layers; an in-step drafter must be attention-only")


def suffix_spec(config: SpeculativeConfig) -> SuffixSpec | None:
    """SA's static configuration: SAConfig's, or the enhancer's (`sa_config`); None without."""
    if isinstance(config, SAConfig):
        return SuffixSpec(ngram=config.max_matching_ngram_size,
                          pool_size=config.global_pool_size or 0,
                          global_pool=config.enable_global_pool)
    enhancer = getattr(config, "sa_config", None)
    return None if enhancer is None else SuffixSpec(threshold=enhancer.threshold)


def with_drafter_fields(config: SpeculativeConfig) -> SpeculativeConfig:
    """The config with what its drafter folder records filled in: PARD's mask token."""
    if isinstance(config, PARDConfig) and config.mask_token_id is None:
        if not isinstance(config.speculative_model, str):
            raise ValueError("PARDConfig needs mask_token_id with a Llama instance (a PARD "
                             "folder names it in config.json as pard_token)")
        mask = read_mask_token(resolve_model_path(config.speculative_model))
        if mask is None:
            raise ValueError(f"PARDConfig: {config.speculative_model}/config.json names no mask "
                             "token (pard_token or mask_token_id): pass mask_token_id")
        config = dataclasses.replace(config, mask_token_id=mask)
    return config


def load_draft_model(config: SpeculativeConfig, target: Llama, dtype: str | None = None):
    """The drafter module a mode runs beside the target, as its folder holds it (the loader its
    worker module registered): a `Llama` for draft-target and PARD, an `Eagle3Head` for
    EAGLE-3, `MTPHeads` for MTP, a `DFlashHead` (`DSparkHead`) for DFlash (DSpark); None for
    modes without one. A folder path is loaded; an instance is checked against the target the
    same way."""
    drafter = DRAFTERS.get(config.mode)
    return None if drafter is None else drafter.load(config, target, dtype or target.config.dtype)


def get_spec_worker(config: SpeculativeConfig | None, draft_model=None,
                    target_config: ModelConfig | None = None) -> DraftWorker | None:
    """The in-step worker for `has_draft_module()` modes, else None. `draft_model`: the drafter
    module in the layout the steps run (`build_speculation` makes it); hidden-state drafters
    also need the target's config."""
    if config is None or not config.mode.has_draft_module():
        return None
    mode = config.mode
    if draft_model is None:
        raise ValueError(f"{mode.name} needs its drafter module (see load_draft_model)")
    if target_config is None:
        raise ValueError(f"{mode.name} needs the target's config")
    factory = WORKERS.get(mode)
    if factory is None:
        raise NotImplementedError(f"speculative mode {mode.name} is not implemented yet")
    return factory(config, nnx.graphdef(draft_model), draft_model, target_config)


def get_spec_drafter(config: SpeculativeConfig | None,
                     max_sequence_length: int | None = None) -> Drafter | None:
    """The host-side Drafter for `has_spec_drafter()` modes, else None."""
    if config is None or not config.mode.has_spec_drafter():
        return None
    if isinstance(config, NGramConfig):
        return NGramDrafter(config.max_draft_len, config.max_matching_ngram_size,
                            config.is_keep_all, config.is_use_oldest, config.is_public_pool,
                            max_sequence_length, config.min_matching_ngram_size,
                            config.min_followed_ratio)
    if isinstance(config, UserProvidedConfig):
        return config._instance
    raise NotImplementedError(f"no drafter for mode {config.mode.name}")
