"""Tensor parallelism: where each array lives on a device mesh with a "tp" axis.

The plan is Megatron's, written as shardings and left to XLA's SPMD partitioner (GSPMD): the
steps stay the same pure functions, jitted once per shape; their inputs arrive sharded and
their outputs are pinned to the same shardings, so the next call finds what the last one
left (no compile after warm-up).

- target weights: q/k/v and gate/up split by output features (whole heads per device: the
  head counts must divide by the tp size), o/down by input features (XLA adds the all-reduce
  after them), the embedding and LM head by vocabulary when it divides; norms replicated.
  Logits are gathered whole before anything decides from them (`whole_vocab`): split, a
  softmax's or an inverse CDF's sum adds each device's part and then the parts, in another
  order than one device's, and a seeded draw near a CDF boundary would then depend on the
  device count.
- the target's KV pool: split over KV heads (`KVPool.mesh`), so each device attends with its
  own heads. Attention and the pool kernels run per device under `shard_map`
  (`heads_local`): a Pallas kernel is opaque to GSPMD, which would gather the pool to run it.
- drafters (heads, draft models) and their pools: replicated. Drafting is a chain of small
  dependent passes; split, each layer of each draft token would wait on two all-reduces for
  matmuls that are a fraction of the target's.
- slot state, penalties, SA history, batches and every small output: replicated.

The same shardings serve one host (a `Mesh` over local devices) and several (a mesh over every
process's devices after `jax.distributed.initialize`), which is why weights (and, across
processes, every host input) are placed with `jax.make_array_from_callback`: each process
supplies only its own devices' shards.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax.core.kv import KVPool
from specjax.models.config import ModelConfig
from specjax.models.roles import TP_AXIS

TP = "tp"
HEADS = P(None, None, TP, None)              # q / attention output [B, T, H, hd]
POOL = P(None, None, TP, None, None)         # K/V pool [L, N, KV, bs, hd]


# The tensor-parallel plan of the step being traced (`tracing`), else None.
_TRACED: contextvars.ContextVar[TensorParallel | None] = contextvars.ContextVar("tp_traced",
                                                                               default=None)


def make_mesh(size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis ("tp") mesh over the first `size` devices (every process's, after
    `jax.distributed.initialize`)."""
    devices = list(jax.devices() if devices is None else devices)
    if not 1 <= size <= len(devices):
        raise ValueError(f"tensor_parallel_size {size} needs {size} devices; "
                         f"{len(devices)} available ({devices[0].platform})")
    return Mesh(np.asarray(devices[:size]), (TP,), axis_types=(AxisType.Auto,))


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The mesh the steps run on (static: part of a step's identity, like its shapes)."""

    mesh: Mesh

    def __post_init__(self):
        if TP not in self.mesh.axis_names:
            raise ValueError(f"the mesh needs an axis named {TP!r}; it has "
                             f"{tuple(self.mesh.axis_names)}")

    @property
    def size(self) -> int:
        return self.mesh.shape[TP]

    def sharding(self, spec: P = P()) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # -- the plan ------------------------------------------------------------------------

    def check(self, config: ModelConfig) -> None:
        """Refuse a target whose heads do not split evenly, before any work."""
        for what, count in (("num_heads", config.num_heads),
                            ("num_kv_heads", config.num_kv_heads)):
            if count % self.size:
                raise ValueError(f"tensor_parallel_size {self.size} does not divide the "
                                 f"model's {what} ({count}); use a size that divides "
                                 f"{config.num_heads} heads and {config.num_kv_heads} KV heads")

    def weight_spec(self, name: str, shape: tuple[int, ...]) -> P:
        """A target weight's spec by its name: split where Megatron splits it, if that axis
        divides (a vocabulary that does not stays replicated), else replicated."""
        axis = TP_AXIS.get(name)  # `specjax.models.roles`
        if axis is None or shape[axis] % self.size:
            return P()
        spec = [None] * len(shape)
        spec[axis] = TP
        return P(*spec)

    def param_shardings(self, params: Any) -> Any:
        """Shardings for `Params`: the target's by `weight_spec`, the drafter's replicated."""
        def target(path, leaf):
            return self.sharding(self.weight_spec(_leaf_name(path), leaf.shape))
        replicated = self.sharding()
        return params.replace(
            target=jax.tree_util.tree_map_with_path(target, params.target),
            draft=jax.tree.map(lambda _: replicated, params.draft))

    def state_shardings(self, state: Any) -> Any:
        """Shardings for an `EngineState` (or its shapes): pools whose `mesh` is set split
        over KV heads, everything else replicated."""
        split, replicated = self.sharding(POOL), self.sharding()

        def place(x):
            if isinstance(x, KVPool):
                return jax.tree.map(lambda _: split if x.mesh is not None else replicated, x)
            return replicated
        return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, KVPool))

    # -- placing and pinning -------------------------------------------------------------

    def put(self, tree: Any, shardings: Any) -> Any:
        """Arrays of `tree` (host or device, the same values on every process) placed as
        `shardings` says; each process fills only its own devices."""
        def place(x, sharding):
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        return jax.tree.map(place, tree, shardings)

    def replicate(self, tree: Any) -> Any:
        """A step's host inputs on every device. One process: one batched transfer (this runs
        every step); several: each process fills its own devices."""
        if jax.process_count() == 1:
            return jax.device_put(tree, self.sharding())
        return self.put(tree, jax.tree.map(lambda _: self.sharding(), tree))

    def pin(self, state: Any, out: Any) -> tuple[Any, Any]:
        """Inside a step: the state keeps the shardings it came in with, small outputs are
        replicated (every process can read them)."""
        state = jax.lax.with_sharding_constraint(state, self.state_shardings(state))
        out = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.sharding()), out)
        return state, out


@contextlib.contextmanager
def tracing(tp: TensorParallel | None) -> Iterator[None]:
    """Trace a step under `tp` (None: one device): what `whole_vocab` reads."""
    token = _TRACED.set(tp)
    try:
        yield
    finally:
        _TRACED.reset(token)


def whole_vocab(logits: jax.Array) -> jax.Array:
    """Inside a step traced under a plan: `logits` (split by vocabulary where the target's LM
    head is, or a drafter's that shares it) whole on every device, so that softmax, filters
    and sampling add in one order whatever the device count. Else `logits` as they are."""
    tp = _TRACED.get()
    return logits if tp is None else jax.lax.with_sharding_constraint(logits, tp.sharding())


def _leaf_name(path) -> str:
    key = path[-1]
    return str(getattr(key, "key", getattr(key, "name", key)))


def heads_local(fn: Callable, mesh: Mesh | None, in_specs: tuple, out_specs: Any) -> Callable:
    """`fn` run per device over its own heads (`shard_map`) when `mesh` is set, else `fn`."""
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
