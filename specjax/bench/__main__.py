"""`python -m specjax.bench decode ...`"""
import argparse

from specjax.bench import decode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    decode.add_arguments(sub.add_parser("decode", help=decode.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    {"decode": decode.run}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
