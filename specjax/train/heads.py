"""Train EAGLE-3 and MTP draft heads on a frozen target's hidden states.

`python -m specjax.train eagle3 --target DIR --out DIR` and `python -m specjax.train mtp ...`
(the subcommand modules `specjax.train.eagle3` / `specjax.train.mtp` are thin wrappers around
this one). The target is never trained: every batch runs its dense forward inside the jitted
step, capturing the residual streams the head reads, and its own next-token distribution is the
label (soft targets: distillation, not the corpus's next token).

Alignment. A training window holds tokens x[0..T] (T + 1 of them) and the target's outputs at
each of those rows. Head row t reads the hidden state at t and the embedding of token t+1 and
predicts token t+2: its label is the target's distribution at row t+1. Draft step j (1-based) of
anchor row t feeds the embedding of token t+j and is labelled with the target's distribution at
row t+j; it is masked when t+j runs off the window.

The chain (EAGLE-3, and MTP-Eagle = one MTP module reused), unrolled over K = --depth steps
exactly as the engine drafts ("training-time test"):

    step 1, every row t:  hidden = fuse(captured) (EAGLE-3) / the target's last residual stream
                          (MTP-Eagle), token t+1, position t, causal attention over rows <= t
    step j >= 2, anchor t: hidden = step j-1's hidden_out at row t, token t+j, position t+j-1;
                          the query attends to the step-1 keys of rows <= t (the head's KV cache
                          of the accepted prefix) plus the keys that steps 2..j produced at the
                          same anchor row t (the chain so far, itself included).

`chain_attention` computes this as one score matrix: the causal block over step-1 keys
concatenated with the per-row "diagonal" keys, softmax in float32.

Vanilla MTP (--num-modules N > 1) trains the dense chain of `MTPHeads.forward`: module j reads
module j-1's hidden_out at the same row, the embedding of token t+j and position t, with causal
attention over module j's own rows.

Loss: sum over steps j of step_weight^(j-1) x the mean soft cross-entropy of step j. For an
EAGLE-3 head with a reduced draft vocabulary the target's logits are gathered at the draft ids
and renormalised (as the public EAGLE-3 recipe does).

The final report (validation split) is what the engine's greedy acceptance would be. For the
chain heads it is exact: the target's greedy continuation g_1..g_K of each anchor is computed
with a tree-masked target forward (every anchor's continuation in one sequence), the head's
chain is fed g_1..g_{K-1} (what it drafts whenever it agrees), and depth k agrees when the
head's top-1 token equals g_k. E[AL] = 1 + mean over anchors of the number of leading depths
that agree. Vanilla MTP's modules cannot take a per-anchor input in the dense chain, so its
report is teacher-forced on the corpus tokens (labels: the target's argmax at row t+k).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from specjax.engine.hidden_states import read_hidden_states
from specjax.models import Llama, load_hf_checkpoint
from specjax.models.llama import layer_windows
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.models.mtp_head import MTPHeads, target_lm_head
from specjax.train import corpus, data
from specjax.train import tokenizer_training as toks
from specjax.train.export import compact_log
from specjax.train.target import (LOG_NAME, WORK_DIR, TrainConfig, _check_same_run, _load_log,
                                  _write_log, checkpoint_manager, lr_schedule, make_optimizer,
                                  restore_or_init)

SIZE_LIMIT_BYTES = 10_000_000  # every shipped head folder must stay under 10 MB


# ---------------------------------------------------------------------------------------------
# What is trained
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSpec:
    """A head training run's shape (frozen, hashable: a jit static argument).

    kind "eagle3": `capture_layers` are the three fused target layers and `draft_vocab` the
    head's output width. kind "mtp": `num_modules` MTP modules; one module is MTP-Eagle (the
    chain), more is vanilla MTP (the dense chain)."""

    kind: str
    depth: int
    num_layers: int                         # the target's
    capture_layers: tuple[int, ...] = ()
    draft_vocab: int = 0
    num_modules: int = 0
    step_weight: float = 0.8

    def __post_init__(self):
        if self.kind not in ("eagle3", "mtp"):
            raise ValueError(f"unknown head kind {self.kind!r}")
        if self.depth < 1:
            raise ValueError(f"--depth must be >= 1, got {self.depth}")
        if self.kind == "eagle3":
            layers = self.capture_layers
            if len(layers) != 3 or len(set(layers)) != 3 or list(layers) != sorted(layers):
                raise ValueError(f"--layers must be 3 distinct ascending layers, got {list(layers)}")
            bad = [x for x in layers if not 0 <= x < self.num_layers]
            if bad:
                raise ValueError(f"--layers {list(layers)}: {bad} outside the target's "
                                 f"{self.num_layers} layers (0..{self.num_layers - 1})")
        else:
            if self.num_modules < 1:
                raise ValueError(f"--num-modules must be >= 1, got {self.num_modules}")
            if self.num_modules > 1 and self.depth > self.num_modules:
                raise ValueError(f"--depth {self.depth} exceeds --num-modules {self.num_modules}: "
                                 "vanilla MTP drafts one token per module")

    @property
    def chain(self) -> bool:
        """True for the training-time-test chain (EAGLE-3, MTP-Eagle); False for the dense
        vanilla-MTP chain."""
        return self.kind == "eagle3" or self.num_modules == 1

    @property
    def needed_layers(self) -> tuple[int, ...]:
        """Target layers whose residual streams a batch needs: the head's inputs, then L - 1."""
        return (*self.capture_layers, self.num_layers - 1)

    @property
    def label(self) -> str:
        if self.kind == "eagle3":
            return "EAGLE-3"
        return "MTP-Eagle" if self.num_modules == 1 else f"MTP ({self.num_modules} modules)"


