"""`python -m specjax.bench decode|spec|sampling|cpu ...`: benchmarks that print their figures."""
import argparse

from specjax.bench import cpu, decode, sampling, spec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {"decode": decode, "spec": spec, "sampling": sampling, "cpu": cpu}
    for name, module in modules.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    modules[args.command].run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
