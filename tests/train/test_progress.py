"""What `python -m specjax.train` shows while it trains: on a terminal a progress bar that log
records, warnings and report lines never run into; elsewhere a line per log interval; no rate
before one exists (the first interval includes compilation); quiet library loggers."""
import io
import logging
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

from specjax.train.__main__ import cli_logging
from specjax.train.config import TrainConfig
from specjax.train.heads.training import HEAD_LOG
from specjax.train.loop import run_training
from specjax.train.target import target_log_format

TC = TrainConfig(steps=6, batch_size=1, seq_len=4, log_every=1, eval_every=2, save_every=100)


class Terminal(io.StringIO):
    """stdout and stderr of a terminal: one stream, and a tty."""

    def isatty(self):
        return True


@jax.jit
def _step(state, batch):
    w = state["w"] + batch
    return {"w": w}, {"loss": w.sum(), "grad_norm": jnp.abs(batch).sum(), "kl": w.mean(),
                      "step_loss": jnp.stack([w[0], w[1]]), "step_acc": jnp.stack([w[0], w[1]]) * 0}


def chatty_step(state, batch):
    """The toy step; at the third step a library logs a warning and warns."""
    if float(batch[0]) == 3:
        logging.getLogger("specjax.test").warning("a log record")
        warnings.warn("a warning", UserWarning)
    return _step(state, batch)


def train(tmp_path, progress=True):
    return run_training({"w": jnp.zeros(3)}, chatty_step, lambda step: jnp.full(3, step + 1.0),
                        TC, tmp_path, meta={}, log=HEAD_LOG, progress=progress,
                        evaluate=lambda s: ({"val_loss": 0.0}, "val_loss 0.0"))


def rows(text: str) -> list[str]:
    """What a terminal leaves on each row: the text after the row's last carriage return."""
    return [row.split("\r")[-1] for row in text.split("\n")]


def test_on_a_terminal_nothing_runs_into_the_bar(tmp_path, monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(sys, "stderr", term)
    with cli_logging("warning"), warnings.catch_warnings():
        warnings.simplefilter("always")
        train(tmp_path)
    out = term.getvalue()
    shown = rows(out)
    assert any("%|" in row and "6/6" in row for row in shown), "the bar was drawn"
    # Each message starts its own row: nothing of the bar is left in front of it.
    for message in ("step 2: val_loss 0.0", "step 6: val_loss 0.0",
                    "WARNING specjax.test: a log record"):
        assert any(row.startswith(message) for row in shown), (message, shown)
    assert any(row.endswith("UserWarning: a warning") and "|" not in row for row in shown), shown
    # Every row holds either the bar or a message, never both.
    for row in text_rows(out):
        assert not ("%|" in row and ("val_loss" in row or "a log record" in row
                                     or "a warning" in row)), row
    assert "None" not in out and "s_step=" in out


def text_rows(text: str) -> list[str]:
    """Every piece of text between carriage returns and newlines (each drawn bar, each line)."""
    return [piece for row in text.split("\n") for piece in row.split("\r")]


def test_without_a_terminal_a_line_per_interval_and_no_bar(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(tmp_path)
    captured = capsys.readouterr()
    assert "%|" not in captured.err + captured.out and "\r" not in captured.err + captured.out
    lines = captured.out.splitlines()
    steps = [line for line in lines if line.startswith("step ") and "/6 " in line]
    assert [line.split()[1] for line in steps] == [f"{i}/6" for i in range(1, 7)]
    assert "s/step" not in steps[0] and "None" not in captured.out
    assert all("s/step " in line for line in steps[1:])


@pytest.mark.parametrize("log_format", [HEAD_LOG, target_log_format(TC)], ids=["head", "target"])
def test_no_rate_until_one_exists(log_format):
    first = {"step": 1, "loss": 2.5, "elapsed_s": 3.0, "step_acc": [0.5], "s_per_step": None,
             "tokens_per_s": None}
    later = {**first, "s_per_step": 0.25, "tokens_per_s": 16.0}
    assert "None" not in log_format.line(first) and "None" not in str(log_format.postfix(first))
    assert set(log_format.postfix(later)) - set(log_format.postfix(first)) == {
        "s_step" if log_format is HEAD_LOG else "tok_s"}
    assert ("0.25" if log_format is HEAD_LOG else "16") in log_format.line(later)
    assert log_format.line(first).startswith("loss 2.5000")


def test_cli_logging_shows_the_level_asked_for_but_not_jax_backend_probing(capsys):
    root, jax_logger = logging.getLogger(), logging.getLogger("jax._src.xla_bridge")
    before = root.level, list(root.handlers), jax_logger.level
    with cli_logging("info"):
        logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu'")
        logging.getLogger("absl").info("Saving checkpoint at step 10")
        logging.getLogger("specjax.train.test").info("an info record")
    err = capsys.readouterr().err
    assert "INFO specjax.train.test: an info record" in err
    assert "Unable to initialize backend" not in err and "Saving checkpoint" not in err
    assert (root.level, root.handlers, jax_logger.level) == before
    with cli_logging("debug"):
        logging.getLogger("jax._src.xla_bridge").debug("backend probing")
    assert "DEBUG jax._src.xla_bridge: backend probing" in capsys.readouterr().err
