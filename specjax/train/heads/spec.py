"""What a head training run trains: `HeadSpec` and its kind (`HeadKind`), the EAGLE-3 draft
vocabulary maps and a freshly initialised head (and its split into trained and fixed
variables)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import Llama


class HeadKind:
    """What one kind of head is and does: one subclass per kind (`specjax.train.heads.kinds`),
    registered in `KINDS` under `name` -- the CLI's subcommand and the "kind" training logs
    record. A `HeadSpec` looks its kind up once; whatever differs between kinds asks it."""

    name: ClassVar[str]
    parallel: ClassVar[bool] = False   # all drafts from one pass
    default_depth: ClassVar[int] = 4   # --depth
    save_dtype: ClassVar[str] = "bfloat16"   # --save-dtype

    def validate(self, spec: HeadSpec) -> None:
        """Raise ValueError naming the flag where `spec` is not a head of this kind."""

    def label(self, spec: HeadSpec) -> str:
        raise NotImplementedError

    def chain(self, spec: HeadSpec) -> bool:
        """Whether it drafts the training-time-test chain (EAGLE-3, MTP-Eagle); False for the
        dense vanilla-MTP chain and for parallel drafters."""
        return False

    def new_head(self, spec: HeadSpec, target: Llama, rngs: nnx.Rngs, eye: jnp.ndarray,
                 final_norm: jnp.ndarray, counts: np.ndarray | None):
        """A fresh head of this kind (see `new_head`)."""
        raise NotImplementedError

    def chain_inputs(self, head, target: Llama, captured, depth: int, rows: int):
        """A chain head's draft steps (`chain.run_chain`): (step 1's hidden states `[B, rows,
        H]` from captured `[len(needed_layers), B, >=rows, H]`, each step's module, each step's
        logits function)."""
        raise NotImplementedError

    def block_logits(self, spec: HeadSpec, head, target: Llama, captured, tokens) -> list:
        """A parallel drafter's `depth` drafts at every anchor index (`[B, T, V]` each) of
        tokens `[B, T+1]`."""
        raise NotImplementedError

    def to_target_ids(self, head, draft_ids):
        """The head's output ids as target ids."""
        return draft_ids

    def label_logits(self, spec: HeadSpec, head, target_logits):
        """The target's logits over the head's output vocabulary."""
        return target_logits

    def loss(self, spec: HeadSpec, head, target: Llama, tokens, valid, target_logits,
             captured) -> tuple[Any, dict]:
        """Its training objective on one batch (`loss.head_loss`) -> (loss, metrics)."""
        raise NotImplementedError

    def report(self, spec: HeadSpec, head, target: Llama, batches: list[dict],
               fit: bool = False) -> dict:
        """Its exact greedy acceptance report (`report.acceptance_report`); `fit`: first fit
        what the head calibrates on these windows, in place (DSpark's confidence)."""
        raise NotImplementedError

    def card(self, spec: HeadSpec, target_name: str, out: Path, log: dict) -> ModelCard:
        """What its model card says it is (`export.write_model_card`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ModelCard:
    """A kind's own words on its model card."""

    what: str          # what the head is
    files: str         # its weights' layout
    use: str           # the config that runs it
    labels: str        # what it was trained on
    notes: str = ""    # how to read its acceptance report, where the table says more


# name -> the kind; `specjax.train.heads.kinds` registers every kind as the package loads.
KINDS: dict[str, HeadKind] = {}


@dataclass(frozen=True)
class HeadSpec:
    """A head training run's shape (frozen, hashable: a jit static argument).

    kind "eagle3": `capture_layers` are the three fused target layers and `draft_vocab` the
    head's output width. kind "mtp": `num_modules` MTP modules; one module is MTP-Eagle (the
    chain), more is vanilla MTP (the dense chain). The parallel drafters: kind "pard" (a
    small causal LM, `drafter_layers` layers shaped like the target's), kind "dflash"
    (`drafter_layers` layers reading the target at `capture_layers`), kind "dspark" (a DFlash
    drafter plus a rank-`markov_rank` Markov head and a confidence head); `depth` is the block
    they propose in one pass. `kind` is the name (what the logs record), `head_kind` the
    `HeadKind` it names."""

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
        kind = KINDS.get(self.kind)
        if kind is None:
            raise ValueError(f"unknown head kind {self.kind!r}")
        # Not a field: equality, hashing and the logs see the name alone.
        object.__setattr__(self, "_head_kind", kind)
        if self.depth < 1:
            raise ValueError(f"--depth must be >= 1, got {self.depth}")
        kind.validate(self)

    @property
    def head_kind(self) -> HeadKind:
        return self._head_kind

    @property
    def parallel(self) -> bool:
        """All `depth` drafts from one pass (PARD, DFlash, DSpark: its Markov head adds a
        per-draft term after the pass)."""
        return self.head_kind.parallel

    @property
    def chain(self) -> bool:
        """True for the training-time-test chain (EAGLE-3, MTP-Eagle); False for the dense
        vanilla-MTP chain."""
        return self.head_kind.chain(self)

    @property
    def needed_layers(self) -> tuple[int, ...]:
        """Target layers whose residual streams a batch needs: the head's inputs, then L - 1."""
        return (*self.capture_layers, self.num_layers - 1)

    @property
    def label(self) -> str:
        return self.head_kind.label(self)


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
    H = target.config.hidden_size
    eye = jnp.eye(H, dtype=jnp.dtype(target.config.dtype))
    final_norm = jnp.array(target.final_norm[...], copy=True)  # never share a buffer (donation)
    return spec.head_kind.new_head(spec, target, nnx.Rngs(seed), eye, final_norm, counts)


def split_head(head):
    """-> (graphdef, trainable params, rest: non-trainable variables such as d2t/t2d)."""
    return nnx.split(head, nnx.Param, ...)
