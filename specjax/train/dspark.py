"""Train a DSpark drafter on a frozen target:
`python -m specjax.train dspark --target checkpoints/<target> --out checkpoints/<dspark>`.

The drafter is a DFlash one (`specjax.train.dflash`: same flags, same body and same
initialisation) plus DSpark's two small heads (`specjax.models.dspark_head`): a rank
`--markov-rank` Markov head that adds a term of the previous token to each draft's logits (in
training the TRUE previous token, so the block still trains in one pass) and a confidence head.
The loss is DeepSpec's: per draft k, weight exp(-(k-1)/4) x [0.1 cross-entropy (label: the
target's greedy token) + 0.9 L1(draft, target distributions) + BCE(confidence, 1 - TV)]. After
training the confidence's per-position calibration (a logistic map of its logit and the
drafter's certainty) is fitted on the validation windows of the final report, which drafts
sequentially as the engine does. The export layout is
`specjax.models.dflash_checkpoint`'s (DSpark architecture)."""
from __future__ import annotations

import argparse
from pathlib import Path

from specjax.models.dflash_checkpoint import save_dflash_head
from specjax.models.dflash_head import default_target_layers
from specjax.train.eagle3 import _layers
from specjax.train.heads import cli
from specjax.train.heads.spec import HeadSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_arguments(p, "dspark")
    p.add_argument("--drafter-layers", type=int, default=2,
                   help="decoder layers of the drafter (started from the target's first ones)")
    p.add_argument("--layers", type=_layers, default=None,
                   help="target layers whose residual streams fc fuses, 0-based, e.g. 1,4,6 "
                        "(default: three spread from the second to the second-to-last)")
    p.add_argument("--markov-rank", type=int, default=64,
                   help="rank of the Markov head (previous token -> a logits term)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    def fields(cfg):
        layers = args.layers if args.layers is not None else default_target_layers(cfg.num_layers)
        return dict(capture_layers=tuple(layers), drafter_layers=args.drafter_layers,
                    markov_rank=args.markov_rank)

    def export(out: Path, head, target, spec: HeadSpec, log: dict) -> None:
        save_dflash_head(head, out, dtype=args.save_dtype)
        log["save_dtype"] = args.save_dtype

    return cli.run("dspark", args, argv, fields, export)
