"""Train an EAGLE-3 draft head on a frozen target:
`python -m specjax.train eagle3 --target checkpoints/<target> --out checkpoints/<head>`.

The training itself (training-time test over the draft chain, soft labels from the target, the
acceptance report) lives in `specjax.train.heads`; this module adds the EAGLE-3 flags and the
export in the public EAGLE-3 layout."""
from __future__ import annotations

import argparse
from pathlib import Path

from specjax.speculative.config import default_eagle3_layers
from specjax.models.eagle3_checkpoint import save_eagle3_head
from specjax.train.heads import cli
from specjax.train.heads.spec import HeadSpec


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes comma-separated layer indices, got {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_arguments(p, "eagle3")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary size (default: the whole target vocabulary); smaller "
                        "keeps the most frequent training tokens (d2t/t2d maps)")
    p.add_argument("--layers", type=_layers, default=None,
                   help="the 3 captured target layers, 0-based, e.g. 1,3,4 (default: "
                        "(1, L//2 - 1, L - 4))")


def export(out: Path, head, target, spec: HeadSpec, log: dict) -> None:
    # config.json records the capture layers (eagle_config.eagle_aux_hidden_state_layer_ids,
    # as public EAGLE-3 configs do): EagleConfig uses them unless told otherwise.
    assert head.config.aux_hidden_state_layers == tuple(spec.capture_layers)
    save_eagle3_head(head, out, dtype=log["args"]["save_dtype"])
    log["save_dtype"] = log["args"]["save_dtype"]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    def fields(cfg):
        layers = args.layers if args.layers is not None else default_eagle3_layers(cfg.num_layers)
        return dict(capture_layers=tuple(layers), draft_vocab=args.draft_vocab or cfg.vocab_size)

    return cli.run("eagle3", args, argv, fields, export)
