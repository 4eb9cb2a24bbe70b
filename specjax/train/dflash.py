"""Train a DFlash drafter on a frozen target:
`python -m specjax.train dflash --target checkpoints/<target> --out checkpoints/<dflash>`.

The drafter: `--drafter-layers` decoder layers shaped like the target's (started from its first
ones), fc over the target's residual streams at `--layers` (the context features injected as
keys and values into every layer), the target's embeddings and LM head. Training: every
position of a window is an anchor; the block [token at the anchor, mask x K] sees the context
before the anchor and itself (bidirectionally), and block row k is labelled with the frozen
target's distribution k - 1 rows after the anchor (soft labels; weight step_weight^(k-1), so
the early drafts, where acceptance is decided, count most). The loop, data (the target's
corpus or SAVE_HIDDEN_STATES files), report and export checks are the head trainers'
(`specjax.train.heads`); the export layout is `specjax.models.dflash_checkpoint`'s."""
from __future__ import annotations

import argparse
from pathlib import Path

from specjax.models.dflash_checkpoint import save_dflash_head
from specjax.models.dflash_head import default_target_layers
from specjax.train.eagle3 import _layers
from specjax.train.heads import cli
from specjax.train.heads.spec import HeadSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_arguments(p, "dflash")
    p.add_argument("--drafter-layers", type=int, default=2,
                   help="decoder layers of the drafter (started from the target's first ones)")
    p.add_argument("--layers", type=_layers, default=None,
                   help="target layers whose residual streams fc fuses, 0-based, e.g. 1,4,6 "
                        "(default: three spread from the second to the second-to-last)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    def fields(cfg):
        layers = args.layers if args.layers is not None else default_target_layers(cfg.num_layers)
        return dict(capture_layers=tuple(layers), drafter_layers=args.drafter_layers)

    def export(out: Path, head, target, spec: HeadSpec, log: dict) -> None:
        save_dflash_head(head, out, dtype=args.save_dtype)
        log["save_dtype"] = args.save_dtype

    return cli.run("dflash", args, argv, fields, export)
