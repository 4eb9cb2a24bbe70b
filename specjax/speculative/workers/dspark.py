"""DSpark (mode 14): DFlash's block pass, then a Markov head drafts the block token by token
and a confidence head says how far to trust it (`specjax.models.dspark_head`).

Per step: the accepted rows' context K/V and one bidirectional pass over [newest, mask x K],
exactly as DFlash (`DFlashWorker`); then, for k = 1..K in a `lax.scan`, draft k is drawn from
base_k + markov(x_{k-1}) (x_0 the newest token), adjusted and filtered as verification will
be, and its confidence c_k from [its row; the Markov embedding of x_{k-1}] and the drafter's
certainty (its largest log-probability).

Exactness. Draft k's distribution depends on the drafts before it, so the one handed to
rejection sampling is the one it was drawn from, given that prefix; that is what the chain's
acceptance needs (it judges draft k only when drafts 1..k-1 were accepted, i.e. equal to the
target's emitted prefix), so the output follows the target whatever the Markov head does.

The block is drafted at full width (`max_draft_len`) at every step that drafts at all, whatever
the step verifies: the pass costs the same, and the next step may verify more than this one. How
many drafts a step verifies is the engine's cost model's choice, from survival S_j = c_1 ... c_j
of each row's newest confidences (`AcceptanceModel.confide`) instead of online estimates. A
plain step (the choice n = 0) skips the block, as DFlash's does: where plain decoding pays best
(large batches on a CPU) a block per step would cost more than the confidences can save. The
rows then keep their last confidences until the engine's exploration drafts again.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.batch import StepBatch
from specjax.core.kv import KVPool
from specjax.core.sampling import draft_tokens_and_probs
from specjax.core.worker import Drafts
from specjax.models.dspark_head import GREEDY, SAMPLED, DSparkHead
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.workers.parallel import DFlashWorker, dflash_worker, load_dflash_drafter
from specjax.speculative.workers.registry import register


def markov_drafts(head: DSparkHead, base: jax.Array, normed: jax.Array, newest: jax.Array,
                  batch: StepBatch, first: jax.Array, with_probs: bool, penalties=None
                  ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """base logits `[B, K, V]`, final-normed block rows `[B, K, H]`, newest tokens `[B]` ->
    (drafts `[B, K]`, their distributions `[B, K, V]` given the drafted prefix (or None),
    confidences `[B, K]`). Draft k lands at position first + k and is drawn with its key."""
    B, K = base.shape[:2]
    rule = jnp.where(batch.temperature > 0, SAMPLED, GREEDY)

    def one(carry, k):
        previous, before = carry
        e, markov = head.markov(previous)
        logits = base[:, k] + markov
        draft, probs = draft_tokens_and_probs(logits, batch, first + k, with_probs, penalties,
                                              before, num_before=k)
        z = head.confidence_logit(normed[:, k], e)
        c = head.calibrated(z, head.certainty(logits), k, rule)
        return (draft, before.at[:, k].set(draft)), (probs, c)

    (_, drafts), (probs, conf) = jax.lax.scan(
        one, (newest.astype(jnp.int32), jnp.zeros((B, K), jnp.int32)), jnp.arange(K))
    return (drafts, probs.transpose(1, 0, 2) if with_probs else None, conf.T)


@dataclasses.dataclass(frozen=True)
class DSparkWorker(DFlashWorker):
    """Implements `specjax.core.DraftWorker` for DSpark (mode 14)."""

    depth: int = 1                         # the block drafted at every step (max_draft_len)

    def block_width(self, num_drafts: int) -> int:
        return self.depth if num_drafts else 0

    def _block(self, head, kv: KVPool, batch: StepBatch, target, newest: jax.Array,
               p: jax.Array, live: jax.Array, K: int, penalties) -> Drafts:
        rows = self._block_rows(head, kv, batch, target, newest, p, live, K)
        drafts, probs, conf = markov_drafts(head, head.logits(target, rows), head.normed(rows),
                                            newest, batch, p + 1, self.rejection_sampling,
                                            penalties)
        return Drafts.every(drafts, probs=probs, confidence=conf)


@register(SpeculativeDecodingMode.DSPARK, load_dflash_drafter, layered=True)
def dspark_worker(config, graphdef, draft_model, target_config) -> DSparkWorker:
    if not isinstance(draft_model, DSparkHead):
        raise ValueError("DSpark needs a DSpark drafter (a DSparkHead or a folder whose "
                         "config.json names SpecjaxDSparkDrafter); this one is a DFlash "
                         "drafter: use mode 'dflash' for it")
    base = dflash_worker(config, graphdef, draft_model, target_config)
    return DSparkWorker(base.graphdef, base.capture_layers, base.head_config,
                        base.mask_token_id, base.rejection_sampling,
                        depth=config.max_draft_len)
