"""Drafts accepted at a set rate: what the system makes of a known acceptance length,
whatever any drafter's training.

`OracleEagle3Worker` runs an EAGLE-3 head exactly as `Eagle3Worker` does (its drafting costs
what a real head of that shape costs: the same passes, pool writes and reads) and then replaces
its drafts with a known greedy continuation, the first `correct` of each step right and the
rest wrong. A greedy request whose reference is its own plain greedy output then accepts
`min(correct, D)` drafts every step: tokens per step `min(correct, D) + 1`, exactly, so long as
the speculative output stays equal to the plain one (which is the engine's promise; a
difference shows as a lower measured AL). `oracle_drafts` swaps it in for the engines built
inside its `with` block (`scripts/gpu_check.py`'s speculative figure at the 8B shape).

The reference is indexed by sequence position (prompt tokens first), so every request in the
batch must have the same prompt (or one whose continuation the reference spells).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import jax.numpy as jnp

from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.workers.chain import Eagle3Worker
from specjax.speculative.workers.registry import WORKERS


@dataclasses.dataclass(frozen=True)
class OracleEagle3Worker(Eagle3Worker):
    """`Eagle3Worker` whose chain drafts are `reference[p]` at each draft's position p for the
    first `correct` drafts of a step and a wrong token after them."""

    reference: tuple[int, ...] = ()
    correct: int = 0

    def draft(self, params, kv, batch, target, captured, new_tokens, new_lens, num_drafts,
              penalties=None):
        kv, drafts = super().draft(params, kv, batch, target, captured, new_tokens, new_lens,
                                   num_drafts, penalties)
        if num_drafts == 0:
            return kv, drafts
        # The head's last row (`ChainWorker.draft`) sits at start + accepted rows - 1: it pairs
        # the target's hidden state there with the token after it (the newest one), so draft k
        # lands k + 2 positions after that row.
        lens = jnp.where(batch.query_lens > 0, new_lens, 0)
        newest = batch.start_pos + jnp.maximum(lens - 1, 0)
        k = jnp.arange(num_drafts)
        reference = jnp.asarray(self.reference, jnp.int32)
        right = reference[jnp.clip(newest[:, None] + 2 + k, 0, len(self.reference) - 1)]
        wrong = (right + 1) % self.head_config.vocab_size
        return kv, drafts.replace(tokens=jnp.where(k < self.correct, right, wrong))


@contextlib.contextmanager
def oracle_drafts(reference: Sequence[int], correct: int) -> Iterator[None]:
    """EAGLE-3 engines built inside the block draft `reference` (prompt + greedy output, by
    position), `correct` drafts right per step. Chains only."""
    if not reference:
        raise ValueError("oracle_drafts needs a non-empty reference sequence")
    mode = SpeculativeDecodingMode.EAGLE3_ONE_MODEL
    original = WORKERS[mode]

    def factory(config, graphdef, draft_model, target_config):
        worker = original(config, graphdef, draft_model, target_config)
        if worker.tree is not None:
            raise ValueError("oracle drafts are chains: leave the config's dynamic tree off")
        fields = {f.name: getattr(worker, f.name) for f in dataclasses.fields(worker)}
        return OracleEagle3Worker(**fields, reference=tuple(int(t) for t in reference),
                                  correct=int(correct))

    WORKERS[mode] = factory
    try:
        yield
    finally:
        WORKERS[mode] = original
