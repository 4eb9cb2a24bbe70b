"""The XLA flags specjax sets, in one place, applied when `specjax` is imported.

XLA reads XLA_FLAGS once, when JAX starts its backend (the first computation or
`jax.devices()`), so these only take effect if specjax is imported before that. A flag the user
already set in XLA_FLAGS is left as the user set it. `SPECJAX_EXTRA_XLA_FLAGS` adds flags on
top (what `python -m specjax.bench cpu` uses to time each candidate in its own process).

Measured with `python -m specjax.bench cpu` (2-core AMD EPYC, jaxlib 0.10.2; table in the
README): every XLA:CPU option jaxlib accepts for dense work -- XNNPACK off, XNNPACK graph
fusion, oneDNN and its dot fusion, YNNPACK dot fusion, single-threaded Eigen, the
concurrency-optimised scheduler, the thunk runtime off (accepted, no effect) -- moved the
decode step by no more than run-to-run noise (about 5%), none consistently faster; fast math
gained about 4% but trades exact float semantics (NaN/Inf handling, approximate exp) that
greedy parity with transformers rests on. So the defaults stand and this list is empty.
"""
from __future__ import annotations

import logging
import os

DEFAULT_FLAGS: tuple[str, ...] = ()


def apply() -> None:
    user = os.environ.get("XLA_FLAGS", "")
    ours = [f for f in DEFAULT_FLAGS if f.split("=")[0] not in user]
    extra = os.environ.get("SPECJAX_EXTRA_XLA_FLAGS", "").split()
    if not ours and not extra:
        return
    if _backend_started():
        logging.getLogger("specjax").warning(
            "JAX's backend started before specjax was imported: XLA flags %s not applied",
            " ".join(ours + extra))
        return
    os.environ["XLA_FLAGS"] = " ".join([user, *ours, *extra]).strip()


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):
        return False
