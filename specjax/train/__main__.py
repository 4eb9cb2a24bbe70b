"""`python -m specjax.train <subcommand>`: one entry point for every model specjax trains."""

from __future__ import annotations

import argparse
import sys

from specjax.train import draft, eagle3, evaluate_cli, mtp, target

# Each subcommand module provides add_arguments(parser) and run(args) -> exit code.
SUBCOMMANDS = {
    "target": (target, "train the bundled target model on the Python standard library"),
    "draft": (draft, "train a small draft model with a target's tokenizer and corpus"),
    "eagle3": (eagle3, "train an EAGLE-3 draft head on a frozen target's hidden states"),
    "mtp": (mtp, "train MTP draft modules (or one MTP-Eagle module) on a frozen target"),
    "eval": (evaluate_cli, "validation loss of an exported target checkpoint"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specjax.train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, _ = SUBCOMMANDS[args.command]
    return module.run(args, argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
