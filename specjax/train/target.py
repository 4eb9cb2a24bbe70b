"""Train the bundled target model: `python -m specjax.train target --out checkpoints/<name>`.

Parameters and optimizer state are one pytree that is passed to (and donated by) a jitted step, and
checkpointed with orbax under `<out>/work/orbax/`. Batches are a pure function of (seed, step), so a run
restarted after a crash resumes from the last saved step and continues the same loss curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tokenizers import Tokenizer
from tqdm import tqdm

from specjax.models import Llama, ModelConfig
from specjax.train import corpus, data
from specjax.train import tokenizer_training as toks
from specjax.train.evaluate import cross_entropy, loss_over_windows
from specjax.train.export import export, write_model_card

WORK_DIR = "work"  # under --out; holds orbax checkpoints, token caches and logs; not committed
LOG_NAME = "training_log.json"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 32  # periodic validation uses the first windows only; the export uses all
    save_every: int = 100

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, tc.warmup, max(tc.steps, tc.warmup + 1), end_value=tc.lr * tc.min_lr_ratio
    )


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    # Norm gains are scale parameters around 1; decaying them towards 0 only hurts.
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params
    )
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(lr_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask),
    )


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int):
    """-> (graphdef, state) where state = {"params": nnx.State, "opt_state": optax state}."""
    model = Llama(model_cfg, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    state = {"params": params, "opt_state": tx.init(params)}
    # Orbax restores committed arrays, and committedness is part of jit's cache key: commit the fresh
    # state too, so a fresh and a resumed run share one compiled step.
    return graphdef, jax.device_put(state, jax.devices()[0])


@lru_cache(maxsize=8)
def make_train_step(graphdef: nnx.GraphDef, tc: TrainConfig):
    """Cached on (graphdef, tc), so repeated runs in one process (tests, notebooks) compile once."""
    tx = make_optimizer(tc)

    @partial(jax.jit, donate_argnums=0)
    def train_step(state: dict, batch: jax.Array) -> tuple[dict, dict]:
        """batch `[B, T + 1]` int32 -> (new state, {"loss", "grad_norm"})."""

        def loss_fn(params):
            return cross_entropy(nnx.merge(graphdef, params)(batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return train_step


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


def _load_log(path: Path, upto: int) -> list[dict]:
    """Log entries up to the resumed step: later ones belong to work that was lost."""
    if not path.exists():
        return []
    return [e for e in json.loads(path.read_text())["entries"] if e["step"] <= upto]


def _write_log(path: Path, entries: list[dict], meta: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**meta, "entries": entries}, indent=0) + "\n")
    tmp.replace(path)


def train(model_cfg: ModelConfig, tc: TrainConfig, train_stream: np.ndarray, val_stream: np.ndarray,
          work: Path, stop_after: int | None = None, progress: bool = True) -> tuple[nnx.Module, list[dict]]:
    """Train (or resume) to `tc.steps`; returns the model and the log entries.

    `stop_after` ends this invocation after that many completed steps (a planned interruption: the run
    can later be resumed to `tc.steps` with the same schedule).
    """
    work.mkdir(parents=True, exist_ok=True)
    tx = make_optimizer(tc)
    graphdef, state = init_state(model_cfg, tx, tc.seed)
    mgr = checkpoint_manager(work)
    state, start = restore_or_init(mgr, state)
    log_path = work / LOG_NAME
    entries = _load_log(log_path, start)
    meta = {"model_config": dataclasses.asdict(model_cfg), "train_config": dataclasses.asdict(tc)}
    if start:
        tqdm.write(f"resuming from step {start} ({work / 'orbax'})")
    train_step = make_train_step(graphdef, tc)
    val = data.eval_windows(val_stream, tc.seq_len, tc.eval_windows)
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    pending, last_time, last_step = [], None, start
    # Wall time summed over invocations, so a resumed run still reports its total cost.
    elapsed = next((e["elapsed_s"] for e in reversed(entries) if "elapsed_s" in e), 0.0)
    mark = time.perf_counter()
    bar = tqdm(range(start, end), initial=start, total=tc.steps, disable=not progress,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, dynamic_ncols=True)
    for step in bar:
        batch = jnp.asarray(data.batch_for_step(train_stream, tc.seed, step, tc.batch_size, tc.seq_len))
        state, metrics = train_step(state, batch)
        pending.append(metrics)
        done = step + 1
        if done % tc.log_every == 0 or done == end:
            # One host sync per log interval; the first interval includes compilation, so throughput
            # is timed from the first log point on.
            losses = [float(m["loss"]) for m in pending]
            now = time.perf_counter()
            tok_s = (done - last_step) * tc.tokens_per_step / (now - last_time) if last_time else None
            last_time, last_step = now, done
            elapsed, mark = elapsed + now - mark, now
            entries.append({"step": done, "loss": float(np.mean(losses)), "step_losses": losses,
                            "grad_norm": float(pending[-1]["grad_norm"]),
                            "lr": float(lr_schedule(tc)(done - 1)), "tokens": done * tc.tokens_per_step,
                            "tokens_per_s": tok_s, "elapsed_s": elapsed})
            pending = []
            bar.set_postfix(loss=f"{entries[-1]['loss']:.3f}", tok_s=f"{tok_s or 0:.0f}", refresh=False)
        if len(val) and (done % tc.eval_every == 0 or done == tc.steps):
            val_loss = loss_over_windows(nnx.merge(graphdef, state["params"]), val)
            entries.append({"step": done, "val_loss": val_loss})
            tqdm.write(f"step {done}: val_loss {val_loss:.4f} (first {len(val)} windows)")
            last_time = time.perf_counter()  # do not charge evaluation to training throughput
        if done % tc.save_every == 0 or done == end:
            mgr.save(done, args=ocp.args.StandardSave(state))
            _write_log(log_path, entries, meta)
    mgr.wait_until_finished()
    mgr.close()
    _write_log(log_path, entries, meta)
    return nnx.merge(graphdef, state["params"]), entries


# -- command line -------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="export folder, e.g. checkpoints/<name>")
    m = p.add_argument_group("model")
    m.add_argument("--vocab-size", type=int, default=4096)
    m.add_argument("--d-model", type=int, default=256)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=4)
    m.add_argument("--head-dim", type=int, default=32)
    m.add_argument("--ffn", type=int, default=704, help="MLP intermediate size")
    m.add_argument("--max-position", type=int, default=1024)
    m.add_argument("--rope-theta", type=float, default=10000.0)
    m.add_argument("--dtype", default="float32", help="parameter/compute dtype while training")
    t = p.add_argument_group("training")
    for field in dataclasses.fields(TrainConfig):
        t.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    r = p.add_argument_group("run control")
    r.add_argument("--resume", action="store_true",
                   help="require a saved step to resume from (a run always resumes when one exists)")
    r.add_argument("--restart", action="store_true", help="discard saved steps, tokenizer and manifest")
    r.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (resumable)")
    r.add_argument("--export-dtype", default="float32", help="dtype of the exported model.safetensors")
    r.add_argument("--no-progress", action="store_true")


def prepare_corpus(out: Path, vocab_size: int) -> tuple[Tokenizer, dict, np.ndarray, np.ndarray]:
    """-> (tokenizer, manifest, train `[N]`, val `[M]`). A resumed run reuses the saved manifest and
    tokenizer, so its data are the ones the interrupted run used."""
    manifest_path = out / corpus.MANIFEST_NAME
    if manifest_path.exists():
        manifest = corpus.load_manifest(manifest_path)
        corpus.warn_if_mismatched(manifest)
    else:
        manifest = corpus.build_manifest()
        corpus.write_manifest(manifest, manifest_path)
    if (out / toks.TOKENIZER_NAME).exists():
        tok = toks.load_tokenizer(out)
    else:
        tok = toks.train_tokenizer(corpus.read_documents(manifest, "train"), vocab_size)
        toks.save_tokenizer(tok, out)
    bos = toks.special_token_id(tok)
    work = out / WORK_DIR
    train_stream = data.cached_stream(work / "tokens_train.npy", tok, corpus.read_documents(manifest, "train"), bos)
    val_stream = data.cached_stream(work / "tokens_val.npy", tok, corpus.read_documents(manifest, "val"), bos)
    return tok, manifest, train_stream, val_stream


def run(args: argparse.Namespace, argv: list[str]) -> int:
    out: Path = args.out
    work = out / WORK_DIR
    if args.restart:
        shutil.rmtree(work, ignore_errors=True)
        for name in (corpus.MANIFEST_NAME, toks.TOKENIZER_NAME):
            (out / name).unlink(missing_ok=True)
    if args.resume and not (work / "orbax").exists():
        raise SystemExit(f"--resume: nothing saved under {work / 'orbax'}")
    out.mkdir(parents=True, exist_ok=True)
    tok, manifest, train_stream, val_stream = prepare_corpus(out, args.vocab_size)
    bos = toks.special_token_id(tok)
    model_cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.d_model, intermediate_size=args.ffn,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.max_position, rope_theta=args.rope_theta, tie_word_embeddings=True,
        dtype=args.dtype, bos_token_id=bos, eos_token_id=bos, model_type="llama",
    )
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    commands = _check_same_run(work, model_cfg, tc, "python -m specjax.train " + shlex.join(argv))
    print(f"corpus: {len(train_stream):,} train / {len(val_stream):,} val tokens; model: "
          f"{model_cfg.num_params:,} params; {tc.steps} steps x {tc.tokens_per_step} tokens", flush=True)
    model, entries = train(model_cfg, tc, train_stream, val_stream, work, args.stop_after,
                           progress=not args.no_progress)
    done = max((e["step"] for e in entries), default=0)
    if done < tc.steps:
        print(f"stopped after step {done} of {tc.steps}; rerun the same command to resume")
        return 0
    meta = {"model_config": dataclasses.asdict(model_cfg), "train_config": dataclasses.asdict(tc)}
    export(out, model, entries, meta, args.export_dtype)
    val = data.eval_windows(val_stream, tc.seq_len)
    val_loss = loss_over_windows(model, val)
    target = getattr(args, "target", None)  # set when `train draft` delegates here
    write_model_card(
        out, model, tok, name=out.name, commands=commands,
        role=f"a draft model for {target.name}" if target else "the bundled specjax target model",
        eval_command=f"python -m specjax.train eval --model {out} --seq-len {tc.seq_len}",
        val_loss=val_loss, val_tokens=len(val_stream), tokens_seen=tc.steps * tc.tokens_per_step,
        train_meta=meta, manifest=manifest,
        wall_s=next((e["elapsed_s"] for e in reversed(entries) if "elapsed_s" in e), None),
    )
    print(f"exported {out}: validation loss {val_loss:.4f}")
    return 0


def _check_same_run(work: Path, model_cfg: ModelConfig, tc: TrainConfig, command: str) -> list[str]:
    """Resuming with other flags would silently mix two runs; refuse instead.

    Returns every command that contributed to this run, for the model card."""
    path = work / "run_config.json"
    current = {"model_config": dataclasses.asdict(model_cfg), "train_config": dataclasses.asdict(tc)}
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
    commands.append(command)
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**current, "commands": commands}, indent=1) + "\n")
    return commands

