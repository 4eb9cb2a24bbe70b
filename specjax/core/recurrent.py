"""Recurrent state beside the paged KV pool: each slot's Mamba-2 state (a hybrid target's),
read at a step's start and committed at the depth the step accepted.

Rolling K/V back is free -- rejected drafts' K/V sit past the new length and are overwritten
-- but a recurrent state has no positions to roll back: after a verify pass over
[newest, d1..dD] it has absorbed every draft. So the pass keeps what it needs to commit after
any prefix (`MixerTape`) and the step commits the state after the accepted ones, before it
returns. Two ways, a static choice (`RecurrentPool.commit_mode`):

- "replay" (the default): the verify scan keeps only its inputs (x, dt, B: the "input
  ring"); the step re-runs the scan from the checkpoint (the slot's state before the step)
  over the accepted positions only (dt = 0 past them), which is the same recurrence, so the
  same state;
- "states": the verify scan writes the state after each of its 1 + D positions
  (`[B, D+1, H, P, N]` per mixer, transient) and the step keeps the one at the accepted depth.

Measured on a 3.7M-parameter Bamba (4 mixers of 6 heads x 64 x state 32) on a 2-core CPU,
generation-step time verifying 4 / 8 drafts: batch 1, 1.19 / 1.58 ms replay vs 1.74 / 2.53 ms
states; batch 8, 4.28 / 6.94 ms vs 5.37 / 9.61 ms. Writing every position's full state costs
more than a second short scan that keeps only the last one. D = 0 (plain decoding) commits
the run's last state either way.

The conv window is a slice of the tape's inputs at the accepted depth either way. A row whose
run starts at position 0 (a new request, or a preempted one recomputed) starts from zeros:
that is the reset on admission, done on the device so no host step can forget it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.ssm_scan import ssm_scan
from specjax.core.batch import StepBatch
from specjax.models.bamba import MixerTape, state_shapes
from specjax.models.config import ModelConfig

COMMIT_MODES = ("states", "replay")


@struct.dataclass
class RecurrentPool:
    """Every slot's state in every mixer (row S is the spare padded rows write to)."""

    conv: jax.Array          # [L_r, S+1, K-1, C] model dtype: the conv window
    ssm: jax.Array           # [L_r, S+1, H, P, N] float32: the SSM state
    commit_mode: str = struct.field(pytree_node=False, default="replay")

    def begin(self, batch: StepBatch, verify: bool) -> "SlotRecurrence":
        return SlotRecurrence(self, batch, keep_states=verify and self.commit_mode == "states")

    def commit(self, runs: "SlotRecurrence", slots: jax.Array, n: jax.Array, verify: bool
               ) -> "RecurrentPool":
        """The state after each row's first n `[B]` positions becomes its slot's."""
        mode = self.commit_mode if verify else "final"
        conv, ssm = zip(*(commit_mixer(runs.tapes[i], n, mode)
                          for i in range(self.conv.shape[0])))
        return self.replace(conv=self.conv.at[:, slots].set(jnp.stack(conv).astype(
                                self.conv.dtype)),
                            ssm=self.ssm.at[:, slots].set(jnp.stack(ssm)))


def check_commit_mode(commit_mode: str) -> None:
    if commit_mode not in COMMIT_MODES:
        raise ValueError(f"recurrent_commit must be one of {COMMIT_MODES}, got {commit_mode!r}")


def make_recurrent_pool(config: ModelConfig, num_slots: int, commit_mode: str = "replay"
                        ) -> RecurrentPool:
    check_commit_mode(commit_mode)
    conv, ssm = state_shapes(config)
    L = len(config.recurrent_layers)
    return RecurrentPool(conv=jnp.zeros((L, num_slots + 1, *conv), jnp.dtype(config.dtype)),
                         ssm=jnp.zeros((L, num_slots + 1, *ssm), jnp.float32),
                         commit_mode=commit_mode)


def state_bytes_per_slot(config: ModelConfig) -> int:
    """Bytes of recurrent state one request holds (all mixers): what a slot costs beside its
    K/V blocks."""
    if not config.is_hybrid:
        return 0
    (k, c), (h, p, n) = state_shapes(config)
    per_mixer = k * c * jnp.dtype(config.dtype).itemsize + h * p * n * 4
    return len(config.recurrent_layers) * per_mixer


class SlotRecurrence:
    """The `Recurrence` a step's forward runs with: each row's state read from its slot (zeros
    for a row at position 0), positions past query_lens masked, tapes kept for the commit."""

    def __init__(self, pool: RecurrentPool, batch: StepBatch, keep_states: bool):
        fresh = ((batch.start_pos == 0) & (batch.query_lens > 0))[None, :, None, None]
        self.conv = jnp.where(fresh, 0, pool.conv[:, batch.slots])
        self.ssm = jnp.where(fresh[..., None], 0.0, pool.ssm[:, batch.slots])
        T = batch.tokens.shape[1]
        self.valid = jnp.arange(T)[None, :] < batch.query_lens[:, None]   # [B, T]
        self.keep_states = keep_states
        self.tapes: dict[int, MixerTape] = {}

    def initial(self, index: int) -> tuple[jax.Array, jax.Array]:
        return self.conv[index], self.ssm[index]

    def record(self, index: int, tape: MixerTape) -> None:
        self.tapes[index] = tape


def commit_mixer(tape: MixerTape, n: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """(conv window `[B, K-1, C]`, SSM state `[B, H, P, N]`) after each row's first n `[B]`
    positions of the tape's run. "final": the tape's last state (the run masked past n)."""
    width = tape.conv_seq.shape[1] - tape.x.shape[1]                   # K - 1
    # Position t's window is inputs t+1 .. t+K-1 of conv_seq (the previous window first).
    conv = jax.vmap(lambda seq, start: jax.lax.dynamic_slice_in_dim(seq, start, width))(
        tape.conv_seq, n)
    if mode == "final":
        ssm = tape.h_final
    elif mode == "states":
        at = jnp.take_along_axis(tape.states, jnp.maximum(n - 1, 0)[:, None, None, None, None],
                                 axis=1)[:, 0]
        ssm = jnp.where((n > 0)[:, None, None, None], at, tape.h0)
    else:  # replay the accepted positions from the checkpoint
        T = tape.x.shape[1]
        dt = jnp.where(jnp.arange(T)[None, :, None] < n[:, None, None], tape.dt, 0.0)
        _, ssm = ssm_scan(tape.x, dt, tape.a, tape.b, tape.c, tape.h0)
    return conv, ssm
