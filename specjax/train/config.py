"""The optimisation recipe every trainer shares: `TrainConfig`, its learning-rate schedule and
optimizer, and its command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import jax
import optax


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 32  # periodic validation uses the first windows only; the export uses all
    save_every: int = 100

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, tc.warmup, max(tc.steps, tc.warmup + 1), end_value=tc.lr * tc.min_lr_ratio
    )


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    # Norm gains are scale parameters around 1; decaying them towards 0 only hurts.
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params
    )
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(lr_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask),
    )


# The help of each TrainConfig field's flag.
TRAIN_HELP = {
    "steps": "optimizer steps in all; may change when resuming (the cosine decay re-stretches "
             "from the resumed step on)",
    "batch_size": "sequences per step",
    "seq_len": "tokens per sequence",
    "lr": "peak learning rate, reached after the warm-up",
    "min_lr_ratio": "the cosine decay ends at lr x this",
    "warmup": "steps of linear learning-rate warm-up from 0",
    "weight_decay": "AdamW weight decay (norm gains are not decayed)",
    "b1": "AdamW beta1",
    "b2": "AdamW beta2",
    "clip_norm": "clip the gradients to this global norm",
    "seed": "seed of the initial weights and of the batch order",
    "log_every": "log the loss (a line, or the progress bar's fields) every this many steps",
    "eval_every": "validate every this many steps and at the last",
    "eval_windows": "validation windows of the periodic validation (the final evaluation at "
                    "export has its own)",
    "save_every": "save an orbax checkpoint (the point a rerun resumes from) every this many "
                  "steps",
}


def add_train_arguments(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """One `--flag` per TrainConfig field, in a "training" group; `defaults` overrides the
    dataclass defaults (a recipe's own)."""
    defaults = defaults or {}
    t = p.add_argument_group("training")
    for field in dataclasses.fields(TrainConfig):
        t.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                       default=defaults.get(field.name, field.default), help=TRAIN_HELP[field.name])


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
