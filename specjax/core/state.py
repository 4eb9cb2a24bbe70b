"""What the steps carry from one call to the next, and the parameters they take as arguments.

`Params` and `EngineState` are pytrees of arrays, so the jitted steps trace them (one compiled
program serves any weights of a shape) and donate the state (XLA updates the pools in place).
Static configuration -- graph definitions, the drafter's shape -- lives in the step's closure.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh

from specjax.core.aux_state import AuxState, make_aux_state
from specjax.core.kv import KVPool, make_kv_pool
from specjax.core.penalties import PenaltyState, make_penalty_state
from specjax.core.suffix import SuffixSpec, SuffixState, make_suffix_state
from specjax.core.worker import DraftWorker, tree_of
from specjax.models.config import ModelConfig
from specjax.models.linear import dequantized, packed_for_cpu
from specjax.models.llama import Llama


@struct.dataclass
class SlotState:
    """Per-slot device state that lets a step start where the previous one ended without a
    host round trip: the overlap scheduler dispatches step N+1 before reading step N.

    Every step writes it for its rows (`write_slots`); generation steps whose runs come from the
    device (`runs_on_device`) read them from it. Row S (one past the last slot) is the spare that
    padded rows write to.
    """

    run: jax.Array           # [S+1, D_max+1] int32: newest token, then its drafts
    start: jax.Array         # [S+1] int32: position of the newest token
    num_drafts: jax.Array    # [S+1] int32: drafts in `run` (0 after prefill or plain decode)
    # [S+1, D_max, V] float32: the distributions the drafts were drawn from, kept only when
    # rejection sampling needs them (None otherwise).
    draft_probs: jax.Array | None = None
    # [S+1, T] int32: with a draft tree in `run`, each node's parent row (0 = the newest
    # token; see `specjax.core.tree`); None for chains.
    tree_parents: jax.Array | None = None
    # [S+1] bool: the row's drafts came from SA, which gives no distribution, so the next step
    # accepts them by strict matching; kept only beside draft_probs when the SA enhancer runs.
    strict: jax.Array | None = None

    @property
    def spare(self) -> int:
        """The slot padded rows use."""
        return self.start.shape[0] - 1


def make_slot_state(num_slots: int, max_draft_len: int, vocab_size: int = 0,
                    tree: bool = False, strict: bool = False) -> SlotState:
    """Slot state for `num_slots` slots plus the spare, runs of up to `max_draft_len` drafts
    (a tree's nodes); `vocab_size` > 0 keeps draft probs, `tree` the nodes' parents, `strict`
    which rows' drafts have no distribution."""
    probs = (jnp.zeros((num_slots + 1, max_draft_len, vocab_size), jnp.float32)
             if vocab_size else None)
    parents = jnp.zeros((num_slots + 1, max_draft_len), jnp.int32) if tree else None
    return SlotState(run=jnp.zeros((num_slots + 1, max_draft_len + 1), jnp.int32),
                     start=jnp.zeros(num_slots + 1, jnp.int32),
                     num_drafts=jnp.zeros(num_slots + 1, jnp.int32), draft_probs=probs,
                     tree_parents=parents,
                     strict=jnp.zeros(num_slots + 1, bool) if strict else None)


def write_slots(slots: SlotState, rows: jax.Array, run: jax.Array, start: jax.Array,
                num_drafts: jax.Array, draft_probs: jax.Array | None = None,
                tree_parents: jax.Array | None = None,
                strict: jax.Array | None = None) -> SlotState:
    """Record each row's newest token and drafts where the next step reads them: rows `[B]`
    (slot ids), run `[B, <=D_max+1]`, start `[B]`, num_drafts `[B]`, draft_probs
    `[B, D, V]` (kept only where the state has room for them), tree_parents `[B, T]`, strict
    `[B]` (likewise)."""
    widen = lambda x, width: jnp.zeros((x.shape[0], width), jnp.int32).at[:, :x.shape[1]].set(x)
    slots = slots.replace(run=slots.run.at[rows].set(widen(run, slots.run.shape[1])),
                          start=slots.start.at[rows].set(start),
                          num_drafts=slots.num_drafts.at[rows].set(num_drafts))
    if draft_probs is not None and slots.draft_probs is not None:
        D = draft_probs.shape[1]
        slots = slots.replace(draft_probs=slots.draft_probs.at[rows, :D].set(draft_probs))
    if tree_parents is not None:
        width = slots.tree_parents.shape[1]
        slots = slots.replace(tree_parents=slots.tree_parents.at[rows].set(
            widen(tree_parents, width)))
    if strict is not None and slots.strict is not None:
        slots = slots.replace(strict=slots.strict.at[rows].set(strict))
    return slots


@struct.dataclass
class Params:
    """The step's parameters: nnx pure dicts of arrays (`nnx.split`)."""

    target: Any              # the target model's
    draft: Any = None        # the in-step drafter's (draft model or head), None without one


@struct.dataclass
class EngineState:
    """Everything a step reads and writes on the device."""

    target: KVPool           # [L, N, KV, bs, hd]: the target's pool
    slots: SlotState         # per-slot newest token, drafts and their distributions
    draft: KVPool | None = None  # the in-step drafter's pool (same block tables), or None
    suffix: SuffixState | None = None  # SA's per-slot token history, or None
    penalties: PenaltyState | None = None  # per-slot token counts for the penalties
    # Per-slot state beside the KV pool, committed at the accepted depth (`core/aux_state`):
    # a hybrid target's recurrent state. None for a pure-attention target.
    aux: dict[str, AuxState] | None = None


def split_model(target: Llama, draft: nnx.Module | None = None, fused: bool = True,
                scan_layers: bool = True, packed: bool = False
                ) -> tuple[nnx.GraphDef, Params]:
    """(the target's graph definition, `Params`) for the step functions, in the layout the
    steps run (`for_inference`: q/k/v and gate/up fused; layers stacked and scanned, or
    unrolled with `scan_layers=False`). `fused=False` keeps the target's projections apart:
    what tensor parallelism splits (a fused matrix's columns would not split by heads).
    `draft` is already in its own inference layout (`Speculation.draft_model`, made once with
    the same `scan_layers`), which its worker's graph definition was taken from. `packed`:
    the target's projections packed for the CPU matmul kernel (`packed_for_cpu`; a packed
    `draft` is packed by `build_speculation`). Unpacked, a quantized GGUF's weights stay
    quantized on an accelerator (dequantized inside the step) and become float32 where XLA's
    dot runs on a CPU or tensor parallelism splits them (`dequantized`)."""
    if fused:
        target = target.for_inference(scan_layers)
    else:
        target = target.restacked() if scan_layers else target.unstacked()
    if packed:
        target = packed_for_cpu(target)
    elif not fused or jax.default_backend() == "cpu":
        target = dequantized(target)
    graphdef, state = nnx.split(target)
    return graphdef, Params(
        target=nnx.to_pure_dict(state),
        draft=None if draft is None else nnx.to_pure_dict(nnx.split(draft)[1]))


def init_state(config: ModelConfig, *, num_slots: int, num_blocks: int, tokens_per_block: int,
               max_draft_len: int = 0, worker: DraftWorker | None = None,
               suffix: SuffixSpec | None = None, history_len: int = 0,
               mesh: Mesh | None = None, recurrent_commit: str = "replay",
               ring_layers: tuple[bool, ...] = (), ring_blocks: int = 0) -> EngineState:
    """Zeroed device state for a target with `config`: its pool, slot state
    for `num_slots` requests and drafts up to `max_draft_len` (a tree worker's: nodes), the
    worker's pool, and with SA (`suffix`) a token history of `history_len` (the longest
    request) per slot. Draft distributions are kept when the worker does rejection sampling,
    the nodes' parents when it drafts trees. A hybrid target gets its slots' recurrent
    state (`recurrent_commit`: how a verify step commits it, see `specjax.core.recurrent`).
    `ring_layers`, `ring_blocks`: the target's attention layers that keep only a ring per
    slot (`specjax.core.kv`)."""
    keep_probs = worker is not None and worker.rejection_sampling
    tree = tree_of(worker) is not None
    if suffix is not None and history_len < 1:
        raise ValueError("SA needs history_len: the longest request's tokens (max_model_len)")
    return EngineState(
        target=make_kv_pool(len(config.kv_layers), config.num_kv_heads, config.head_dim, num_blocks,
                            tokens_per_block, config.dtype, mesh, ring_layers, ring_blocks,
                            num_slots),
        slots=make_slot_state(num_slots, max_draft_len, config.vocab_size if keep_probs else 0,
                              tree, strict=keep_probs and suffix is not None),
        draft=None if worker is None else worker.make_kv(num_blocks, tokens_per_block,
                                                         config.dtype),
        suffix=None if suffix is None else make_suffix_state(suffix, num_slots, history_len),
        penalties=make_penalty_state(num_slots, config.vocab_size),
        aux=make_aux_state(config, num_slots, recurrent_commit))
