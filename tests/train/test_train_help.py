"""`python -m specjax.train [SUBCOMMAND] --help`: every option explained, with its default."""
import argparse

import pytest

from specjax.train.__main__ import SUBCOMMANDS, build_parser, main


def parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"main": parser, **sub.choices}


def test_every_parser_shows_defaults_and_every_option_has_help():
    found = parsers()
    assert set(found) == {"main", *SUBCOMMANDS}
    for name, parser in found.items():
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), name
        for action in parser._actions:
            assert action.help and action.help.strip(), (name, action.option_strings or action.dest)


@pytest.mark.parametrize("command, shown", [
    ("target", ["--d-model D_MODEL hidden size (default: 256)",
                "--log-level {debug,info,warning,error}", "(default: warning)"]),
    ("draft", ["--d-model D_MODEL hidden size (default: 128)",
               "--layers LAYERS decoder layers (default: 2)"]),
    ("eagle3", ["(default: 4)", "--steps STEPS", "(default: 600)"]),
    ("mtp", ["--save-dtype {float32,bfloat16", "(default: bfloat16)", "--lr LR peak learning rate"]),
    ("eval", ["--seq-len SEQ_LEN evaluation window length (tokens) (default: 256)"]),
])
def test_help_of_each_subcommand_shows_its_defaults(command, shown, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for piece in shown:
        assert piece in text, piece
    # Required options, switches and options whose default is None show no "(default: ...)".
    for quiet in ("(default: None)", "(default: False)"):
        assert quiet not in text
