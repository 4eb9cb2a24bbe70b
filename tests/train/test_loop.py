"""The shared training loop and work folder on a toy state: resume continues the same run, the
log keeps what the saved steps earned, and a resumed run with other settings is refused."""
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.train.config import TrainConfig
from specjax.train.loop import LogFormat, run_training, stopped_early
from specjax.train.workdir import check_same_run

TC = TrainConfig(steps=6, batch_size=1, seq_len=4, log_every=2, eval_every=3, save_every=2)
LOG = LogFormat(fields=lambda got, s_step: {"s_per_step": s_step}, postfix=lambda e: {})


@jax.jit
def toy_step(state, batch):
    w = state["w"] + batch
    return {"w": w}, {"loss": w.sum(), "grad_norm": jnp.abs(batch).sum()}


def run(work, stop_after=None, stop_at=None):
    return run_training({"w": jnp.zeros(3)}, toy_step, lambda step: jnp.full(3, step + 1.0), TC,
                        work, meta={"toy": True}, log=LOG,
                        evaluate=lambda s: ({"val_loss": float(s["w"][0])}, "val"),
                        stop_after=stop_after, progress=False, stop_at=stop_at)


def test_a_spent_time_budget_ends_the_run_after_one_saved_resumable_step(tmp_path, capsys):
    import time
    first, entries = run(tmp_path, stop_at=time.perf_counter())
    assert float(first["w"][0]) == 1 and [e["step"] for e in entries] == [1]
    assert stopped_early(entries, TC) and "out of time after step 1 of 6" in \
        capsys.readouterr().out
    resumed, _ = run(tmp_path)
    assert float(resumed["w"][0]) == sum(range(1, 7))


def test_resumed_run_equals_uninterrupted(tmp_path, capsys):
    full, full_entries = run(tmp_path / "full")
    first, entries = run(tmp_path / "split", stop_after=3)
    assert stopped_early(entries, TC) and "rerun the same command" in capsys.readouterr().out
    assert float(first["w"][0]) == 1 + 2 + 3
    resumed, resumed_entries = run(tmp_path / "split")
    assert not stopped_early(resumed_entries, TC)
    np.testing.assert_array_equal(resumed["w"], full["w"])
    assert float(full["w"][0]) == sum(range(1, 7))
    # The planned stop logs and saves step 3, so the resumed run starts there.
    assert "resuming from step 3" in capsys.readouterr().out
    assert [e["step"] for e in full_entries] == [2, 3, 4, 6, 6]
    assert [e["step"] for e in resumed_entries] == [2, 3, 3, 4, 6, 6]
    strip = lambda e: {k: v for k, v in e.items() if k not in ("s_per_step", "elapsed_s")}
    assert [strip(e) for e in resumed_entries[-2:]] == [strip(e) for e in full_entries[-2:]]
    assert resumed_entries[3]["step_losses"] == full_entries[2]["step_losses"][-1:]
    assert full_entries[1] == {"step": 3, "val_loss": 6.0}
    assert full_entries[0]["loss"] == pytest.approx(np.mean([3.0, 9.0]))
    assert full_entries[0]["step_losses"] == [3.0, 9.0] and full_entries[0]["tokens"] == 8
    assert resumed_entries[-2]["elapsed_s"] >= resumed_entries[1]["elapsed_s"]


COMMAND = "python -m specjax.train "


@dataclass(frozen=True)
class Model:
    width: int


def test_check_same_run_records_commands_and_refuses_other_settings(tmp_path):
    assert check_same_run(tmp_path, Model(4), TC, ["a"]) == [COMMAND + "a"]
    # Cadence and length may change on resume; the recipe may not.
    longer = TrainConfig(**{**TC.__dict__, "steps": 8, "log_every": 1})
    assert check_same_run(tmp_path, Model(4), longer, ["b", "c d"]) == [
        COMMAND + "a", COMMAND + "b 'c d'"]
    with pytest.raises(SystemExit, match="other settings"):
        check_same_run(tmp_path, Model(8), TC, ["c"])
    with pytest.raises(SystemExit, match="other settings"):
        check_same_run(tmp_path, Model(4), TrainConfig(**{**TC.__dict__, "lr": 1.0}), ["c"])
