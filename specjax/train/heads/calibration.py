"""DSpark after training: the exact greedy report with sequential drafts, and the per-position
calibration of the confidence head (`DSparkHead.calibration`).

At inference a DSpark block is drafted one token at a time after the one pass: x_0 is the
anchor (the newest token), x_k = argmax(base_k + markov(x_{k-1})), and z_k reads the Markov
embedding of the DRAFTED x_{k-1}. Depth k agrees when x_k equals the target's greedy
continuation g_k (`greedy_chain`). For each position k the fit uses the anchors whose depths
1..k-1 all agreed (the ones that reach k, as the engine's survival S_k = c_1 ... c_k needs):

    GREEDY map  (rule 0): sigmoid(scale * z_k + bias + gain * u_k) against agreement at depth k
    SAMPLED map (rule 1): the same against 1 - TV(softmax(draft_k), softmax(target_k)), the
                          acceptance probability of rejection sampling at temperature 1
                          (target_k: the target's distribution after the greedy prefix)

(u_k: the drafter's certainty, `DSparkHead.certainty`), each by Newton's method on the mean
binary cross-entropy (soft labels for the sampled map).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.dspark_head import GREEDY, SAMPLED, identity_calibration
from specjax.models import Llama
from specjax.train.heads.parallel import dflash_hidden
from specjax.train.heads.report import chain_report, greedy_chain
from specjax.train.heads.spec import HeadSpec, split_head

CHAIN_INPUTS = "the head's own drafts, one at a time through the Markov head (exact acceptance)"


@partial(jax.jit, static_argnums=(0, 1, 2))
def _dspark_batch(spec: HeadSpec, head_def, target_def, params, rest, target_state, tokens, valid):
    """-> (agree, z, certainty u, tv: each `[K, B, T]`; anchor mask `[B, T]`)."""
    target = nnx.merge(target_def, target_state)
    head = nnx.merge(head_def, params, rest)
    K = spec.depth
    logits, captured = target.forward(tokens, capture_layers=spec.needed_layers)
    labels, label_logits = greedy_chain(target, tokens, K, logits, with_logits=True)
    x = dflash_hidden(head, target, captured, tokens, K)
    base, normed = head.logits(target, x), head.normed(x)
    previous = tokens[:, 1:]
    drafts, zs, us, tvs = [], [], [], []
    for k in range(1, K + 1):
        e, term = head.markov(previous)
        draft_logits = base[:, :, k] + term
        previous = jnp.argmax(draft_logits, axis=-1).astype(tokens.dtype)
        drafts.append(previous)
        zs.append(head.confidence_logit(normed[:, :, k], e))
        us.append(head.certainty(draft_logits))
        tvs.append(0.5 * jnp.abs(jax.nn.softmax(draft_logits, axis=-1)
                                 - jax.nn.softmax(label_logits[k - 1], axis=-1)).sum(-1))
    return (jnp.stack(drafts) == labels, jnp.stack(zs), jnp.stack(us), jnp.stack(tvs),
            valid[:, 1:])


def dspark_outcomes(spec: HeadSpec, head, target: Llama, batches: list[dict]) -> dict:
    """Every anchor of `batches` drafted as the engine drafts it -> {"agree" `[K, N]` bool,
    "z", "u", "tv" `[K, N]` float, "mask" `[N]` bool}."""
    head_def, params, rest = split_head(head)
    target_def, target_state = nnx.split(target)
    got = {"agree": [], "z": [], "u": [], "tv": [], "mask": []}
    for b in batches:
        out = jax.device_get(_dspark_batch(spec, head_def, target_def, params, rest,
                                           target_state, b["tokens"], b["valid"]))
        for key, x in zip(("agree", "z", "u", "tv"), out[:4]):
            got[key].append(x.reshape(x.shape[0], -1))
        got["mask"].append(out[4].reshape(-1))
    return {k: np.concatenate(v, axis=-1) for k, v in got.items()}


def fit_platt(z: np.ndarray, y: np.ndarray, u: np.ndarray | None = None, iters: int = 100,
              ridge: float = 1e-6) -> tuple[float, ...]:
    """(scale, bias) -- or with the second feature `u`, (scale, bias, gain) -- minimising mean
    BCE(sigmoid(scale * z + bias [+ gain * u]), y) + ridge/2 |(scale - 1, bias[, gain])|^2 (the
    ridge keeps a constant feature or one-sided labels finite), by damped Newton."""
    z = np.asarray(z, np.float64).ravel()
    y = np.asarray(y, np.float64).ravel()
    columns = [z, np.ones_like(z)] + ([] if u is None else [np.asarray(u, np.float64).ravel()])
    prior = np.array([1.0, 0.0] + ([] if u is None else [0.0]))
    if z.size == 0:
        return tuple(float(x) for x in prior)
    X = np.stack(columns, axis=1)

    def objective(w):
        t = X @ w
        return np.mean(np.logaddexp(0.0, t) - y * t) + 0.5 * ridge * np.sum((w - prior) ** 2)

    w = prior.copy()
    f = objective(w)
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(X @ w)))
        grad = X.T @ (p - y) / len(z) + ridge * (w - prior)
        hess = (X * (p * (1 - p))[:, None]).T @ X / len(z) + ridge * np.eye(len(prior))
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while t > 1e-6:
            candidate = w - t * step
            f_new = objective(candidate)
            if f_new <= f:
                break
            t *= 0.5
        else:
            break
        converged = f - f_new < 1e-12
        w, f = candidate, f_new
        if converged:
            break
    return tuple(float(x) for x in w)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve of `score` for the boolean `label` (ties count half): how well
    the confidence ranks accepted drafts above rejected ones; nan with one class only."""
    score, label = np.asarray(score, np.float64), np.asarray(label, bool)
    pos, neg = label.sum(), (~label).sum()
    if not pos or not neg:
        return float("nan")
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    sorted_scores = score[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[label].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def _predict(pair, z, u) -> np.ndarray:
    """The calibrated confidence of one (scale, bias, gain) map."""
    return _sigmoid(pair[0] * z + pair[1] + pair[2] * u)


def calibrate(outcomes: dict, depth: int) -> tuple[np.ndarray, dict]:
    """-> (calibration `[2, K, 3]` float32, the fit's per-position numbers). Positions no
    anchor reaches keep the identity map."""
    mask = outcomes["mask"].astype(bool)
    agree, z, u, tv = (outcomes[k][:, mask] for k in ("agree", "z", "u", "tv"))
    leading = np.cumprod(agree, axis=0).astype(bool)
    table = np.asarray(identity_calibration(depth), np.float32).copy()
    rows = []
    for k in range(depth):
        reached = leading[k - 1] if k else np.ones(agree.shape[1], bool)
        zk, uk = z[k][reached], u[k][reached]
        yk, sk = agree[k][reached].astype(np.float64), 1.0 - tv[k][reached]
        table[GREEDY, k] = fit_platt(zk, yk, uk)
        table[SAMPLED, k] = fit_platt(zk, sk, uk)
        # Two-fold cross-fit (first / second half of the reached anchors, whole windows
        # mostly): the error of a map on anchors it was not fitted on.
        half = len(zk) // 2
        held = []
        first, second = slice(None, half), slice(half, None)
        for fit, test in ((first, second), (second, first)):
            held.append(_predict(fit_platt(zk[fit], yk[fit], uk[fit]), zk[test], uk[test]))
        held = np.concatenate(held[::-1]) if half else np.array([])
        g, smp = table[GREEDY, k], table[SAMPLED, k]
        nan = float("nan")
        rows.append({
            "greedy_pair": [float(x) for x in g],
            "sampled_pair": [float(x) for x in smp],
            "raw_confidence": float(_sigmoid(zk).mean()) if len(zk) else nan,
            "predicted_confidence": float(_predict(g, zk, uk).mean()) if len(zk) else nan,
            "held_out_predicted_confidence": float(held.mean()) if len(held) else nan,
            "predicted_sampled": float(_predict(smp, zk, uk).mean()) if len(zk) else nan,
            "measured_sampled": float(sk.mean()) if len(zk) else nan,
            "auc": auc(_predict(g, zk, uk), yk > 0.5),
            "auc_z": auc(zk, yk > 0.5),
        })
    return table, {"per_depth": rows}


def dspark_report(spec: HeadSpec, head, target: Llama, batches: list[dict],
                  fit: bool = False) -> dict:
    """The exact greedy report of a DSpark head (sequential drafts), with each position's mean
    predicted confidence c (greedy rule, over the anchors that reach it) against the measured
    conditional agreement. fit=True first fits `head.calibration` on these anchors (in place)."""
    outcomes = dspark_outcomes(spec, head, target, batches)
    table, fitted = calibrate(outcomes, spec.depth)
    if fit:
        head.calibration[...] = jnp.asarray(table)
    else:  # report the head's own calibration
        mask = outcomes["mask"].astype(bool)
        agree, z, u = (outcomes[key][:, mask] for key in ("agree", "z", "u"))
        leading = np.cumprod(agree, axis=0).astype(bool)
        cal = np.asarray(head.calibration[...], np.float64)
        nan = float("nan")
        for k, row in enumerate(fitted["per_depth"]):
            reached = leading[k - 1] if k else np.ones(agree.shape[1], bool)
            row["greedy_pair"] = cal[GREEDY, k].tolist()
            row["sampled_pair"] = cal[SAMPLED, k].tolist()
            zk, uk = z[k][reached], u[k][reached]
            row["predicted_confidence"] = (float(_predict(cal[GREEDY, k], zk, uk).mean())
                                           if len(zk) else nan)
            row["predicted_sampled"] = (float(_predict(cal[SAMPLED, k], zk, uk).mean())
                                        if len(zk) else nan)
            row["auc"] = auc(_predict(cal[GREEDY, k], zk, uk), agree[k][reached])
    report = chain_report(outcomes["agree"], outcomes["mask"])
    for d, row in zip(report["per_depth"], fitted["per_depth"]):
        d.update(row)
        d["calibration_error"] = abs(d["predicted_confidence"] - d["conditional_agreement"])
        d["held_out_calibration_error"] = abs(d["held_out_predicted_confidence"]
                                              - d["conditional_agreement"])
    report["chain_inputs"] = CHAIN_INPUTS
    report["calibration"] = ("per-position logistic maps of z and the certainty, fitted on these "
                             "validation anchors "
                             "(in-sample); held_out_*: two-fold cross-fit" if fit
                             else "the head's stored calibration")
    return report
