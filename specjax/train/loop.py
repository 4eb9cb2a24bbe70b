"""The one training loop: resume from the work folder, step, log, evaluate, save.

Every trainer (the target and draft models, the EAGLE-3 and MTP heads) keeps its parameters and
optimizer state in one pytree `state` that a jitted step takes and donates; the loop
checkpoints that pytree with orbax under `<work>/orbax`. Batches are a pure function of the step,
so a run restarted after a crash resumes from the last saved step and continues the same loss
curve; the log keeps the entries up to that step and the wall time of every invocation.
"""

from __future__ import annotations

import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from specjax.train.config import TrainConfig, lr_schedule
from specjax.train.workdir import (LOG_NAME, checkpoint_manager, load_log, restore_or_init,
                                   wall_seconds, write_log)


PREFETCH = 2


@dataclass(frozen=True)
class LogFormat:
    """What a trainer adds to each log entry and shows of it.

    `fields(metrics, s_per_step)`: the interval's step metrics (on the host) and seconds per step
    (None for the first interval, which includes compilation) -> the trainer's own entry fields.
    `postfix(entry)`: the progress bar's fields. `line(entry)`: the line printed per log entry
    (after "step N/M") when no bar shows progress (None: the loss and the elapsed time). Both
    leave out a rate the entry does not have yet rather than show None or 0."""

    fields: Callable[[list[dict], float | None], dict]
    postfix: Callable[[dict], dict]
    line: Callable[[dict], str] | None = None


def _default_line(entry: dict) -> str:
    return f"loss {entry['loss']:.4f} elapsed {entry['elapsed_s']:.0f}s"


def _say(message: str) -> None:
    """A report line on stdout; while a bar is drawn, tqdm clears it, writes the line and redraws
    it below, so the line never lands on the bar's own line."""
    tqdm.write(message)
    sys.stdout.flush()


@contextmanager
def _through_bar():
    """While a bar is live, log records (of the root logger's console handlers, which the train
    CLI sets up) and warnings are written through tqdm as well."""
    def show(message, category, filename, lineno, file=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line)
        tqdm.write(text.rstrip("\n"), file=file or sys.stderr)

    shown = warnings.showwarning
    warnings.showwarning = show
    try:
        with logging_redirect_tqdm(tqdm_class=tqdm):
            yield
    finally:
        warnings.showwarning = shown


def run_training(state: Any, train_step: Callable, batch_fn: Callable[[int], Any],
                 tc: TrainConfig, work: Path, *, meta: dict, log: LogFormat,
                 evaluate: Callable[[Any], tuple[dict, str]] | None = None,
                 stop_after: int | None = None, progress: bool = True,
                 stop_at: float | None = None) -> tuple[Any, list[dict]]:
    """Train (or resume) to `tc.steps`; -> (final state, log entries).

    `state`: the fresh state, used when `work` holds no saved step. `train_step(state, batch)`
    -> (state, metrics with at least "loss" and "grad_norm"); `batch_fn(step)` -> that step's
    batch. `evaluate(state)` -> (validation fields for the log, a message), every
    `tc.eval_every` steps and at the last; None skips validation. `meta` is stored beside the
    entries. `stop_after` ends this invocation after that many completed steps (a planned
    interruption: the run can later be resumed to `tc.steps` with the same schedule); `stop_at`
    (a `time.perf_counter()` value) ends it, likewise resumable, at the first step finished
    after that time.
    """
    work.mkdir(parents=True, exist_ok=True)
    mgr = checkpoint_manager(work)
    state, start = restore_or_init(mgr, state)
    log_path = work / LOG_NAME
    entries = load_log(log_path, start)
    if start:
        _say(f"resuming from step {start} ({work / 'orbax'})")
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    pending, last_time, last_step = [], None, start
    elapsed = wall_seconds(entries) or 0.0
    mark = time.perf_counter()
    # A bar only on a terminal: redrawn with carriage returns into a file or pipe it would run
    # into the report lines, so there each log interval prints a line instead.
    live = progress and sys.stderr.isatty()
    line = log.line or _default_line
    # The next batches are built on host threads while the device runs this step (numpy's
    # copies release the GIL): on a fast accelerator, building a batch of saved hidden states
    # takes about as long as the step itself.
    with ThreadPoolExecutor(PREFETCH) as pool, \
            (_through_bar() if live else nullcontext()), tqdm(
            total=tc.steps, initial=start, disable=not live, mininterval=1.0,
            dynamic_ncols=True) as bar:
        ahead = {s: pool.submit(batch_fn, s) for s in range(start, min(start + PREFETCH, end))}
        for step in range(start, end):
            batch = ahead.pop(step).result()
            if step + PREFETCH < end:
                ahead[step + PREFETCH] = pool.submit(batch_fn, step + PREFETCH)
            state, metrics = train_step(state, batch)
            pending.append(metrics)
            done = step + 1
            out_of_time = stop_at is not None and done < end and time.perf_counter() > stop_at
            if done % tc.log_every == 0 or done == end or out_of_time:
                # One host sync per log interval; the first interval includes compilation, so
                # throughput is timed from the first log point on.
                got = jax.device_get(pending)
                now = time.perf_counter()
                s_step = (now - last_time) / (done - last_step) if last_time else None
                last_time, last_step = now, done
                elapsed, mark = elapsed + now - mark, now
                losses = [float(m["loss"]) for m in got]
                entries.append({"step": done, "loss": float(np.mean(losses)),
                                "step_losses": losses, "grad_norm": float(got[-1]["grad_norm"]),
                                "lr": float(lr_schedule(tc)(done - 1)),
                                "tokens": done * tc.tokens_per_step, **log.fields(got, s_step),
                                "elapsed_s": elapsed})
                pending = []
                if live:
                    bar.set_postfix(**log.postfix(entries[-1]), refresh=False)
                else:
                    _say(f"step {done}/{tc.steps} {line(entries[-1])}")
            bar.update(1)
            if evaluate is not None and (done % tc.eval_every == 0 or done == tc.steps):
                val, message = evaluate(state)
                entries.append({"step": done, **val})
                _say(f"step {done}: {message}")
                last_time = time.perf_counter()  # do not charge evaluation to training throughput
            if done % tc.save_every == 0 or done == end or out_of_time:
                mgr.save(done, args=ocp.args.StandardSave(state))
                write_log(log_path, entries, meta)
            if out_of_time:
                _say(f"out of time after step {done} of {tc.steps}")
                break
    mgr.wait_until_finished()
    mgr.close()
    write_log(log_path, entries, meta)
    return state, entries


def stopped_early(entries: list[dict], tc: TrainConfig) -> bool:
    """True (and says how to resume) when the log ends before `tc.steps`."""
    done = max((e["step"] for e in entries), default=0)
    if done < tc.steps:
        print(f"stopped after step {done} of {tc.steps}; rerun the same command to resume")
        return True
    return False
