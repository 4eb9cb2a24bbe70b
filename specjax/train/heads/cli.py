"""The command-line driver shared by `python -m specjax.train eagle3`, `mtp`, `pard`, `dflash`
and `dspark`: the common flags, and `run` (load the target, pick the data, train, report
acceptance, export)."""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specjax.models.registry import load_model, resolve_model_path
from specjax.models.config import DTYPES
from specjax.train.config import add_train_arguments, train_config_from_args
from specjax.train.export import compact_log
from specjax.train.heads.export import SIZE_LIMIT_BYTES, export_head
from specjax.train.heads.report import format_report
from specjax.train.heads.sources import DataSource, HiddenStatesSource, corpus_source
from specjax.train.heads.spec import KINDS, HeadSpec
from specjax.train.heads.training import train_head
from specjax.train.loop import stopped_early
from specjax.train.workdir import WORK_DIR, check_same_run

HEAD_TRAIN_DEFAULTS = dict(steps=600, batch_size=8, seq_len=256, lr=2e-3, warmup=50,
                           eval_every=100, save_every=50, eval_windows=16, weight_decay=0.0)


def add_arguments(p: argparse.ArgumentParser, kind: str) -> None:
    defaults = KINDS[kind]
    p.add_argument("--target", required=True,
                   help="the frozen target: a checkpoint folder, a GGUF file or a name "
                        "('bundled', 'smollm2'); loaded in float32")
    p.add_argument("--out", type=Path, required=True, help="export folder, e.g. checkpoints/<name>")
    p.add_argument("--depth", type=int, default=defaults.default_depth,
                   help="draft steps unrolled in training (TTT) and reported; a parallel "
                        "drafter's block")
    p.add_argument("--hidden-states", type=Path, default=None,
                   help="train from a SAVE_HIDDEN_STATES folder instead of the target's "
                        "corpus (default: the corpus named by the target's corpus_manifest.json)")
    p.add_argument("--step-weight", type=float, default=0.8,
                   help="loss weight of draft step j is step_weight^(j-1)")
    p.add_argument("--save-dtype", default=defaults.save_dtype,
                   choices=DTYPES,
                   help="dtype of the exported weights (loading casts to the target's)")
    add_train_arguments(p, HEAD_TRAIN_DEFAULTS)
    r = p.add_argument_group("run control")
    r.add_argument("--restart", action="store_true", help="discard saved steps under <out>/work")
    r.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps (resumable); default: run to --steps")
    r.add_argument("--max-seconds", type=float, default=None,
                   help="a time budget from start-up: training ends at the first step after it "
                        "and the head is exported as it stands (the log records the step; the "
                        "same command with more time resumes it)")
    r.add_argument("--report-windows", type=int, default=32,
                   help="validation windows in the final acceptance report")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress bar: print a line per log interval (also what happens when "
                        "stderr is not a terminal)")


@dataclass(frozen=True)
class _RunConfig:
    """What a resumed run must share with the saved one (besides the TrainConfig)."""

    head_spec: HeadSpec
    target: str
    hidden_states: str


def run(kind: str, args: argparse.Namespace, argv: list[str], spec_fields: Callable,
        export_fn: Callable) -> int:
    """Shared driver: spec_fields(target_config) -> the kind-specific HeadSpec fields;
    export_fn(out, head, target, spec, log) writes the weights (and may add to the log)."""
    started = time.perf_counter()
    out: Path = args.out
    work = out / WORK_DIR
    if args.restart:
        shutil.rmtree(work, ignore_errors=True)
    try:
        target_path = resolve_model_path(args.target)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--target: {e}") from None
    if target_path.is_dir() and not (target_path / "config.json").exists():
        raise SystemExit(f"--target: {target_path / 'config.json'} is missing")
    target = load_model(target_path, "float32")
    cfg = target.config
    spec = HeadSpec(kind=kind, depth=args.depth, num_layers=cfg.num_layers,
                    step_weight=args.step_weight, **spec_fields(cfg))
    out.mkdir(parents=True, exist_ok=True)
    if args.hidden_states is not None:
        source: DataSource = HiddenStatesSource(args.hidden_states, spec.needed_layers,
                                                cfg.hidden_size, f"{spec.label} ({kind})")
    else:
        if not target_path.is_dir():
            raise SystemExit(f"--target {args.target}: a GGUF target has no corpus here; pass "
                             "--hidden-states (python -m specjax.train data makes them)")
        source = corpus_source(target_path, work)
    top = source.max_token()
    if top >= cfg.vocab_size:
        raise SystemExit(f"the training data hold token id {top} >= the target's vocab_size "
                         f"{cfg.vocab_size}")
    tc = train_config_from_args(args)
    commands = check_same_run(work, _RunConfig(spec, str(args.target), str(args.hidden_states)),
                              tc, argv)
    print(f"{spec.label} head for {args.target} ({cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}); data: {source.description}; {tc.steps} "
          f"steps x {tc.batch_size} x {tc.seq_len} tokens, depth {spec.depth}", flush=True)
    stop_at = None if args.max_seconds is None else started + args.max_seconds
    head, entries = train_head(spec, tc, target, source, work, args.stop_after,
                               progress=not args.no_progress, stop_at=stop_at)
    if stopped_early(entries, tc) and stop_at is None:
        return 0
    batches = source.val_batches(min(tc.batch_size, 4), tc.seq_len, args.report_windows)
    start = time.perf_counter()
    # Whatever the head calibrates (DSpark's confidence) is fitted on these windows first.
    report = spec.head_kind.report(spec, head, target, batches, fit=True)
    report["seconds"] = time.perf_counter() - start
    table = format_report(report, f"{spec.label} acceptance on the validation split "
                                  f"(greedy, {'block' if spec.parallel else 'chain'} of "
                                  f"{spec.depth}):")
    print(table, flush=True)
    log = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "commands": commands, "head_spec": dataclasses.asdict(spec),
           "train_config": dataclasses.asdict(tc), "data": source.description,
           "report": report, "vocab_size": cfg.vocab_size, "entries": compact_log(entries),
           "steps_done": max((e["step"] for e in entries), default=0)}
    size = export_head(out, head, target, spec, args, log, table, export_fn)
    print(f"exported {out} ({size / 1e6:.2f} MB <= {SIZE_LIMIT_BYTES / 1e6:.0f} MB): E[AL] "
          f"{report['expected_acceptance_length']:.3f} at depth {spec.depth}", flush=True)
    return 0
