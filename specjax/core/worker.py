"""What an in-step drafter must provide to ride inside the jitted steps.

A worker is static configuration (a frozen, hashable dataclass: the steps close over it and are
cached by it); its parameters travel as traced arguments (`Params.draft`) and its K/V in its own
pool (`EngineState.draft`), which shares the target's block tables. The implementations live in
`specjax.speculative.workers`; the steps in `specjax.core.steps` only call this interface, and
the engine reads nothing of a worker that is not declared here.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from specjax.core.batch import StepBatch
from specjax.core.kv import KVPool
from specjax.core.penalties import PenaltyState
from specjax.core.tree import TreeShape


@struct.dataclass
class Drafts:
    """What a worker proposes for each row: the next step verifies `tokens[b, :num[b]]`."""

    tokens: jax.Array                 # [B, D] int32 (a tree: its T nodes, parents first)
    num: jax.Array                    # [B] int32: drafts to verify, 0..D (a row may verify
                                      # fewer than the compiled width)
    probs: jax.Array | None = None    # [B, D, V] float32: the distributions the drafts were
                                      # drawn from (rejection sampling), or None
    parents: jax.Array | None = None  # [B, T] int32: a tree's node parents (0 = the newest
                                      # token, `specjax.core.tree`), None for chains
    # [B, D] float32: the drafter's predicted probability that draft k is accepted given
    # that drafts 1..k-1 were (DSpark's confidence head), or None; read by the host's cost
    # model (`GenerationOutput.draft_confidence`).
    confidence: jax.Array | None = None

    @classmethod
    def every(cls, tokens: jax.Array, probs: jax.Array | None = None,
              parents: jax.Array | None = None, confidence: jax.Array | None = None
              ) -> "Drafts":
        """Every row verifies all of `tokens` `[B, D]`."""
        num = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
        return cls(tokens=tokens.astype(jnp.int32), num=num, probs=probs, parents=parents,
                   confidence=confidence)


def tree_of(worker: "DraftWorker | None") -> TreeShape | None:
    """The worker's draft-tree shape; None for chains, host drafters and plain decoding."""
    return None if worker is None else worker.tree


class WorkerDefaults:
    """The Protocol's defaults, for workers to inherit: a chain drafter whose pool rows depend
    only on the tokens up to them and that rewrites every row it reads."""

    tree: TreeShape | None = None
    pool_lookahead: int = 0
    rewrites_committed: bool = True


class DraftWorker(Protocol):
    # Target layers whose residual streams (after the layer) the worker reads: `captured`
    # `[C, B, T, H]` below, in this order.
    capture_layers: tuple[int, ...]
    # Sampled rows draw their drafts from the worker's filtered distribution and hand it back
    # (`Drafts.probs`), so the next step can accept by rejection sampling; otherwise every row
    # drafts the argmax.
    rejection_sampling: bool
    # A tree drafter's shape (`specjax.core.tree.TreeShape`), or None for chains. A tree
    # worker's `catch_up` and `draft` take the tree's depth as `num_drafts` and return its
    # T = `tree.nodes_for(depth)` nodes with their `parents`.
    tree: TreeShape | None
    # How many tokens after a position its pool row depends on (the prefix cache keys a block
    # by them: `specjax.engine.prefix_cache`).
    pool_lookahead: int
    # Whether the worker rewrites every pool row it reads once its tokens are committed; if
    # not, only a prompt's prefill writes blocks another request may share.
    rewrites_committed: bool

    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype) -> KVPool:
        """The worker's zeroed pool, block for block beside the target's."""

    def catch_up(self, params: Any, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
                 following: jax.Array, num_drafts: int, penalties: PenaltyState | None = None
                 ) -> tuple[KVPool, Drafts | None]:
        """Prompt chunks: write the worker's K/V for the rows the target just processed.
        `following` `[B]`: the token after each run (the next prompt token or the one just
        sampled). May draft `num_drafts` tokens after a prompt's last chunk, for the first
        generation step to verify -> (kv, `Drafts` or None)."""

    def draft(self, params: Any, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int,
              penalties: PenaltyState | None = None) -> tuple[KVPool, Drafts]:
        """After acceptance (new_tokens `[B, D+1]`, new_lens `[B]` = accepted + 1): catch up
        over the accepted rows, then draft `num_drafts` tokens after each row's newest one ->
        (kv, `Drafts` of width `num_drafts`).

        Drafting adjusts its logits as verification will (`specjax.core.sampling.draft_logits`:
        the rows' logit bias, and `penalties` -- the slots' counts, the newest token included --
        plus the drafts before each one), or a drafter that agrees with the target would
        disagree with its penalised choice. Tree workers may leave penalties out (the target
        still applies them: output stays exact; only acceptance pays)."""
