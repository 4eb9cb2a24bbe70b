"""What a head training run trains: `HeadSpec`, the EAGLE-3 draft vocabulary maps and a freshly
initialised head (and its split into trained and fixed variables)."""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import Llama
from specjax.models.dflash_head import DFlashHead, DFlashHeadConfig
from specjax.models.dspark_head import DSparkHead, DSparkHeadConfig
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.models.mtp_head import MTPHeads, target_lm_head


@dataclass(frozen=True)
class HeadSpec:
    """A head training run's shape (frozen, hashable: a jit static argument).

    kind "eagle3": `capture_layers` are the three fused target layers and `draft_vocab` the
    head's output width. kind "mtp": `num_modules` MTP modules; one module is MTP-Eagle (the
    chain), more is vanilla MTP (the dense chain). The parallel drafters: kind "pard" (a
    small causal LM, `drafter_layers` layers shaped like the target's), kind "dflash"
    (`drafter_layers` layers reading the target at `capture_layers`), kind "dspark" (a DFlash
    drafter plus a rank-`markov_rank` Markov head and a confidence head); `depth` is the block
    they propose in one pass."""

    kind: str
    depth: int
    num_layers: int                         # the target's
    capture_layers: tuple[int, ...] = ()
    draft_vocab: int = 0
    num_modules: int = 0
    step_weight: float = 0.8
    drafter_layers: int = 0
    markov_rank: int = 64                   # DSpark's Markov head

    def __post_init__(self):
        if self.kind not in ("eagle3", "mtp", "pard", "dflash", "dspark"):
            raise ValueError(f"unknown head kind {self.kind!r}")
        if self.depth < 1:
            raise ValueError(f"--depth must be >= 1, got {self.depth}")
        if self.parallel:
            if not 1 <= self.drafter_layers:
                raise ValueError(f"--drafter-layers must be >= 1, got {self.drafter_layers}")
            if self.kind == "pard" and self.drafter_layers > self.num_layers:
                raise ValueError(f"--drafter-layers {self.drafter_layers} exceeds the target's "
                                 f"{self.num_layers} layers (PARD starts from the first ones)")
            bad = [x for x in self.capture_layers if not 0 <= x < self.num_layers]
            if bad or list(self.capture_layers) != sorted(set(self.capture_layers)):
                raise ValueError(f"--layers {list(self.capture_layers)}: distinct ascending "
                                 f"layers of the target's {self.num_layers} (0..{self.num_layers - 1})")
            if self.kind in ("dflash", "dspark") and not self.capture_layers:
                raise ValueError(f"{self.label} needs at least one target layer (--layers)")
            if self.kind == "dspark" and self.markov_rank < 1:
                raise ValueError(f"--markov-rank must be >= 1, got {self.markov_rank}")
        elif self.kind == "eagle3":
            layers = self.capture_layers
            if len(layers) != 3 or len(set(layers)) != 3 or list(layers) != sorted(layers):
                raise ValueError(f"--layers must be 3 distinct ascending layers, got {list(layers)}")
            bad = [x for x in layers if not 0 <= x < self.num_layers]
            if bad:
                raise ValueError(f"--layers {list(layers)}: {bad} outside the target's "
                                 f"{self.num_layers} layers (0..{self.num_layers - 1})")
        else:
            if self.num_modules < 1:
                raise ValueError(f"--num-modules must be >= 1, got {self.num_modules}")
            if self.num_modules > 1 and self.depth > self.num_modules:
                raise ValueError(f"--depth {self.depth} exceeds --num-modules {self.num_modules}: "
                                 "vanilla MTP drafts one token per module")

    @property
    def parallel(self) -> bool:
        """All `depth` drafts from one pass (PARD, DFlash, DSpark: its Markov head adds a
        per-draft term after the pass)."""
        return self.kind in ("pard", "dflash", "dspark")

    @property
    def chain(self) -> bool:
        """True for the training-time-test chain (EAGLE-3, MTP-Eagle); False for the dense
        vanilla-MTP chain."""
        return self.kind == "eagle3" or (self.kind == "mtp" and self.num_modules == 1)

    @property
    def needed_layers(self) -> tuple[int, ...]:
        """Target layers whose residual streams a batch needs: the head's inputs, then L - 1."""
        return (*self.capture_layers, self.num_layers - 1)

    @property
    def label(self) -> str:
        if self.kind in ("pard", "dflash", "dspark"):
            return {"pard": "PARD", "dflash": "DFlash", "dspark": "DSpark"}[self.kind]
        if self.kind == "eagle3":
            return "EAGLE-3"
        return "MTP-Eagle" if self.num_modules == 1 else f"MTP ({self.num_modules} modules)"


