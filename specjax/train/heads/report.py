"""The final report (validation split): what the engine's greedy acceptance would be.

For the chain heads it is exact: the target's greedy continuation g_1..g_K of each anchor is
computed with a tree-masked target forward (every anchor's continuation in one sequence), the
head's chain is fed g_1..g_{K-1} (what it drafts whenever it agrees), and depth k agrees when the
head's top-1 token equals g_k. E[AL] = 1 + mean over anchors of the number of leading depths
that agree. Vanilla MTP's modules cannot take a per-anchor input in the dense chain, so its
report is teacher-forced on the corpus tokens (labels: the target's argmax at row t+k).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import Llama
from specjax.models.llama import layer_windows
from specjax.train.heads.attention import masked_attention
from specjax.train.heads.chain import run_chain, shift_rows, teacher_forced_step_tokens
from specjax.train.heads.spec import HeadSpec, split_head


def greedy_chain_tokens(target: Llama, tokens: jax.Array, depth: int,
                        logits: jax.Array | None = None) -> jax.Array:
    """The target's greedy continuation of every anchor (`greedy_chain`'s tokens)."""
    return greedy_chain(target, tokens, depth, logits)[0]


def greedy_chain(target: Llama, tokens: jax.Array, depth: int, logits: jax.Array | None = None,
                 with_logits: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """The target's greedy continuation of every anchor: tokens `[B, T+1]` -> g `[depth, B, T]`,
    g[k-1][b, a] = the target's argmax choice k tokens after the prefix tokens[b, :a+2]
    (g_1 from the plain forward; g_k for k >= 2 with the prefix followed by g_1..g_{k-1}).

    One sequence holds the window and, for every anchor a, slots for g_1..g_{depth-1} at
    positions a+2.., each attending to the prefix rows <= a+1 and to the anchor's earlier slots
    (a tree mask); depth-1 forwards fill the slots one depth at a time.

    -> (g, and with `with_logits` the target's logits at each depth `[depth, B, T, V]`: the
    distribution g_k is the argmax of, after the greedy prefix g_1..g_{k-1}; else None)."""
    B, T1 = tokens.shape
    T = T1 - 1
    if logits is None:
        logits = target.forward(tokens)[0]
    g = [jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32)]
    depth_logits = [logits[:, 1:]]
    n = depth - 1
    finish = lambda: (jnp.stack(g), jnp.stack(depth_logits) if with_logits else None)
    if n == 0:
        return finish()
    anchors = jnp.arange(T)
    slot_pos = anchors[None, :] + 1 + jnp.arange(1, n + 1)[:, None]      # [n, T]
    positions = jnp.concatenate([jnp.arange(T1), slot_pos.reshape(-1)])  # [S]
    S = T1 + n * T
    is_slot = jnp.arange(S) >= T1
    slot = jnp.where(is_slot, (jnp.arange(S) - T1) // T, -1)             # 0-based slot or -1
    anchor = jnp.where(is_slot, (jnp.arange(S) - T1) % T, -1)
    q_slot, k_slot = slot[:, None], slot[None, :]
    prefix_end = jnp.where(is_slot, anchor + 1, jnp.arange(S))          # last visible prefix row
    mask = jnp.where(k_slot < 0, jnp.arange(S)[None, :] <= prefix_end[:, None],
                     (q_slot >= 0) & (anchor[:, None] == anchor[None, :]) & (k_slot <= q_slot))
    cfg = target.config
    windows = layer_windows(cfg)
    distance = positions[:, None] - positions[None, :]
    pos_b = jnp.broadcast_to(positions, (B, S))

    # A tree mask hides prefix rows that sit before a slot's position, so `dense_attention`
    # (causal on positions) cannot serve here; see `attention`.
    def attend(q, k, v, layer, state):
        return masked_attention(q, k, v, mask & (distance < windows[layer])), state

    for s in range(1, n + 1):
        slots = jnp.stack(g + [g[0]] * (n - s))  # slots 1..s hold g_1..g_s; later ones unused
        seq = jnp.concatenate([tokens, slots.transpose(1, 0, 2).reshape(B, n * T)], axis=1)
        x, _, _ = target.run_layers(target.embed_tokens(seq), pos_b, attend, None)
        rows = target.logits(x[:, T1 + (s - 1) * T: T1 + s * T])
        g.append(jnp.argmax(rows, axis=-1).astype(jnp.int32))
        depth_logits.append(rows)
    return finish()


@partial(jax.jit, static_argnums=(0, 1, 2))
def _report_batch(spec: HeadSpec, head_def, target_def, params, rest, target_state, tokens, valid):
    """-> (agree `[K, B, T]` bool, anchor mask `[B, T]` bool) for one batch of windows."""
    target = nnx.merge(target_def, target_state)
    head = nnx.merge(head_def, params, rest)
    K, T = spec.depth, tokens.shape[1] - 1
    logits, captured = target.forward(tokens, capture_layers=spec.needed_layers)
    kind = spec.head_kind
    if spec.parallel:  # drafts do not read earlier drafts: the exact report needs no inputs
        labels = greedy_chain_tokens(target, tokens, K, logits)
        step_logits = kind.block_logits(spec, head, target, captured, tokens)
        drafts = jnp.stack([jnp.argmax(x, -1) for x in step_logits])
        return drafts == labels, valid[:, 1:]
    if spec.chain:
        labels = greedy_chain_tokens(target, tokens, K, logits)           # [K, B, T]
        step_tokens = jnp.concatenate([tokens[None, :, 1:], labels[:-1]])
        anchor_mask = valid[:, 1:]
    else:
        choice = jnp.argmax(logits, axis=-1)
        labels = jnp.stack([shift_rows(choice, j + 1, T) for j in range(K)])
        step_tokens = teacher_forced_step_tokens(tokens, K)
        anchor_mask = shift_rows(valid, K, T, fill=False)
    step_logits = run_chain(spec, head, target, captured, step_tokens)
    drafts = jnp.stack([kind.to_target_ids(head, jnp.argmax(x, -1)) for x in step_logits])
    return drafts == labels, anchor_mask


def chain_agreement(spec: HeadSpec, head, target: Llama, batches: list[dict]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """-> (agree `[K, N]` bool, mask `[N]` bool) over every anchor row of `batches`."""
    head_def, params, rest = split_head(head)
    target_def, target_state = nnx.split(target)
    agrees, masks = [], []
    for b in batches:
        agree, mask = jax.device_get(_report_batch(spec, head_def, target_def, params, rest,
                                                   target_state, b["tokens"], b["valid"]))
        agrees.append(agree.reshape(agree.shape[0], -1))
        masks.append(mask.reshape(-1))
    return np.concatenate(agrees, axis=1), np.concatenate(masks)


def chain_report(agree: np.ndarray, mask: np.ndarray) -> dict:
    """agree `[K, N]` bool (depth k of anchor n agrees with the target's greedy choice), mask
    `[N]` -> per-depth top-1 agreement, conditional agreement given depths 1..k-1 agreed, and
    E[AL] = 1 + mean number of leading depths that agree."""
    agree = np.asarray(agree, bool)[:, np.asarray(mask, bool)]
    K, N = agree.shape
    leading = np.cumprod(agree, axis=0).astype(bool)  # [K, N]: depths 1..k all agree
    per_depth = []
    for k in range(K):
        reached = leading[k - 1] if k else np.ones((N,), bool)
        per_depth.append({
            "depth": k + 1,
            "agreement": float(agree[k].mean()) if N else float("nan"),
            "conditional_agreement": (float(agree[k][reached].mean()) if reached.any()
                                      else float("nan")),
            "reached": int(reached.sum()),
        })
    return {"depth": K, "anchors": int(N), "per_depth": per_depth,
            "expected_acceptance_length": float(1 + leading.sum(0).mean()) if N else float("nan")}


def acceptance_report(spec: HeadSpec, head, target: Llama, batches: list[dict]) -> dict:
    """The exact greedy acceptance report of a head over `batches`, its kind's
    (`HeadKind.report`: `chain_acceptance_report`, or DSpark's `dspark_report`)."""
    return spec.head_kind.report(spec, head, target, batches)


def chain_acceptance_report(spec: HeadSpec, head, target: Llama, batches: list[dict]) -> dict:
    report = chain_report(*chain_agreement(spec, head, target, batches))
    report["chain_inputs"] = (
        "none: one pass drafts the block (exact acceptance)" if spec.parallel else
        "the target's greedy tokens (exact chain acceptance)" if spec.chain
        else "corpus tokens (teacher-forced dense chain)")
    return report


def format_report(report: dict, title: str = "") -> str:
    lines = [title] if title else []
    confidence = "predicted_confidence" in report["per_depth"][0]
    if confidence:  # DSpark: the calibrated confidence against what it predicts
        lines += ["| depth | top-1 agreement | conditional agreement | anchors reached | "
                  "predicted c | \\|predicted - measured\\| | held-out \\|diff\\| | "
                  "1 - TV (measured) | predicted (sampled) | AUC | AUC of z alone |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    else:
        lines += ["| depth | top-1 agreement | conditional agreement | anchors reached |",
                  "|---:|---:|---:|---:|"]
    for d in report["per_depth"]:
        row = (f"| {d['depth']} | {d['agreement']:.3f} | "
               f"{d['conditional_agreement']:.3f} | {d['reached']} |")
        if confidence:
            row += (f" {d['predicted_confidence']:.3f} | {d['calibration_error']:.3f} | "
                    f"{d['held_out_calibration_error']:.3f} | {d['measured_sampled']:.3f} | "
                    f"{d['predicted_sampled']:.3f} | {d['auc']:.3f} | {d['auc_z']:.3f} |")
        lines.append(row)
    lines.append(f"\nE[AL] = **{report['expected_acceptance_length']:.3f}** at depth "
                 f"{report['depth']} over {report['anchors']:,} validation anchors "
                 f"(chain inputs: {report['chain_inputs']})")
    return "\n".join(lines)
