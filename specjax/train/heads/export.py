"""The export folder of a trained head: weights (written by the kind's exporter), the training
log, the model card, and the size check every shipped head must pass."""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Callable

import jax

from specjax.train.heads.spec import HeadSpec
from specjax.train.workdir import LOG_NAME, hardware, wall_seconds

# Every shipped head folder stays under this: checkpoints/ holds at most 80 MB in all.
SIZE_LIMIT_BYTES = 24_000_000


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def check_size(folder: Path, limit: int = SIZE_LIMIT_BYTES) -> int:
    size = folder_bytes(folder)
    if size > limit:
        raise SystemExit(f"{folder} holds {size / 1e6:.2f} MB > the {limit / 1e6:.0f} MB limit for "
                         "a shipped head (use a smaller --draft-vocab or --save-dtype bfloat16)")
    return size


def export_head(out: Path, head, target, spec: HeadSpec, args: argparse.Namespace, log: dict,
                table: str, export_fn: Callable) -> int:
    """Replace the folder's previous export; -> its size in bytes (checked against the limit).
    export_fn(out, head, target, spec, log) writes the weights (and may add to the log)."""
    for name in ("model.safetensors", "config.json", "MODEL_CARD.md", LOG_NAME):
        (out / name).unlink(missing_ok=True)
    export_fn(out, head, target, spec, log)
    (out / LOG_NAME).write_text(json.dumps(log, indent=0) + "\n")
    write_model_card(out, spec, args, log, table)
    return check_size(out)


def write_model_card(out: Path, spec: HeadSpec, args: argparse.Namespace, log: dict,
                     table: str) -> None:
    tc = log["train_config"]
    done = log.get("steps_done", tc["steps"])
    wall = wall_seconds(log["entries"])
    val = next((e for e in reversed(log["entries"]) if "val_loss" in e), None)
    card = spec.head_kind.card(spec, Path(args.target).name, out, log)
    lines = [
        f"# {out.name}: {spec.label} draft head for {Path(args.target).name}\n",
        f"{card.what[0].upper()}{card.what[1:]}. Trained by `specjax.train` on the frozen target's own "
        "predictions; the target's weights are unchanged.\n",
        "## Files\n",
        f"- weights: {card.files}; {folder_bytes(out) / 1e6:.1f} MB in all "
        f"(the exporter refuses more than {SIZE_LIMIT_BYTES / 1e6:.0f} MB)",
        f"- use: `specjax.LLM(\"{args.target}\", speculative_config={card.use})`",
        "- `training_log.json`: arguments, loss curve, the report below\n",
        "## Training\n",
        f"- command: `{log['commands'][-1]}`",
        *(["- resumed; invocations in order: " + "; ".join(f"`{c}`" for c in log["commands"])]
          if len(log["commands"]) > 1 else []),
        f"- data: {log['data']}",
        f"- labels: {card.labels}",
        f"- {done} steps of {tc['batch_size']} x {tc['seq_len']} tokens"
        + (f" (of {tc['steps']} planned: the time budget ended the run)" if done < tc["steps"]
           else "") + f"; AdamW (b1 "
        f"{tc['b1']}, b2 {tc['b2']}, weight decay {tc['weight_decay']}), peak lr {tc['lr']:g}, "
        f"{tc['warmup']} warm-up steps, cosine to {tc['lr'] * tc['min_lr_ratio']:g}, clip "
        f"{tc['clip_norm']}",
        f"- hardware: {hardware()}, JAX {jax.__version__}"
        + (f", {wall / 60:.0f} min wall time" if wall else ""),
        *([f"- final validation loss {val['val_loss']:.4f} (first {tc['eval_windows']} windows)"]
          if val else []),
        "\n## Acceptance (validation split)\n",
        "Greedy decoding: depth k agrees when the head's top-1 token equals the target's own "
        "argmax choice k tokens ahead; conditional agreement is over anchors whose depths "
        "1..k-1 all agreed; E[AL] = 1 + mean number of leading agreeing depths (tokens per "
        "target step).\n",
        *([card.notes] if card.notes else []),
        table,
        f"\n_Exported {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC._\n",
    ]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))