def draft_vocab_maps(counts: np.ndarray, draft_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The `draft_vocab` most frequent target ids (ties: lower id first), in ascending id order,
    as the public EAGLE-3 maps: (d2t `[draft_vocab]` int32 with target = draft + d2t[draft],
    t2d `[V]` bool)."""
    V = len(counts)
    if not 0 < draft_vocab <= V:
        raise ValueError(f"--draft-vocab must be in [1, {V}], got {draft_vocab}")
    ids = np.sort(np.argsort(-np.asarray(counts, np.int64), kind="stable")[:draft_vocab])
    d2t = (ids - np.arange(draft_vocab)).astype(np.int32)
    t2d = np.zeros((V,), bool)
    t2d[ids] = True
    return d2t, t2d


def new_head(spec: HeadSpec, target: Llama, seed: int, counts: np.ndarray | None = None):
    """A freshly initialised head for `target`, warm-started where the target offers a prior:
    the input projection starts as (random init +) the identity on the deepest hidden state
    (EAGLE-3: fc passes the highest captured layer through; MTP: eh_proj passes hnorm(hidden)
    through), so the head's residual stream starts as the target's; the output side is the
    target's (EAGLE-3: lm_head = the target's LM head at the draft ids; the final norms = the
    target's final norm). Everything else is the heads' own random init."""
    rngs = nnx.Rngs(seed)
    H = target.config.hidden_size
    eye = jnp.eye(H, dtype=jnp.dtype(target.config.dtype))
    final_norm = jnp.array(target.final_norm[...], copy=True)  # never share a buffer (donation)
    if spec.parallel:
        return _new_parallel(spec, target, rngs, eye, final_norm)
    if spec.kind == "mtp":
        heads = MTPHeads(target.config, spec.num_modules, rngs=rngs)
        for module in heads.modules:
            module.final_norm[...] = jnp.array(final_norm, copy=True)
            module.eh_proj[...] = module.eh_proj[...].at[H:].add(eye)
        return heads
    config = Eagle3HeadConfig.for_target(target.config, draft_vocab_size=spec.draft_vocab,
                                         aux_hidden_state_layers=spec.capture_layers)
    head = Eagle3Head(config, rngs=rngs)
    head.fc[...] = head.fc[...].at[2 * H:].add(eye)
    if spec.draft_vocab < target.config.vocab_size:
        if counts is None:
            raise ValueError("a reduced draft vocabulary needs the training token counts")
        d2t, t2d = draft_vocab_maps(counts, spec.draft_vocab)
        head.d2t[...] = jnp.asarray(d2t)
        head.t2d[...] = jnp.asarray(t2d)
    ids = head.to_target_ids(jnp.arange(spec.draft_vocab))
    head.lm_head[...] = jnp.take(target_lm_head(target), ids, axis=1).astype(head.lm_head.dtype)
    head.norm[...] = final_norm
    return head


def _new_parallel(spec: HeadSpec, target: Llama, rngs: nnx.Rngs, eye, final_norm):
    """PARD: the target's embeddings (plus a mask row, the mean embedding), its first
    `drafter_layers` layers and final norm. DFlash: the target's first `drafter_layers` layers
    and final norm; fc passes the first captured layer through. DSpark: DFlash's body, initialised
    the same way (same draws), plus its own heads as `DSparkHead` makes them (Markov out and
    confidence zero: a fresh head drafts as its DFlash body; calibration the identity)."""
    cfg, n = target.config, spec.drafter_layers
    copy = lambda x: jnp.array(x, copy=True)
    if spec.kind == "pard":
        draft = Llama(cfg.replace(vocab_size=cfg.vocab_size + 1, num_layers=n,
                                  sliding_windows=None), rngs=rngs)
        embed = target.embed[...]
        draft.embed[...] = jnp.concatenate([embed, embed.mean(0, keepdims=True)]).astype(
            draft.embed.dtype)
        if not cfg.tie_word_embeddings:
            lm = target.lm_head[...]
            draft.lm_head[...] = jnp.concatenate([lm, jnp.zeros_like(lm[:, :1])], axis=1)
        layers = draft.layers
    else:
        config = DFlashHeadConfig.for_target(cfg, n, spec.capture_layers, spec.depth)
        if spec.kind == "dspark":
            draft = DSparkHead(DSparkHeadConfig.of(config, spec.markov_rank), rngs=rngs)
        else:
            draft = DFlashHead(config, rngs=rngs)
        H = cfg.hidden_size
        draft.fc[...] = draft.fc[...].at[:H].add(eye)
        draft.body.embed[...] = target.embed[...].mean(0, keepdims=True)
        layers = draft.body.layers
    for name, param in target.layers.items():
        layers[name][...] = copy(param[...][:n])
    (draft.final_norm if spec.kind == "pard" else draft.body.final_norm)[...] = final_norm
    return draft


def split_head(head):
    """-> (graphdef, trainable params, rest: non-trainable variables such as d2t/t2d)."""
    return nnx.split(head, nnx.Param, ...)
