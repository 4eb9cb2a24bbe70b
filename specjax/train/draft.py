"""Train a small draft model for draft-target speculation: the target's recipe, the target's
tokenizer and corpus. `python -m specjax.train draft --target checkpoints/<target> --out …`"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from specjax.train import corpus, target
from specjax.train import tokenizer_training as toks
from specjax.train.workdir import WORK_DIR

DRAFT_DEFAULTS = dict(d_model=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=384)


def add_arguments(p: argparse.ArgumentParser) -> None:
    target.add_arguments(p)
    p.add_argument("--target", type=Path, required=True,
                   help="the target's checkpoint folder: its tokenizer and corpus are reused")
    p.set_defaults(**DRAFT_DEFAULTS)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    # A draft must tokenize exactly like its target: start from the target's tokenizer and
    # manifest, which the target recipe then reuses instead of training its own.
    if args.restart:  # the target recipe's restart would also drop the copied tokenizer
        shutil.rmtree(args.out / WORK_DIR, ignore_errors=True)
        args.restart = False
    args.out.mkdir(parents=True, exist_ok=True)
    for name in (toks.TOKENIZER_NAME, corpus.MANIFEST_NAME):
        source = args.target / name
        if not source.exists():
            raise SystemExit(f"--target: {source} is missing")
        shutil.copy(source, args.out / name)
    return target.run(args, argv)
