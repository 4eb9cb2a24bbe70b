"""The XLA flags specjax sets, in one place, applied when `specjax` is imported.

XLA reads XLA_FLAGS once, when JAX starts its backend (the first computation or
`jax.devices()`), so these only take effect if specjax is imported before that. A flag the user
already set in XLA_FLAGS is left as the user set it. `SPECJAX_EXTRA_XLA_FLAGS` adds flags on
top (what `python -m specjax.bench xla` uses to time each candidate in its own process).
Which set applies is decided before the backend starts, from what is installed: `GPU_FLAGS`
where a GPU plugin of jaxlib is (and `JAX_PLATFORMS` does not rule the GPU out), else
`CPU_FLAGS`.

CPU, measured with `python -m specjax.bench xla` (2-core AMD EPYC, jaxlib 0.10.2; table in
the README): every XLA:CPU option jaxlib accepts for dense work -- XNNPACK off, XNNPACK graph
fusion, oneDNN and its dot fusion, YNNPACK dot fusion, single-threaded Eigen, the
concurrency-optimised scheduler, the thunk runtime off (accepted, no effect) -- moved the
decode step by no more than run-to-run noise (about 5%), none consistently faster; fast math
gained about 4% but trades exact float semantics (NaN/Inf handling, approximate exp) that
greedy parity with transformers rests on. So the defaults stand and the list is empty.

GPU: launch overhead is what CUDA graphs (XLA's command buffers) remove. XLA's defaults
(jaxlib 0.10.2, read from an HLO dump's debug options) record kernels, cuBLAS / cuDNN calls,
custom calls (the Pallas kernels) and conditionals (`lax.cond`) into command buffers, but not
while loops: the scanned layer stack runs its body's graph once per layer from the host.
`python -m specjax.bench xla --shape llama-3.2-1b` on a GPU times the candidates
(`specjax.bench.xla.GPU_CANDIDATES`: loops inside the graphs, graphs of any size, loops
unrolled into them, command buffers off) and checks each one's greedy output against the
defaults'; `scripts/gpu_check.py` runs it. No GPU has run it yet, so `GPU_FLAGS` is empty
(XLA's defaults) until a measured winner, exact, replaces it.
"""
from __future__ import annotations

import logging
import os

CPU_FLAGS: tuple[str, ...] = ()
GPU_FLAGS: tuple[str, ...] = ()


def gpu_plugin_installed() -> bool:
    """Whether JAX will start on a GPU: a CUDA or ROCm plugin is installed and JAX_PLATFORMS,
    if set, allows it (without starting any backend)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
        return False
    try:
        import pkgutil

        import jax_plugins
    except ImportError:
        return False
    return any("cuda" in m.name or "rocm" in m.name
               for m in pkgutil.iter_modules(jax_plugins.__path__))


def default_flags() -> tuple[str, ...]:
    return GPU_FLAGS if gpu_plugin_installed() else CPU_FLAGS


def apply() -> None:
    user = os.environ.get("XLA_FLAGS", "")
    ours = [f for f in default_flags() if f.split("=")[0] not in user]
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
