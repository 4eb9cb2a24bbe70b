"""Auxiliary per-request state: device state beside the KV pool that a step reads for its rows
and must leave as it stood after the tokens the step accepted -- a hybrid target's recurrent
state today (`specjax.core.recurrent`), an attention indexer's cache tomorrow.

Each entry of `EngineState.aux` (name -> state) provides two hooks the steps call, so neither
the steps nor the engine name any kind:

    runs = state.begin(batch, verify)          before the forward: what the model reads/records
    state = state.commit(runs, slots, n, verify)  after acceptance: keep each row's first n
                                                  positions, drop the rest (the rollback)

`verify` is True in generation steps (n = accepted tokens, fewer than the run) and False in
prompt-chunk steps (n = the chunk's length).
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

import jax

from specjax.core.batch import StepBatch
from specjax.core.recurrent import make_recurrent_pool, state_bytes_per_slot
from specjax.models.config import ModelConfig


class AuxState(Protocol):
    def begin(self, batch: StepBatch, verify: bool) -> Any: ...

    def commit(self, runs: Any, slots: jax.Array, n: jax.Array, verify: bool
               ) -> "AuxState": ...


def make_aux_state(config: ModelConfig, num_slots: int, recurrent_commit: str = "replay"
                   ) -> dict[str, AuxState] | None:
    """The auxiliary state a target of `config` needs for `num_slots` requests (None: none)."""
    aux: dict[str, AuxState] = {}
    if config.is_hybrid:
        aux["recurrent"] = make_recurrent_pool(config, num_slots, recurrent_commit)
    return aux or None


def aux_bytes_per_slot(config: ModelConfig) -> int:
    """What one request's auxiliary state costs on the device, beside its K/V blocks."""
    return state_bytes_per_slot(config)


def begin(aux: Mapping[str, AuxState] | None, batch: StepBatch, verify: bool
          ) -> dict[str, Any] | None:
    return None if aux is None else {name: s.begin(batch, verify) for name, s in aux.items()}


def commit(aux: Mapping[str, AuxState] | None, runs: Mapping[str, Any] | None,
           slots: jax.Array, n: jax.Array, verify: bool) -> dict[str, AuxState] | None:
    if aux is None:
        return None
    return {name: s.commit(runs[name], slots, n, verify) for name, s in aux.items()}
