"""A run's work folder, `<out>/work`: orbax checkpoints, the training log and the record of the
settings and commands that made it, so an interrupted run resumes as the same run."""

from __future__ import annotations

import dataclasses
import json
import platform
import shlex
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from specjax.train.config import TrainConfig

WORK_DIR = "work"  # under --out; holds orbax checkpoints, token caches and logs; not committed
LOG_NAME = "training_log.json"
RUN_CONFIG_NAME = "run_config.json"


def checkpoint_manager(work: Path) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1, create=True)
    return ocp.CheckpointManager((work / "orbax").absolute(), options=options)


def restore_or_init(mgr: ocp.CheckpointManager, state: dict) -> tuple[dict, int]:
    """-> (state, completed steps): the latest saved state, else `state` itself at step 0."""
    step = mgr.latest_step()
    if step is None:
        return state, 0
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
    return mgr.restore(step, args=ocp.args.StandardRestore(abstract)), step


def load_log(path: Path, upto: int) -> list[dict]:
    """Log entries up to the resumed step: later ones belong to work that was lost."""
    if not path.exists():
        return []
    return [e for e in json.loads(path.read_text())["entries"] if e["step"] <= upto]


def write_log(path: Path, entries: list[dict], meta: dict) -> None:
    # Written aside and renamed, so a crash mid-write never leaves a truncated log.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**meta, "entries": entries}, indent=0) + "\n")
    tmp.replace(path)


def wall_seconds(entries: list[dict]) -> float | None:
    """Training wall time so far, summed over every invocation of the run."""
    return next((e["elapsed_s"] for e in reversed(entries) if "elapsed_s" in e), None)


def check_same_run(work: Path, run_config, tc: TrainConfig, argv: list[str]) -> list[str]:
    """Resuming with other flags would silently mix two runs; refuse instead.

    `run_config` is a dataclass of whatever else the run must keep: the model's config (target,
    draft) or the head spec and its data (heads). It is saved under "model_config", the key
    existing work folders hold. `argv`: this invocation's `python -m specjax.train` arguments.
    Returns every command that contributed to this run, for the model card."""
    path = work / RUN_CONFIG_NAME
    current = {"model_config": dataclasses.asdict(run_config), "train_config": dataclasses.asdict(tc)}
    # Logging and evaluation cadence do not change the trained weights. `steps` may change too, to
    # shorten or extend a run whose machine turned out slower or faster than planned: the cosine
    # schedule is re-stretched from the resumed step on (a small jump in lr, logged).
    free = {"log_every", "eval_every", "eval_windows", "save_every", "steps"}
    strip = lambda c: (c["model_config"], {k: v for k, v in c["train_config"].items() if k not in free})
    commands = []
    if path.exists():
        saved = json.loads(path.read_text())
        commands = saved.get("commands", [])
        if strip(saved) != strip(json.loads(json.dumps(current))):
            raise SystemExit(f"{work} holds a run with other settings; pass --restart to discard it")
        if saved["train_config"]["steps"] != tc.steps:
            print(f"total steps changed from {saved['train_config']['steps']} to {tc.steps}")
    commands.append("python -m specjax.train " + shlex.join(argv))
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**current, "commands": commands}, indent=1) + "\n")
    return commands


def hardware() -> str:
    """What a model card names as the training hardware: the accelerator JAX ran on, or the
    CPU's architecture."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return f"{platform.machine()} CPU"
    return f"{device.device_kind} ({device.platform})"
