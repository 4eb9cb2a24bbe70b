"""The head's loss: sum over chain steps j of step_weight^(j-1) x the mean soft cross-entropy of
step j against the target's next-token distribution. For an EAGLE-3 head with a reduced draft
vocabulary the target's logits are gathered at the draft ids and renormalised (as the public
EAGLE-3 recipe does).

DSpark (`dspark_loss`) trains on DeepSpec's objective instead: per draft k, weight
exp(-(k-1)/4) x [0.1 cross-entropy + 0.9 L1(p_draft, p_target) + BCE(sigmoid(z_k), 1 - TV)],
TV = half the L1 (the stop-gradient label of the confidence head). The cross-entropy's label is
the target's own greedy token: DeepSpec's CE is on target-generated tokens, and this is the token
greedy verification accepts (with the target's soft distribution as the label instead, the
shipped drafter's E[AL] was 2.451 rather than 2.625). Its `kl` metric is KL(p_target || p_draft)
and `step_loss` that cross-entropy."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.models import Llama
from specjax.train.heads.chain import run_chain, shift_rows, teacher_forced_step_tokens
from specjax.train.heads.parallel import dspark_outputs
from specjax.train.heads.spec import HeadSpec


def target_outputs(spec: HeadSpec, target: Llama, tokens: jax.Array,
                   captured: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """-> (target logits `[B, T+1, V]`, captured `[len(needed_layers), B, T+1, H]`), computed by
    the target's forward, or from saved hidden states (labels: logits of layer L-1's stream)."""
    if captured is None:
        logits, captured = target.forward(tokens, capture_layers=spec.needed_layers)
    else:
        logits = target.logits(captured[-1])
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(captured)


def head_loss(spec: HeadSpec, head, target: Llama, tokens: jax.Array, valid: jax.Array,
              target_logits: jax.Array, captured: jax.Array) -> tuple[jax.Array, dict]:
    """The head's training objective on one batch, its kind's (`HeadKind.loss`: `soft_loss`,
    or DSpark's `dspark_loss`). tokens, valid `[B, T+1]`; target_logits `[B, T+1, V]`. ->
    (loss, per-step metrics)."""
    return spec.head_kind.loss(spec, head, target, tokens, valid, target_logits, captured)


def soft_loss(spec: HeadSpec, head, target: Llama, tokens: jax.Array, valid: jax.Array,
              target_logits: jax.Array, captured: jax.Array) -> tuple[jax.Array, dict]:
    """The TTT / dense-chain / parallel soft cross-entropy on one batch (see the package and
    module docstrings)."""
    K, T = spec.depth, tokens.shape[1] - 1
    kind = spec.head_kind
    if spec.parallel:
        step_logits = kind.block_logits(spec, head, target, captured, tokens)
    else:
        step_logits = run_chain(spec, head, target, captured,
                                teacher_forced_step_tokens(tokens, K))
    label_logits = kind.label_logits(spec, head, target_logits)
    target_choice = jnp.argmax(target_logits, axis=-1)
    loss, kl, step_losses, step_acc = 0.0, 0.0, [], []
    for j, logits in enumerate(step_logits):
        mask = shift_rows(valid, j + 1, T, fill=False).astype(jnp.float32)
        count = jnp.maximum(mask.sum(), 1.0)
        label_logp = jax.nn.log_softmax(shift_rows(label_logits, j + 1, T), axis=-1)
        probs = jnp.exp(label_logp)
        ce = -(probs * jax.nn.log_softmax(logits, axis=-1)).sum(-1)
        entropy = -(probs * label_logp).sum(-1)
        step_loss = (ce * mask).sum() / count
        kl = kl + spec.step_weight ** j * (step_loss - (entropy * mask).sum() / count)
        agree = kind.to_target_ids(head, jnp.argmax(logits, -1)) == \
            shift_rows(target_choice, j + 1, T)
        step_losses.append(step_loss)
        step_acc.append((agree * mask).sum() / count)
        loss = loss + spec.step_weight ** j * step_loss
    # kl: the loss less the labels' own entropy (0 for a head that matches the target).
    return loss, {"step_loss": jnp.stack(step_losses), "step_acc": jnp.stack(step_acc),
                  "kl": kl}


DSPARK_GAMMA = 4.0
DSPARK_WEIGHTS = {"ce": 0.1, "l1": 0.9, "bce": 1.0}


def dspark_loss(spec: HeadSpec, head, target: Llama, tokens: jax.Array, valid: jax.Array,
                target_logits: jax.Array, captured: jax.Array) -> tuple[jax.Array, dict]:
    """DeepSpec's DSpark loss (module docstring), mean over the valid anchors of each draft;
    the metrics are `head_loss`'s (step_loss: the soft cross-entropy) plus per-draft TV and
    confidence BCE."""
    K, T = spec.depth, tokens.shape[1] - 1
    step_logits, step_z = dspark_outputs(head, target, captured, tokens, K)
    target_choice = jnp.argmax(target_logits, axis=-1)
    loss, kl, step_losses, step_acc, step_tv, step_bce = 0.0, 0.0, [], [], [], []
    for j, (logits, z) in enumerate(zip(step_logits, step_z)):
        w = math.exp(-j / DSPARK_GAMMA)
        mask = shift_rows(valid, j + 1, T, fill=False).astype(jnp.float32)
        count = jnp.maximum(mask.sum(), 1.0)
        mean = lambda x: (x * mask).sum() / count
        label_logp = jax.nn.log_softmax(shift_rows(target_logits, j + 1, T), axis=-1)
        q = jnp.exp(label_logp)
        logp = jax.nn.log_softmax(logits, axis=-1)
        greedy = shift_rows(target_choice, j + 1, T)
        ce = -jnp.take_along_axis(logp, greedy[..., None], axis=-1)[..., 0]
        l1 = jnp.abs(jnp.exp(logp) - q).sum(-1)
        accept = jax.lax.stop_gradient(1.0 - 0.5 * l1)
        bce = jax.nn.softplus(z) - accept * z          # BCE(sigmoid(z), accept) from the logit
        step_loss = mean(ce)
        kl = kl + w * mean((q * (label_logp - logp)).sum(-1))
        loss = loss + w * (DSPARK_WEIGHTS["ce"] * step_loss + DSPARK_WEIGHTS["l1"] * mean(l1)
                           + DSPARK_WEIGHTS["bce"] * mean(bce))
        step_losses.append(step_loss)
        step_acc.append(mean(jnp.argmax(logits, -1) == shift_rows(target_choice, j + 1, T)))
        step_tv.append(mean(0.5 * l1))
        step_bce.append(mean(bce))
    return loss, {"step_loss": jnp.stack(step_losses), "step_acc": jnp.stack(step_acc),
                  "kl": kl, "step_tv": jnp.stack(step_tv), "step_bce": jnp.stack(step_bce)}