def draft_vocab_maps(counts: np.ndarray, draft_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The `draft_vocab` most frequent target ids (ties: lower id first), in ascending id order,
    as the public EAGLE-3 maps: (d2t `[draft_vocab]` int32 with target = draft + d2t[draft],
    t2d `[V]` bool)."""
    V = len(counts)
    if not 0 < draft_vocab <= V:
        raise ValueError(f"--draft-vocab must be in [1, {V}], got {draft_vocab}")
    ids = np.sort(np.argsort(-np.asarray(counts, np.int64), kind="stable")[:draft_vocab])
    d2t = (ids - np.arange(draft_vocab)).astype(np.int32)
    t2d = np.zeros((V,), bool)
    t2d[ids] = True
    return d2t, t2d


def new_head(spec: HeadSpec, target: Llama, seed: int, counts: np.ndarray | None = None):
    """A freshly initialised head for `target`, warm-started where the target offers a prior:
    the input projection starts as (random init +) the identity on the deepest hidden state
    (EAGLE-3: fc passes the highest captured layer through; MTP: eh_proj passes hnorm(hidden)
    through), so the head's residual stream starts as the target's; the output side is the
    target's (EAGLE-3: lm_head = the target's LM head at the draft ids; the final norms = the
    target's final norm). Everything else is the heads' own random init."""
    rngs = nnx.Rngs(seed)
    H = target.config.hidden_size
    eye = jnp.eye(H, dtype=jnp.dtype(target.config.dtype))
    final_norm = jnp.array(target.final_norm[...], copy=True)  # never share a buffer (donation)
    if spec.kind == "mtp":
        heads = MTPHeads(target.config, spec.num_modules, rngs=rngs)
        for module in heads.modules:
            module.final_norm[...] = jnp.array(final_norm, copy=True)
            module.eh_proj[...] = module.eh_proj[...].at[H:].add(eye)
        return heads
    config = Eagle3HeadConfig.for_target(target.config, draft_vocab_size=spec.draft_vocab,
                                         aux_hidden_state_layers=spec.capture_layers)
    head = Eagle3Head(config, rngs=rngs)
    head.fc[...] = head.fc[...].at[2 * H:].add(eye)
    if spec.draft_vocab < target.config.vocab_size:
        if counts is None:
            raise ValueError("a reduced draft vocabulary needs the training token counts")
        d2t, t2d = draft_vocab_maps(counts, spec.draft_vocab)
        head.d2t[...] = jnp.asarray(d2t)
        head.t2d[...] = jnp.asarray(t2d)
    ids = head.to_target_ids(jnp.arange(spec.draft_vocab))
    head.lm_head[...] = jnp.take(target_lm_head(target), ids, axis=1).astype(head.lm_head.dtype)
    head.norm[...] = final_norm
    return head


# ---------------------------------------------------------------------------------------------
# The chain
# ---------------------------------------------------------------------------------------------


def chain_attention(q: jax.Array, k1: jax.Array, v1: jax.Array,
                    diag_k: list[jax.Array] = (), diag_v: list[jax.Array] = ()) -> jax.Array:
    """Attention of a chain step, one query per anchor row.

    q `[B, T, heads, hd]` (the query of anchor row t); k1, v1 `[B, T, kv, hd]`: step-1 keys and
    values by row, of which row t's query sees rows <= t; diag_k, diag_v: lists of
    `[B, T, kv, hd]`, the keys/values later chain steps produced at the same anchor row (each
    seen only by that row's query). Scores are concatenated [causal block | diagonal] and
    softmaxed in float32. -> `[B, T, heads, hd]`.
    """
    B, T, Hq, hd = q.shape
    KV = k1.shape[2]
    G = Hq // KV
    scale = hd ** -0.5
    f32 = jnp.float32
    # Heads-major batched matmuls, as in `dense_attention` (faster than einsum on XLA:CPU).
    qh = q.reshape(B, T, KV, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, KV, T * G, hd)
    kh, vh = k1.transpose(0, 2, 1, 3), v1.transpose(0, 2, 1, 3)  # [B, KV, T, hd]
    scores = jnp.matmul(qh, kh.swapaxes(-1, -2)).astype(f32) * scale  # [B, KV, T*G, T]
    causal = (jnp.arange(T * G) // G)[:, None] >= jnp.arange(T)[None, :]
    scores = jnp.where(causal, scores, -jnp.inf)
    J = len(diag_k)
    if J:
        dk = jnp.stack(diag_k, axis=3)  # [B, T, KV, J, hd]
        dv = jnp.stack(diag_v, axis=3)
        q5 = q.reshape(B, T, KV, G, hd)
        diag = jnp.matmul(q5, dk.swapaxes(-1, -2)).astype(f32) * scale  # [B, T, KV, G, J]
        diag = diag.transpose(0, 2, 1, 3, 4).reshape(B, KV, T * G, J)
        scores = jnp.concatenate([scores, diag], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.matmul(probs[..., :T].astype(v1.dtype), vh)  # [B, KV, T*G, hd]
    out = out.reshape(B, KV, T, G, hd).transpose(0, 2, 1, 3, 4)  # [B, T, KV, G, hd]
    if J:
        pd = probs[..., T:].reshape(B, KV, T, G, J).transpose(0, 2, 1, 3, 4)  # [B, T, KV, G, J]
        out = out + jnp.matmul(pd.astype(dv.dtype), dv)
    return out.reshape(B, T, Hq, hd).astype(q.dtype)


def chain_hidden_outs(qkv_fns: list[Callable], finish_fns: list[Callable], hidden1: jax.Array,
                      step_embeds: jax.Array, positions: jax.Array, ttt: bool = True
                      ) -> list[jax.Array]:
    """Unroll K = len(step_embeds) draft steps. hidden1 `[B, T, H]`; step_embeds `[K, B, T, H]`
    (step j's input-token embedding at each anchor row); positions `[B, T]` (the rows').

    ttt=True: the EAGLE-style chain (step j at position t+j-1, causal prefix of step-1 keys plus
    the diagonal). ttt=False: the dense vanilla-MTP chain (every step at position t, causal over
    its own rows). -> K hidden_outs `[B, T, H]`."""
    hidden, outs = hidden1, []
    k1 = v1 = None
    diag_k, diag_v = [], []
    for j in range(step_embeds.shape[0]):
        pos = positions + j if ttt else positions
        q, k, v, residual = qkv_fns[j](step_embeds[j], hidden, pos)
        if j == 0 or not ttt:
            k1, v1 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        hidden = finish_fns[j](chain_attention(q, k1, v1, diag_k, diag_v), residual)
        outs.append(hidden)
    return outs


def run_chain(spec: HeadSpec, head, target: Llama, captured: jax.Array, step_tokens: jax.Array
              ) -> list[jax.Array]:
    """The head's logits for every chain step: captured `[len(needed_layers), B, >=T, H]` (the
    target's residual streams by row), step_tokens `[K, B, T]` (step j's input token at each
    anchor row). -> K arrays `[B, T, draft vocab]` (float32)."""
    K, B, T = step_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    embeds = target.embed_tokens(step_tokens.reshape(K * B, T)).reshape(K, B, T, -1)
    if spec.kind == "eagle3":
        hidden1 = head.fuse(captured[:3, :, :T])
        modules = [head] * K
        logits = [head.logits] * K
    else:
        hidden1 = captured[-1, :, :T]
        modules = [head.module_for_step(j) for j in range(K)]
        lm_head = target_lm_head(target)
        logits = [partial(m.logits, lm_head=lm_head) for m in modules]
    outs = chain_hidden_outs([m.qkv_and_residual for m in modules], [m.finish for m in modules],
                             hidden1, embeds, positions, ttt=spec.chain)
    return [fn(h) for fn, h in zip(logits, outs)]


def shift_rows(x: jax.Array, shift: int, rows: int, axis: int = 1, fill=0) -> jax.Array:
    """x[..., shift : shift + rows, ...] along `axis`, padded with `fill` past the end."""
    x = jax.lax.slice_in_dim(x, min(shift, x.shape[axis]), min(shift + rows, x.shape[axis]),
                             axis=axis)
    missing = rows - x.shape[axis]
    if missing <= 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, missing)
    return jnp.pad(x, pad, constant_values=fill)


def teacher_forced_step_tokens(tokens: jax.Array, depth: int) -> jax.Array:
    """tokens `[B, T+1]` -> `[K, B, T]`: step j's input at anchor t is token t+j (0 past the end)."""
    T = tokens.shape[1] - 1
    return jnp.stack([shift_rows(tokens, j + 1, T) for j in range(depth)])


def draft_to_target_ids(spec: HeadSpec, head, draft_ids: jax.Array) -> jax.Array:
    return head.to_target_ids(draft_ids) if spec.kind == "eagle3" else draft_ids


def target_outputs(spec: HeadSpec, target: Llama, tokens: jax.Array,
                   captured: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """-> (target logits `[B, T+1, V]`, captured `[len(needed_layers), B, T+1, H]`), computed by
    the target's forward, or from saved hidden states (labels: logits of layer L-1's stream)."""
    if captured is None:
        logits, captured = target.forward(tokens, capture_layers=spec.needed_layers)
    else:
        logits = target.logits(captured[-1])
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(captured)


def head_loss(spec: HeadSpec, head, target: Llama, tokens: jax.Array, valid: jax.Array,
              target_logits: jax.Array, captured: jax.Array) -> tuple[jax.Array, dict]:
    """The TTT / dense-chain soft cross-entropy on one batch (see the module docstring).
    tokens, valid `[B, T+1]`; target_logits `[B, T+1, V]`. -> (loss, per-step metrics)."""
    K, T = spec.depth, tokens.shape[1] - 1
    step_logits = run_chain(spec, head, target, captured, teacher_forced_step_tokens(tokens, K))
    if spec.kind == "eagle3":
        label_logits = jnp.take(target_logits,
                                head.to_target_ids(jnp.arange(spec.draft_vocab)), axis=-1)
    else:
        label_logits = target_logits
    target_choice = jnp.argmax(target_logits, axis=-1)
    loss, kl, step_losses, step_acc = 0.0, 0.0, [], []
    for j, logits in enumerate(step_logits):
        mask = shift_rows(valid, j + 1, T, fill=False).astype(jnp.float32)
        count = jnp.maximum(mask.sum(), 1.0)
        label_logp = jax.nn.log_softmax(shift_rows(label_logits, j + 1, T), axis=-1)
        probs = jnp.exp(label_logp)
        ce = -(probs * jax.nn.log_softmax(logits, axis=-1)).sum(-1)
        entropy = -(probs * label_logp).sum(-1)
        step_loss = (ce * mask).sum() / count
        kl = kl + spec.step_weight ** j * (step_loss - (entropy * mask).sum() / count)
        agree = draft_to_target_ids(spec, head, jnp.argmax(logits, -1)) == \
            shift_rows(target_choice, j + 1, T)
        step_losses.append(step_loss)
        step_acc.append((agree * mask).sum() / count)
        loss = loss + spec.step_weight ** j * step_loss
    # kl: the loss less the labels' own entropy (0 for a head that matches the target).
    return loss, {"step_loss": jnp.stack(step_losses), "step_acc": jnp.stack(step_acc),
                  "kl": kl}


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def split_head(head):
    """-> (graphdef, trainable params, rest: non-trainable variables such as d2t/t2d)."""
    return nnx.split(head, nnx.Param, ...)


@lru_cache(maxsize=8)
def make_train_step(spec: HeadSpec, head_def: nnx.GraphDef, target_def: nnx.GraphDef,
                    tc: TrainConfig):
    tx = make_optimizer(tc)

    @partial(jax.jit, donate_argnums=0)
    def train_step(state: dict, rest, target_state, batch: dict) -> tuple[dict, dict]:
        target = nnx.merge(target_def, target_state)
        target_logits, captured = target_outputs(spec, target, batch["tokens"],
                                                 batch.get("captured"))

        def loss_fn(params):
            head = nnx.merge(head_def, params, rest)
            return head_loss(spec, head, target, batch["tokens"], batch["valid"], target_logits,
                             captured)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return ({"params": params, "opt_state": opt_state},
                {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics})

    return train_step


@partial(jax.jit, static_argnums=(0, 1, 2))
def _eval_batch(spec: HeadSpec, head_def, target_def, params, rest, target_state, batch):
    target = nnx.merge(target_def, target_state)
    head = nnx.merge(head_def, params, rest)
    target_logits, captured = target_outputs(spec, target, batch["tokens"], batch.get("captured"))
    loss, metrics = head_loss(spec, head, target, batch["tokens"], batch["valid"], target_logits,
                              captured)
    return {"loss": loss, **metrics}


def validation_metrics(spec: HeadSpec, head, target: Llama, batches: list[dict]) -> dict:
    """Mean loss and per-step agreement over validation batches."""
    head_def, params, rest = split_head(head)
    target_def, target_state = nnx.split(target)
    out = [jax.device_get(_eval_batch(spec, head_def, target_def, params, rest, target_state, b))
           for b in batches]
    return {"val_loss": float(np.mean([o["loss"] for o in out])),
            "val_kl": float(np.mean([o["kl"] for o in out])),
            "val_step_acc": [float(x) for x in np.mean([o["step_acc"] for o in out], axis=0)]}


def train_head(spec: HeadSpec, tc: TrainConfig, target: Llama, source: "DataSource", work: Path,
               stop_after: int | None = None, progress: bool = True):
    """Train (or resume) to `tc.steps`; -> (head, log entries)."""
    work.mkdir(parents=True, exist_ok=True)
    tx = make_optimizer(tc)
    head = new_head(spec, target, tc.seed, source.token_counts(target.config.vocab_size))
    head_def, params, rest = split_head(head)
    target_def, target_state = nnx.split(target)
    state = jax.device_put({"params": params, "opt_state": tx.init(params)}, jax.devices()[0])
    mgr = checkpoint_manager(work)
    state, start = restore_or_init(mgr, state)
    log_path = work / LOG_NAME
    entries = _load_log(log_path, start)
    meta = {"head_spec": dataclasses.asdict(spec), "train_config": dataclasses.asdict(tc)}
    if start:
        tqdm.write(f"resuming from step {start} ({work / 'orbax'})")
    train_step = make_train_step(spec, head_def, target_def, tc)
    val_batches = source.val_batches(tc.batch_size, tc.seq_len, tc.eval_windows)
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    tokens_per_step = tc.batch_size * tc.seq_len
    pending, last_time, last_step = [], None, start
    elapsed = next((e["elapsed_s"] for e in reversed(entries) if "elapsed_s" in e), 0.0)
    mark = time.perf_counter()
    bar = tqdm(range(start, end), initial=start, total=tc.steps, disable=not progress,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, dynamic_ncols=True)
    for step in bar:
        batch = source.train_batch(tc.seed, step, tc.batch_size, tc.seq_len)
        state, metrics = train_step(state, rest, target_state, batch)
        pending.append(metrics)
        done = step + 1
        if done % tc.log_every == 0 or done == end:
            got = jax.device_get(pending)
            now = time.perf_counter()
            s_step = (now - last_time) / (done - last_step) if last_time else None
            last_time, last_step = now, done
            elapsed, mark = elapsed + now - mark, now
            entries.append({
                "step": done, "loss": float(np.mean([m["loss"] for m in got])),
                "kl": float(np.mean([m["kl"] for m in got])),
                "step_losses": [float(m["loss"]) for m in got],
                "step_loss": [float(x) for x in np.mean([m["step_loss"] for m in got], axis=0)],
                "step_acc": [float(x) for x in np.mean([m["step_acc"] for m in got], axis=0)],
                "grad_norm": float(got[-1]["grad_norm"]), "lr": float(lr_schedule(tc)(done - 1)),
                "tokens": done * tokens_per_step, "s_per_step": s_step, "elapsed_s": elapsed})
            pending = []
            bar.set_postfix(loss=f"{entries[-1]['loss']:.3f}",
                            acc1=f"{entries[-1]['step_acc'][0]:.2f}",
                            s_step=f"{s_step or 0:.2f}", refresh=False)
            if not progress or not sys.stderr.isatty():
                print(f"step {done}/{tc.steps} loss {entries[-1]['loss']:.4f} step_acc "
                      f"{[round(a, 3) for a in entries[-1]['step_acc']]} "
                      f"s/step {s_step if s_step is None else round(s_step, 3)} "
                      f"elapsed {elapsed:.0f}s", flush=True)
        if val_batches and (done % tc.eval_every == 0 or done == tc.steps):
            head_now = nnx.merge(head_def, state["params"], rest)
            val = validation_metrics(spec, head_now, target, val_batches)
            entries.append({"step": done, **val})
            tqdm.write(f"step {done}: val_loss {val['val_loss']:.4f} val_kl "
                       f"{val['val_kl']:.4f} val_step_acc "
                       f"{[round(a, 3) for a in val['val_step_acc']]}")
            last_time = time.perf_counter()
        if done % tc.save_every == 0 or done == end:
            mgr.save(done, args=ocp.args.StandardSave(state))
            _write_log(log_path, entries, meta)
    mgr.wait_until_finished()
    mgr.close()
    _write_log(log_path, entries, meta)
    return nnx.merge(head_def, state["params"], rest), entries


# ---------------------------------------------------------------------------------------------
# The acceptance report
# ---------------------------------------------------------------------------------------------


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """GQA attention with an explicit boolean mask `[S_q, S_k]` (shared by the batch); float32
    softmax. q `[B, S, heads, hd]`, k/v `[B, S, kv, hd]` -> `[B, S, heads, hd]`."""
    B, S, Hq, hd = q.shape
    KV = k.shape[2]
    G = Hq // KV
    qh = q.reshape(B, S, KV, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, KV, S * G, hd)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    scores = jnp.matmul(qh, kh.swapaxes(-1, -2)).astype(jnp.float32) * hd ** -0.5
    scores = jnp.where(jnp.repeat(mask, G, axis=0), scores, -jnp.inf)
    out = jnp.matmul(jax.nn.softmax(scores, axis=-1).astype(v.dtype), vh)
    return out.reshape(B, KV, S, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, S, Hq, hd)


def greedy_chain_tokens(target: Llama, tokens: jax.Array, depth: int,
                        logits: jax.Array | None = None) -> jax.Array:
    """The target's greedy continuation of every anchor: tokens `[B, T+1]` -> g `[depth, B, T]`,
    g[k-1][b, a] = the target's argmax choice k tokens after the prefix tokens[b, :a+2]
    (g_1 from the plain forward; g_k for k >= 2 with the prefix followed by g_1..g_{k-1}).

    One sequence holds the window and, for every anchor a, slots for g_1..g_{depth-1} at
    positions a+2.., each attending to the prefix rows <= a+1 and to the anchor's earlier slots
    (a tree mask); depth-1 forwards fill the slots one depth at a time."""
    B, T1 = tokens.shape
    T = T1 - 1
    if logits is None:
        logits = target.forward(tokens)[0]
    g = [jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32)]
    n = depth - 1
    if n == 0:
        return jnp.stack(g)
    anchors = jnp.arange(T)
    slot_pos = anchors[None, :] + 1 + jnp.arange(1, n + 1)[:, None]      # [n, T]
    positions = jnp.concatenate([jnp.arange(T1), slot_pos.reshape(-1)])  # [S]
    S = T1 + n * T
    is_slot = jnp.arange(S) >= T1
    slot = jnp.where(is_slot, (jnp.arange(S) - T1) // T, -1)             # 0-based slot or -1
    anchor = jnp.where(is_slot, (jnp.arange(S) - T1) % T, -1)
    q_slot, k_slot = slot[:, None], slot[None, :]
    prefix_end = jnp.where(is_slot, anchor + 1, jnp.arange(S))          # last visible prefix row
    mask = jnp.where(k_slot < 0, jnp.arange(S)[None, :] <= prefix_end[:, None],
                     (q_slot >= 0) & (anchor[:, None] == anchor[None, :]) & (k_slot <= q_slot))
    cfg = target.config
    windows = layer_windows(cfg)
    distance = positions[:, None] - positions[None, :]
    pos_b = jnp.broadcast_to(positions, (B, S))

    def attend(q, k, v, layer, state):
        return masked_attention(q, k, v, mask & (distance < windows[layer])), state

    for s in range(1, n + 1):
        slots = jnp.stack(g + [g[0]] * (n - s))  # slots 1..s hold g_1..g_s; later ones unused
        seq = jnp.concatenate([tokens, slots.transpose(1, 0, 2).reshape(B, n * T)], axis=1)
        x, _, _ = target.run_layers(target.embed_tokens(seq), pos_b, attend, None)
        rows = x[:, T1 + (s - 1) * T: T1 + s * T]
        g.append(jnp.argmax(target.logits(rows), axis=-1).astype(jnp.int32))
    return jnp.stack(g)


@partial(jax.jit, static_argnums=(0, 1, 2))
def _report_batch(spec: HeadSpec, head_def, target_def, params, rest, target_state, tokens, valid):
    """-> (agree `[K, B, T]` bool, anchor mask `[B, T]` bool) for one batch of windows."""
    target = nnx.merge(target_def, target_state)
    head = nnx.merge(head_def, params, rest)
    K, T = spec.depth, tokens.shape[1] - 1
    logits, captured = target.forward(tokens, capture_layers=spec.needed_layers)
    if spec.chain:
        labels = greedy_chain_tokens(target, tokens, K, logits)           # [K, B, T]
        step_tokens = jnp.concatenate([tokens[None, :, 1:], labels[:-1]])
        anchor_mask = valid[:, 1:]
    else:
        choice = jnp.argmax(logits, axis=-1)
        labels = jnp.stack([shift_rows(choice, j + 1, T) for j in range(K)])
        step_tokens = teacher_forced_step_tokens(tokens, K)
        anchor_mask = shift_rows(valid, K, T, fill=False)
    step_logits = run_chain(spec, head, target, captured, step_tokens)
    drafts = jnp.stack([draft_to_target_ids(spec, head, jnp.argmax(x, -1)) for x in step_logits])
    return drafts == labels, anchor_mask


def chain_agreement(spec: HeadSpec, head, target: Llama, batches: list[dict]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """-> (agree `[K, N]` bool, mask `[N]` bool) over every anchor row of `batches`."""
    head_def, params, rest = split_head(head)
    target_def, target_state = nnx.split(target)
    agrees, masks = [], []
    for b in batches:
        agree, mask = jax.device_get(_report_batch(spec, head_def, target_def, params, rest,
                                                   target_state, b["tokens"], b["valid"]))
        agrees.append(agree.reshape(agree.shape[0], -1))
        masks.append(mask.reshape(-1))
    return np.concatenate(agrees, axis=1), np.concatenate(masks)


def chain_report(agree: np.ndarray, mask: np.ndarray) -> dict:
    """agree `[K, N]` bool (depth k of anchor n agrees with the target's greedy choice), mask
    `[N]` -> per-depth top-1 agreement, conditional agreement given depths 1..k-1 agreed, and
    E[AL] = 1 + mean number of leading depths that agree."""
    agree = np.asarray(agree, bool)[:, np.asarray(mask, bool)]
    K, N = agree.shape
    leading = np.cumprod(agree, axis=0).astype(bool)  # [K, N]: depths 1..k all agree
    per_depth = []
    for k in range(K):
        reached = leading[k - 1] if k else np.ones((N,), bool)
        per_depth.append({
            "depth": k + 1,
            "agreement": float(agree[k].mean()) if N else float("nan"),
            "conditional_agreement": (float(agree[k][reached].mean()) if reached.any()
                                      else float("nan")),
            "reached": int(reached.sum()),
        })
    return {"depth": K, "anchors": int(N), "per_depth": per_depth,
            "expected_acceptance_length": float(1 + leading.sum(0).mean()) if N else float("nan")}


def acceptance_report(spec: HeadSpec, head, target: Llama, batches: list[dict]) -> dict:
    report = chain_report(*chain_agreement(spec, head, target, batches))
    report["chain_inputs"] = ("the target's greedy tokens (exact chain acceptance)" if spec.chain
                              else "corpus tokens (teacher-forced dense chain)")
    return report


def format_report(report: dict, title: str = "") -> str:
    lines = [title] if title else []
    lines += ["| depth | top-1 agreement | conditional agreement | anchors reached |",
              "|---:|---:|---:|---:|"]
    for d in report["per_depth"]:
        lines.append(f"| {d['depth']} | {d['agreement']:.3f} | "
                     f"{d['conditional_agreement']:.3f} | {d['reached']} |")
    lines.append(f"\nE[AL] = **{report['expected_acceptance_length']:.3f}** at depth "
                 f"{report['depth']} over {report['anchors']:,} validation anchors "
                 f"(chain inputs: {report['chain_inputs']})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


class DataSource:
    """Training batches `{"tokens" [B, T+1] int32, "valid" [B, T+1] bool (, "captured"
    [C, B, T+1, H])}`, validation batches of the same shape, and training token counts."""

    description = ""

    def train_batch(self, seed: int, step: int, batch_size: int, seq_len: int) -> dict: ...
    def val_windows(self, seq_len: int, max_windows: int | None) -> list[dict]: ...
    def token_counts(self, vocab_size: int) -> np.ndarray: ...
    def max_token(self) -> int: ...

    def val_batches(self, batch_size: int, seq_len: int, max_windows: int | None = None
                    ) -> list[dict]:
        """Fixed validation windows in batches; the last batch is padded with invalid rows."""
        windows = self.val_windows(seq_len, max_windows)
        batches = []
        for i in range(0, len(windows), batch_size):
            chunk = windows[i:i + batch_size]
            while len(chunk) < batch_size:
                chunk.append({k: (np.zeros_like(v) if k != "captured" else v)
                              for k, v in windows[0].items()})
            batches.append({k: np.stack([w[k] for w in chunk], axis=1 if k == "captured" else 0)
                            for k in chunk[0]})
        return batches


class CorpusSource(DataSource):
    def __init__(self, train_stream: np.ndarray, val_stream: np.ndarray, description: str = ""):
        self.train_stream, self.val_stream = train_stream, val_stream
        self.description = description

    def train_batch(self, seed, step, batch_size, seq_len):
        tokens = data.batch_for_step(self.train_stream, seed, step, batch_size, seq_len)
        return {"tokens": tokens, "valid": np.ones(tokens.shape, bool)}

    def val_windows(self, seq_len, max_windows):
        windows = data.eval_windows(self.val_stream, seq_len, max_windows)
        return [{"tokens": w, "valid": np.ones(w.shape, bool)} for w in windows]

    def token_counts(self, vocab_size):
        return np.bincount(self.train_stream, minlength=vocab_size)[:vocab_size]

    def max_token(self):
        return int(max(self.train_stream.max(), self.val_stream.max()))


class HiddenStatesSource(DataSource):
    """Windows cropped from saved requests (rows s..s+T of one request; a shorter request is
    padded with invalid rows). Every 20th request (at least one, when there are two or more) is
    held out for validation."""

    def __init__(self, directory: str | Path, needed_layers: tuple[int, ...], hidden_size: int,
                 what: str):
        layers, requests = read_hidden_states(directory)
        missing = [x for x in dict.fromkeys(needed_layers) if x not in layers]
        if missing:
            raise ValueError(
                f"--hidden-states {directory}: the files hold layers {list(layers)}, but {what} "
                f"needs layers {list(dict.fromkeys(needed_layers))} (the head's inputs and the "
                f"last layer for the labels); missing: {missing}")
        H = requests[0][1].shape[2]
        if H != hidden_size:
            raise ValueError(f"--hidden-states {directory}: hidden size {H} != the target's "
                             f"{hidden_size}")
        self.columns = [layers.index(x) for x in needed_layers]
        n_val = max(1, len(requests) // 20) if len(requests) >= 2 else 0
        self.train = requests[:len(requests) - n_val]
        self.val = requests[len(requests) - n_val:] if n_val else requests
        self.description = (f"{len(requests)} saved requests from `{directory}` (layers "
                            f"{list(layers)}); {len(self.val)} held out")
        lengths = np.asarray([len(h) for _, h in self.train], np.float64)
        self.weights = lengths / lengths.sum()

    def _window(self, request, start: int, seq_len: int) -> dict:
        tokens, hidden = request
        rows = min(seq_len + 1, len(hidden) - start)
        out_tokens = np.zeros((seq_len + 1,), np.int32)
        out_tokens[:rows] = tokens[start:start + rows]
        valid = np.zeros((seq_len + 1,), bool)
        valid[:rows] = True
        captured = np.zeros((len(self.columns), seq_len + 1, hidden.shape[2]), np.float32)
        captured[:, :rows] = hidden[start:start + rows][:, self.columns].transpose(1, 0, 2)
        return {"tokens": out_tokens, "valid": valid, "captured": captured}

    def train_batch(self, seed, step, batch_size, seq_len):
        rng = np.random.default_rng([seed, step])
        picks = rng.choice(len(self.train), size=batch_size, p=self.weights)
        windows = []
        for i in picks:
            n = len(self.train[i][1])
            start = int(rng.integers(0, n - seq_len)) if n > seq_len + 1 else 0
            windows.append(self._window(self.train[i], start, seq_len))
        return {"tokens": np.stack([w["tokens"] for w in windows]),
                "valid": np.stack([w["valid"] for w in windows]),
                "captured": np.stack([w["captured"] for w in windows], axis=1)}

    def val_windows(self, seq_len, max_windows):
        windows = []
        for request in self.val:
            for start in range(0, max(len(request[1]) - 1, 1), seq_len):
                windows.append(self._window(request, start, seq_len))
        return windows[:max_windows] if max_windows is not None else windows

    def token_counts(self, vocab_size):
        return np.bincount(np.concatenate([t for t, _ in self.train]),
                           minlength=vocab_size)[:vocab_size]

    def max_token(self):
        return int(max(t.max() for t, _ in self.train + self.val))


def corpus_source(target_dir: Path, work: Path) -> CorpusSource:
    """The target's own corpus: its tokenizer and manifest (train split for training, val for
    validation and the report), token streams cached under `work`."""
    for name in (toks.TOKENIZER_NAME, corpus.MANIFEST_NAME):
        if not (target_dir / name).exists():
            raise SystemExit(f"--target: {target_dir / name} is missing (train from the corpus "
                             "needs the target's tokenizer and corpus manifest; or pass "
                             "--hidden-states)")
    manifest = corpus.load_manifest(target_dir / corpus.MANIFEST_NAME)
    corpus.warn_if_mismatched(manifest)
    tok = toks.load_tokenizer(target_dir)
    bos = toks.special_token_id(tok)
    train = data.cached_stream(work / "tokens_train.npy", tok,
                               corpus.read_documents(manifest, "train"), bos)
    val = data.cached_stream(work / "tokens_val.npy", tok, corpus.read_documents(manifest, "val"),
                             bos)
    n_val = sum(f["split"] == "val" for f in manifest["files"])
    return CorpusSource(train, val, f"the target's corpus (`{target_dir.name}/corpus_manifest.json`"
                        f": {len(train):,} train tokens; {len(val):,} validation tokens from "
                        f"{n_val} held-out files)")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

HEAD_TRAIN_DEFAULTS = dict(steps=600, batch_size=8, seq_len=256, lr=2e-3, warmup=50,
                           eval_every=100, save_every=50, eval_windows=16, weight_decay=0.0)


def add_arguments(p: argparse.ArgumentParser, kind: str) -> None:
    p.add_argument("--target", type=Path, required=True, help="the frozen target's checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="export folder, e.g. checkpoints/<name>")
    p.add_argument("--depth", type=int, default=4 if kind == "eagle3" else 3,
                   help="draft steps unrolled in training (TTT) and reported")
    p.add_argument("--hidden-states", type=Path, default=None,
                   help="train from a SAVE_HIDDEN_STATES folder instead of the target's corpus")
    p.add_argument("--step-weight", type=float, default=0.8,
                   help="loss weight of draft step j is step_weight^(j-1)")
    t = p.add_argument_group("training")
    for field in dataclasses.fields(TrainConfig):
        default = HEAD_TRAIN_DEFAULTS.get(field.name, field.default)
        t.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=default)
    r = p.add_argument_group("run control")
    r.add_argument("--restart", action="store_true", help="discard saved steps under <out>/work")
    r.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (resumable)")
    r.add_argument("--report-windows", type=int, default=32,
                   help="validation windows in the final acceptance report")
    r.add_argument("--no-progress", action="store_true")


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def check_size(folder: Path, limit: int = SIZE_LIMIT_BYTES) -> int:
    size = _folder_bytes(folder)
    if size > limit:
        raise SystemExit(f"{folder} holds {size / 1e6:.2f} MB > the {limit / 1e6:.0f} MB limit for "
                         "a shipped head (use a smaller --draft-vocab or --save-dtype bfloat16)")
    return size


def run(kind: str, args: argparse.Namespace, argv: list[str], spec_fields: Callable,
        export_fn: Callable) -> int:
    """Shared driver: spec_fields(target_config) -> the kind-specific HeadSpec fields;
    export_fn(out, head, target, spec, log) writes the weights (and may add to the log)."""
    out: Path = args.out
    work = out / WORK_DIR
    if args.restart:
        shutil.rmtree(work, ignore_errors=True)
    if not (args.target / "config.json").exists():
        raise SystemExit(f"--target: {args.target / 'config.json'} is missing")
    target = load_hf_checkpoint(args.target)
    cfg = target.config
    spec = HeadSpec(kind=kind, depth=args.depth, num_layers=cfg.num_layers,
                    step_weight=args.step_weight, **spec_fields(cfg))
    out.mkdir(parents=True, exist_ok=True)
    if args.hidden_states is not None:
        source: DataSource = HiddenStatesSource(args.hidden_states, spec.needed_layers,
                                                cfg.hidden_size, f"{spec.label} ({kind})")
    else:
        source = corpus_source(args.target, work)
    top = source.max_token()
    if top >= cfg.vocab_size:
        raise SystemExit(f"the training data hold token id {top} >= the target's vocab_size "
                         f"{cfg.vocab_size}")
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    commands = _check_same_run(work, _RunConfig(spec, str(args.target), str(args.hidden_states)),
                               tc, "python -m specjax.train " + shlex.join(argv))
    print(f"{spec.label} head for {args.target} ({cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}); data: {source.description}; {tc.steps} "
          f"steps x {tc.batch_size} x {tc.seq_len} tokens, depth {spec.depth}", flush=True)
    head, entries = train_head(spec, tc, target, source, work, args.stop_after,
                               progress=not args.no_progress)
    done = max((e["step"] for e in entries), default=0)
    if done < tc.steps:
        print(f"stopped after step {done} of {tc.steps}; rerun the same command to resume")
        return 0
    batches = source.val_batches(min(tc.batch_size, 4), tc.seq_len, args.report_windows)
    start = time.perf_counter()
    report = acceptance_report(spec, head, target, batches)
    report["seconds"] = time.perf_counter() - start
    table = format_report(report, f"{spec.label} acceptance on the validation split "
                                  f"(greedy, chain of {spec.depth}):")
    print(table, flush=True)
    log = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "commands": commands, "head_spec": dataclasses.asdict(spec),
           "train_config": dataclasses.asdict(tc), "data": source.description,
           "report": report, "vocab_size": cfg.vocab_size, "entries": compact_log(entries)}
    for name in ("model.safetensors", "config.json", "MODEL_CARD.md", LOG_NAME):
        (out / name).unlink(missing_ok=True)
    export_fn(out, head, target, spec, log)
    (out / LOG_NAME).write_text(json.dumps(log, indent=0) + "\n")
    write_model_card(out, spec, args, log, table)
    size = check_size(out)
    print(f"exported {out} ({size / 1e6:.2f} MB <= {SIZE_LIMIT_BYTES / 1e6:.0f} MB): E[AL] "
          f"{report['expected_acceptance_length']:.3f} at depth {spec.depth}", flush=True)
    return 0


@dataclass(frozen=True)
class _RunConfig:
    """What a resumed run must share with the saved one (besides the TrainConfig)."""

    head_spec: HeadSpec
    target: str
    hidden_states: str


def write_model_card(out: Path, spec: HeadSpec, args: argparse.Namespace, log: dict,
                     table: str) -> None:
    tc = log["train_config"]
    wall = next((e["elapsed_s"] for e in reversed(log["entries"]) if "elapsed_s" in e), None)
    val = next((e for e in reversed(log["entries"]) if "val_loss" in e), None)
    if spec.kind == "eagle3":
        what = (f"an EAGLE-3 draft head for `{args.target.name}`: fc over the target's residual "
                f"streams after layers {list(spec.capture_layers)} (0-based), one decoder "
                f"midlayer, a {spec.draft_vocab}-token draft vocabulary"
                + (" (the whole target vocabulary)" if spec.draft_vocab == log["vocab_size"]
                   else " (the most frequent training tokens; `d2t`/`t2d` map them)"))
        files = "public EAGLE-3 layout (`config.json` + `model.safetensors`, float32)"
        use = (f"EagleConfig(max_draft_len={spec.depth}, speculative_model=\"{out}\", "
               f"eagle3_layers_to_capture={tuple(spec.capture_layers)})")
        training = (f"training-time test: the head's chain unrolled over {spec.depth} steps as "
                    "the engine drafts it (step j attends to the step-1 keys of the accepted "
                    "prefix plus the chain's own keys)")
    else:
        modules = ("an MTP-Eagle module (one module reused for every draft step)"
                   if spec.num_modules == 1
                   else f"{spec.num_modules} MTP modules (module k drafts token k)")
        what = (f"{modules} for `{args.target.name}`, each a target-style decoder layer on "
                "eh_proj(concat(enorm(embedding), hnorm(hidden))); the LM head is the target's")
        files = (f"`config.json` + `model.safetensors` in the specjax MTP layout "
                 f"(`specjax.models.mtp_checkpoint`, {log['save_dtype']})")
        use = (f"MTPConfig(max_draft_len={spec.depth}, num_nextn_predict_layers="
               f"{spec.num_modules}, use_mtp_vanilla={spec.num_modules > 1}, "
               f"speculative_model=\"{out}\")")
        training = ("training-time test over the reused module's chain" if spec.chain
                    else "the dense MTP chain (module k reads module k-1's hidden state)")
    lines = [
        f"# {out.name}: {spec.label} draft head for {args.target.name}\n",
        f"{what[0].upper()}{what[1:]}. Trained by `specjax.train` on the frozen target's own "
        "predictions; the target's weights are unchanged.\n",
        "## Files\n",
        f"- weights: {files}; {_folder_bytes(out) / 1e6:.1f} MB in all "
        f"(the exporter refuses more than {SIZE_LIMIT_BYTES / 1e6:.0f} MB)",
        f"- use: `specjax.LLM(\"{args.target}\", speculative_config={use})`",
        "- `training_log.json`: arguments, loss curve, the report below\n",
        "## Training\n",
        f"- command: `{log['commands'][-1]}`",
        *(["- resumed; invocations in order: " + "; ".join(f"`{c}`" for c in log["commands"])]
          if len(log["commands"]) > 1 else []),
        f"- data: {log['data']}",
        f"- labels: the target's next-token distribution (soft cross-entropy); {training}; "
        f"step j weighted {spec.step_weight}^(j-1)",
        f"- {tc['steps']} steps of {tc['batch_size']} x {tc['seq_len']} tokens; AdamW (b1 "
        f"{tc['b1']}, b2 {tc['b2']}, weight decay {tc['weight_decay']}), peak lr {tc['lr']:g}, "
        f"{tc['warmup']} warm-up steps, cosine to {tc['lr'] * tc['min_lr_ratio']:g}, clip "
        f"{tc['clip_norm']}",
        f"- hardware: {platform.machine()} CPU, JAX {jax.__version__}"
        + (f", {wall / 60:.0f} min wall time" if wall else ""),
        *([f"- final validation loss {val['val_loss']:.4f} (first {tc['eval_windows']} windows)"]
          if val else []),
        "\n## Acceptance (validation split)\n",
        "Greedy decoding: depth k agrees when the head's top-1 token equals the target's own "
        "argmax choice k tokens ahead; conditional agreement is over anchors whose depths "
        "1..k-1 all agreed; E[AL] = 1 + mean number of leading agreeing depths (tokens per "
        "target step).\n",
        table,
        f"\n_Exported {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC._\n",
    ]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))
