"""`python -m specjax.train <subcommand>`: one entry point for every model specjax trains."""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import contextmanager

from specjax.cli import QUIET_LOGGERS, HelpFormatter
from specjax.train import (dflash, draft, dspark, eagle3, evaluate_cli, mtp, pard, selfdistill,
                           target)

# Each subcommand module provides add_arguments(parser) and run(args) -> exit code.
SUBCOMMANDS = {
    "target": (target, "train the bundled target model on the Python standard library"),
    "draft": (draft, "train a small draft model with a target's tokenizer and corpus"),
    "eagle3": (eagle3, "train an EAGLE-3 draft head on a frozen target's hidden states"),
    "mtp": (mtp, "train MTP draft modules (or one MTP-Eagle module) on a frozen target"),
    "pard": (pard, "train a PARD draft model (all K drafts in one pass) for a frozen target"),
    "dflash": (dflash, "train a DFlash drafter (block diffusion on the target's hidden states)"),
    "dspark": (dspark, "train a DSpark drafter (DFlash plus a Markov head and a calibrated "
                       "confidence head)"),
    "data": (selfdistill, "training data from a target itself: its answers to prompts made "
                          "locally, with the hidden states heads train on"),
    "eval": (evaluate_cli, "validation loss of an exported target checkpoint"),
}

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specjax.train", description=__doc__,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND",
                                help="what to train (or evaluate); SUBCOMMAND --help lists its "
                                     "options")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                       help="level of the log records (jax, orbax, specjax) shown on stderr; "
                            "jax's backend probing and orbax's checkpoint details only at debug")
    return parser


@contextmanager
def cli_logging(level: str):
    """Log records at `level` and above on stderr, one line each, for the duration of a command;
    the logging setup before it is restored after (main may run inside another program).

    The root logger's console handlers are replaced rather than added to: importing orbax already
    gives the root logger a default one (absl calls logging.basicConfig)."""
    root = logging.getLogger()
    saved = root.level, root.handlers[:], {n: logging.getLogger(n).level for n in QUIET_LOGGERS}
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    is_console = lambda h: (type(h) is logging.StreamHandler
                            and h.stream in (sys.stderr, sys.stdout, sys.__stderr__))
    root.handlers = [h for h in root.handlers if not is_console(h)] + [handler]
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:  # at debug, whatever an earlier setup left must not hide them
        logging.getLogger(name).setLevel(logging.NOTSET if level == "debug" else logging.WARNING)
    try:
        yield
    finally:
        root.setLevel(saved[0])
        root.handlers = saved[1]
        for name, quiet_level in saved[2].items():
            logging.getLogger(name).setLevel(quiet_level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, _ = SUBCOMMANDS[args.command]
    with cli_logging(args.log_level):
        return module.run(args, argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
