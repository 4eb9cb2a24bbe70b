"""Train MTP draft modules on a frozen target:
`python -m specjax.train mtp --target checkpoints/<target> --out checkpoints/<head>
[--num-modules 3]` (vanilla MTP: module k drafts token k) or `--num-modules 1` (MTP-Eagle: one
module reused for every draft step, trained with the same training-time test as EAGLE-3).

The training lives in `specjax.train.heads`; this module adds the MTP flags and the export
(`specjax.models.mtp_checkpoint`, bfloat16 by default to stay well under 10 MB)."""
from __future__ import annotations

import argparse
from pathlib import Path

from specjax.models.mtp_checkpoint import save_mtp_heads
from specjax.train.heads import cli
from specjax.train.heads.spec import HeadSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_arguments(p, "mtp")
    p.add_argument("--num-modules", type=int, default=3,
                   help="MTP modules (1 = MTP-Eagle, one module reused for every draft step)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    def export(out: Path, head, target, spec: HeadSpec, log: dict) -> None:
        save_mtp_heads(head, out, dtype=args.save_dtype)
        log["save_dtype"] = args.save_dtype

    return cli.run("mtp", args, argv, lambda cfg: dict(num_modules=args.num_modules), export)
