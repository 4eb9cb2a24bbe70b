"""Training a head: the jitted step (the frozen target's forward inside it, gradients for the
head alone), validation metrics, and `train_head` on the shared loop."""
from __future__ import annotations

import dataclasses
from functools import lru_cache, partial
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

from specjax.models import Llama
from specjax.train.config import TrainConfig, make_optimizer
from specjax.train.heads.sources import DataSource
from specjax.train.heads.loss import head_loss, target_outputs
from specjax.train.heads.spec import HeadSpec, new_head, split_head
from specjax.train.loop import LogFormat, run_training


@lru_cache(maxsize=8)
def make_train_step(spec: HeadSpec, head_def: nnx.GraphDef, target_def: nnx.GraphDef,
                    tc: TrainConfig):
    tx = make_optimizer(tc)

    @partial(jax.jit, donate_argnums=0)
    def train_step(state: dict, rest, target_state, batch: dict) -> tuple[dict, dict]:
        target = nnx.merge(target_def, target_state)
        target_logits, captured = target_outputs(spec, target, batch["tokens"],
                                                 batch.get("captured"))

        def loss_fn(params):
            head = nnx.merge(head_def, params, rest)
            return head_loss(spec, head, target, batch["tokens"], batch["valid"], target_logits,
                             captured)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return ({"params": params, "opt_state": opt_state},
                {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics})

    return train_step


@partial(jax.jit, static_argnums=(0, 1, 2))
def _eval_batch(spec: HeadSpec, head_def, target_def, params, rest, target_state, batch):
    target = nnx.merge(target_def, target_state)
    head = nnx.merge(head_def, params, rest)
    target_logits, captured = target_outputs(spec, target, batch["tokens"], batch.get("captured"))
    loss, metrics = head_loss(spec, head, target, batch["tokens"], batch["valid"], target_logits,
                              captured)
    return {"loss": loss, **metrics}


def validation_metrics(spec: HeadSpec, head, target: Llama, batches: list[dict]) -> dict:
    """Mean loss and per-step agreement over validation batches."""
    head_def, params, rest = split_head(head)
    target_def, target_state = nnx.split(target)
    out = [jax.device_get(_eval_batch(spec, head_def, target_def, params, rest, target_state, b))
           for b in batches]
    return {"val_loss": float(np.mean([o["loss"] for o in out])),
            "val_kl": float(np.mean([o["kl"] for o in out])),
            "val_step_acc": [float(x) for x in np.mean([o["step_acc"] for o in out], axis=0)]}


def _mean_per_step(got: list[dict], key: str) -> list[float]:
    return [float(x) for x in np.mean([m[key] for m in got], axis=0)]


def _log_line(e: dict) -> str:
    # No s/step for the first interval: it includes compilation, so no rate exists yet.
    rate = "" if e["s_per_step"] is None else f" s/step {e['s_per_step']:.3g}"
    return (f"loss {e['loss']:.4f} step_acc {[round(a, 3) for a in e['step_acc']]}{rate} "
            f"elapsed {e['elapsed_s']:.0f}s")


def _postfix(e: dict) -> dict:
    shown = {"loss": f"{e['loss']:.3f}", "acc1": f"{e['step_acc'][0]:.2f}"}
    if e["s_per_step"] is not None:
        shown["s_step"] = f"{e['s_per_step']:.3g}"
    return shown


def _fields(got: list[dict], s_step) -> dict:
    out = {"kl": float(np.mean([m["kl"] for m in got])),
           "step_loss": _mean_per_step(got, "step_loss"),
           "step_acc": _mean_per_step(got, "step_acc")}
    for key in ("step_tv", "step_bce"):  # DSpark's: TV to the target, the confidence's BCE
        if key in got[0]:
            out[key] = _mean_per_step(got, key)
    return {**out, "s_per_step": s_step}


HEAD_LOG = LogFormat(fields=_fields, postfix=_postfix, line=_log_line)


def train_head(spec: HeadSpec, tc: TrainConfig, target: Llama, source: DataSource, work: Path,
               stop_after: int | None = None, progress: bool = True,
               stop_at: float | None = None):
    """Train (or resume) to `tc.steps`; -> (head, log entries)."""
    head = new_head(spec, target, tc.seed, source.token_counts(target.config.vocab_size))
    head_def, params, rest = split_head(head)
    target_def, target_state = nnx.split(target)
    # Committed like a restored state, so a fresh and a resumed run share one compiled step.
    state = jax.device_put({"params": params, "opt_state": make_optimizer(tc).init(params)},
                           jax.devices()[0])
    step_fn = make_train_step(spec, head_def, target_def, tc)
    val_batches = source.val_batches(tc.batch_size, tc.seq_len, tc.eval_windows)

    def evaluate(state: dict) -> tuple[dict, str]:
        val = validation_metrics(spec, nnx.merge(head_def, state["params"], rest), target,
                                 val_batches)
        return val, (f"val_loss {val['val_loss']:.4f} val_kl {val['val_kl']:.4f} val_step_acc "
                     f"{[round(a, 3) for a in val['val_step_acc']]}")

    state, entries = run_training(
        state, lambda state, batch: step_fn(state, rest, target_state, batch),
        lambda step: source.train_batch(tc.seed, step, tc.batch_size, tc.seq_len), tc, work,
        meta={"head_spec": dataclasses.asdict(spec), "train_config": dataclasses.asdict(tc)},
        log=HEAD_LOG, evaluate=evaluate if val_batches else None, stop_after=stop_after,
        stop_at=stop_at, progress=progress)
    return nnx.merge(head_def, state["params"], rest), entries
