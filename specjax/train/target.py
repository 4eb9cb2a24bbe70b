"""Train the bundled target model: `python -m specjax.train target --out checkpoints/<name>`.

Parameters and optimizer state are one pytree that is passed to (and donated by) a jitted step; the
shared loop (`specjax.train.loop`) checkpoints it with orbax under `<out>/work/orbax/`, so a run
restarted after a crash resumes from the last saved step and continues the same loss curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from functools import lru_cache, partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer

from specjax.models import Llama, ModelConfig
from specjax.models.bamba import Bamba
from specjax.models.config import ATTENTION, MAMBA, MambaConfig
from specjax.train import corpus, data
from specjax.train import tokenizer_training as toks
from specjax.train.config import TrainConfig, add_train_arguments, make_optimizer, train_config_from_args
from specjax.train.evaluate import cross_entropy, loss_over_windows
from specjax.train.export import export, write_model_card
from specjax.train.loop import LogFormat, run_training, stopped_early
from specjax.train.workdir import WORK_DIR, check_same_run, wall_seconds


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int):
    """-> (graphdef, state) where state = {"params": nnx.State, "opt_state": optax state}."""
    model = (Bamba if model_cfg.is_hybrid else Llama)(model_cfg, rngs=nnx.Rngs(seed))
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


def _meta(model_cfg: ModelConfig, tc: TrainConfig) -> dict:
    return {"model_config": dataclasses.asdict(model_cfg), "train_config": dataclasses.asdict(tc)}


def target_log_format(tc: TrainConfig) -> LogFormat:
    """Loss and tokens/s; the first interval includes compilation, so it shows no rate."""

    def postfix(e: dict) -> dict:
        shown = {"loss": f"{e['loss']:.3f}"}
        if e["tokens_per_s"] is not None:
            shown["tok_s"] = f"{e['tokens_per_s']:.0f}"
        return shown

    def line(e: dict) -> str:
        rate = "" if e["tokens_per_s"] is None else f" tok/s {e['tokens_per_s']:.0f}"
        return f"loss {e['loss']:.4f}{rate} elapsed {e['elapsed_s']:.0f}s"

    return LogFormat(
        fields=lambda got, s_step: {"tokens_per_s": tc.tokens_per_step / s_step if s_step else None},
        postfix=postfix, line=line)


def train(model_cfg: ModelConfig, tc: TrainConfig, train_stream: np.ndarray, val_stream: np.ndarray,
          work: Path, stop_after: int | None = None, progress: bool = True) -> tuple[nnx.Module, list[dict]]:
    """Train (or resume) to `tc.steps`; returns the model and the log entries.

    `stop_after` ends this invocation after that many completed steps (a planned interruption: the run
    can later be resumed to `tc.steps` with the same schedule).
    """
    graphdef, state = init_state(model_cfg, make_optimizer(tc), tc.seed)
    val = data.eval_windows(val_stream, tc.seq_len, tc.eval_windows)

    def evaluate(state: dict) -> tuple[dict, str]:
        val_loss = loss_over_windows(nnx.merge(graphdef, state["params"]), val)
        return {"val_loss": val_loss}, f"val_loss {val_loss:.4f} (first {len(val)} windows)"

    log = target_log_format(tc)

    def batch(step: int) -> jax.Array:
        return jnp.asarray(data.batch_for_step(train_stream, tc.seed, step, tc.batch_size, tc.seq_len))

    state, entries = run_training(state, make_train_step(graphdef, tc), batch, tc, work,
                                  meta=_meta(model_cfg, tc), log=log,
                                  evaluate=evaluate if len(val) else None, stop_after=stop_after,
                                  progress=progress)
    return nnx.merge(graphdef, state["params"]), entries


# -- command line -------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="export folder, e.g. checkpoints/<name>")
    m = p.add_argument_group("model")
    m.add_argument("--vocab-size", type=int, default=4096,
                   help="BPE vocabulary of the tokenizer trained on the corpus (none is trained "
                        "when --out already holds tokenizer.json: a resumed run or a draft "
                        "keeps that one)")
    m.add_argument("--d-model", type=int, default=256, help="hidden size")
    m.add_argument("--layers", type=int, default=8, help="decoder layers")
    m.add_argument("--heads", type=int, default=8, help="attention (query) heads")
    m.add_argument("--kv-heads", type=int, default=4, help="key/value heads (grouped-query attention)")
    m.add_argument("--head-dim", type=int, default=32, help="width of each attention head")
    m.add_argument("--ffn", type=int, default=704, help="MLP intermediate size")
    m.add_argument("--max-position", type=int, default=1024,
                   help="longest sequence the model is configured for (config.json's "
                        "max_position_embeddings)")
    m.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base frequency")
    m.add_argument("--dtype", default="float32", help="parameter/compute dtype while training")
    m.add_argument("--layer-pattern", default=None,
                   help="a hybrid (Bamba): one letter per layer, A = attention, M = Mamba-2 "
                        "mixer, e.g. MMAMMA; default: every layer attends (Llama)")
    m.add_argument("--mamba-heads", type=int, default=8, help="Mamba-2 heads (hybrids)")
    m.add_argument("--mamba-state", type=int, default=16, help="Mamba-2 state size N (hybrids)")
    m.add_argument("--mamba-groups", type=int, default=1, help="Mamba-2 B/C groups (hybrids)")
    m.add_argument("--mamba-expand", type=int, default=2,
                   help="Mamba-2 inner width / hidden size (hybrids)")
    add_train_arguments(p)
    r = p.add_argument_group("run control")
    r.add_argument("--resume", action="store_true",
                   help="require a saved step to resume from (a run always resumes when one exists)")
    r.add_argument("--restart", action="store_true", help="discard saved steps, tokenizer and manifest")
    r.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps (resumable); default: run to --steps")
    r.add_argument("--export-dtype", default="float32", help="dtype of the exported model.safetensors")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress bar: print a line per log interval (also what happens when "
                        "stderr is not a terminal)")


def hybrid_fields(args: argparse.Namespace) -> dict:
    """The ModelConfig fields of `--layer-pattern` (nothing for an all-attention model)."""
    pattern = (getattr(args, "layer_pattern", None) or "").upper()
    if not pattern or set(pattern) == {"A"}:
        if pattern and len(pattern) != args.layers:
            raise SystemExit(f"--layer-pattern has {len(pattern)} letters for {args.layers} layers")
        return {}
    if len(pattern) != args.layers or not set(pattern) <= {"A", "M"}:
        raise SystemExit(f"--layer-pattern must be {args.layers} letters of A and M, got "
                         f"{args.layer_pattern!r}")
    inner = args.mamba_expand * args.d_model
    if inner % args.mamba_heads:
        raise SystemExit(f"--mamba-heads {args.mamba_heads} must divide --mamba-expand x "
                         f"--d-model ({inner})")
    return dict(model_type="bamba", partial_rotary_factor=0.5,
                layer_types=tuple(ATTENTION if c == "A" else MAMBA for c in pattern),
                mamba=MambaConfig(num_heads=args.mamba_heads, head_dim=inner // args.mamba_heads,
                                  num_groups=args.mamba_groups, state_size=args.mamba_state))


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
        dtype=args.dtype, bos_token_id=bos, eos_token_id=bos,
        **({"model_type": "llama"} | hybrid_fields(args)),
    )
    tc = train_config_from_args(args)
    commands = check_same_run(work, model_cfg, tc, argv)
    print(f"corpus: {len(train_stream):,} train / {len(val_stream):,} val tokens; model: "
          f"{model_cfg.num_params:,} params; {tc.steps} steps x {tc.tokens_per_step} tokens", flush=True)
    model, entries = train(model_cfg, tc, train_stream, val_stream, work, args.stop_after,
                           progress=not args.no_progress)
    if stopped_early(entries, tc):
        return 0
    meta = _meta(model_cfg, tc)
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
        wall_s=wall_seconds(entries),
    )
    print(f"exported {out}: validation loss {val_loss:.4f}")
    return 0


