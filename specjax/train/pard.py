"""Train a PARD draft model for a target:
`python -m specjax.train pard --target checkpoints/<target> --out checkpoints/<pard>`.

The draft model is a small causal LM of the target's tokenizer, started from the target's
embeddings and first `--drafter-layers` layers, with one more embedding row for the mask token
(the target's vocabulary has no spare token). The PARD objective: at every anchor the draft
model reads the prefix and K-1 mask tokens, and the k-th row after the prefix predicts the
token k positions ahead (`specjax.train.heads.parallel`), against the frozen target's own
distribution (soft labels). The training loop, data, report and export checks are the head
trainers' (`specjax.train.heads`); the export is a Hugging Face Llama folder with `pard_token`
and the target's tokenizer."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from specjax.models.pard_checkpoint import save_pard_model
from specjax.train import tokenizer_training as toks
from specjax.train.heads import cli
from specjax.train.heads.spec import HeadSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_arguments(p, "pard")
    p.add_argument("--drafter-layers", type=int, default=3,
                   help="decoder layers of the draft model (started from the target's first ones)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    def export(out: Path, model, target, spec: HeadSpec, log: dict) -> None:
        save_pard_model(model, out, target.config.vocab_size, dtype=args.save_dtype)
        tokenizer = Path(args.target) / toks.TOKENIZER_NAME
        if tokenizer.exists():  # a PARD model is a language model of its own: ship its tokenizer
            shutil.copy(tokenizer, out / toks.TOKENIZER_NAME)
        log["save_dtype"] = args.save_dtype

    return cli.run("pard", args, argv, lambda cfg: dict(drafter_layers=args.drafter_layers),
                   export)
