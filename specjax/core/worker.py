"""What an in-step drafter must provide to ride inside the jitted steps.

A worker is static configuration (a frozen, hashable dataclass: the steps close over it and are
cached by it); its parameters travel as traced arguments (`Params.draft`) and its K/V in its own
pool (`EngineState.draft`), which shares the target's block tables. The implementations live in
`specjax.speculative.workers`; the steps in `specjax.core.steps` only call this interface.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax

from specjax.core.batch import StepBatch
from specjax.core.kv import KVPool
from specjax.core.penalties import PenaltyState
from specjax.core.tree import TreeShape


def tree_of(worker: "DraftWorker | None") -> TreeShape | None:
    """The worker's draft-tree shape; None for chains, host drafters and plain decoding."""
    return getattr(worker, "tree", None)


class DraftWorker(Protocol):
    # Target layers whose residual streams (after the layer) the worker reads: `captured`
    # `[C, B, T, H]` below, in this order.
    capture_layers: tuple[int, ...]
    # Sampled rows draw their drafts from the worker's filtered distribution and hand it back,
    # so the next step can accept by rejection sampling; otherwise every row drafts the argmax.
    rejection_sampling: bool
    # A tree drafter's shape (`specjax.core.tree.TreeShape`), or None for chains (the default
    # when a worker has no such attribute). A tree worker's `catch_up` and `draft` take the
    # tree's depth as `num_drafts` and return (kv, node tokens `[B, T]`, their parents
    # `[B, T]`) with T = `tree.nodes_for(depth)`, in place of drafts and distributions.
    tree: TreeShape | None

    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype) -> KVPool:
        """The worker's zeroed pool, block for block beside the target's."""

    def catch_up(self, params: Any, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
                 following: jax.Array, num_drafts: int, penalties: PenaltyState | None = None
                 ) -> tuple[KVPool, jax.Array | None, jax.Array | None]:
        """Prompt chunks: write the worker's K/V for the rows the target just processed.
        `following` `[B]`: the token after each run (the next prompt token or the one just
        sampled). May draft `num_drafts` tokens after a prompt's last chunk, for the first
        generation step to verify -> (kv, drafts `[B, num_drafts]` or None, their
        distributions `[B, num_drafts, V]` or None: given when the worker does rejection
        sampling, which needs them)."""

    def draft(self, params: Any, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int,
              penalties: PenaltyState | None = None
              ) -> tuple[KVPool, jax.Array, jax.Array | None]:
        """After acceptance (new_tokens `[B, D+1]`, new_lens `[B]` = accepted + 1): catch up
        over the accepted rows, then draft `num_drafts` tokens after each row's newest one ->
        (kv, drafts `[B, num_drafts]`, their distributions `[B, num_drafts, V]` or None).

        Drafting adjusts its logits as verification will (`specjax.core.sampling.draft_logits`:
        the rows' logit bias, and `penalties` -- the slots' counts, the newest token included --
        plus the drafts before each one), or a drafter that agrees with the target would
        disagree with its penalised choice. Tree workers may leave penalties out (the target
        still applies them: output stays exact; only acceptance pays)."""
