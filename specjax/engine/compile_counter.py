"""Count XLA compilations, to prove that serving after warm-up never compiles."""
from __future__ import annotations

import contextlib
import threading

from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration: float, **_) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def compilations() -> int:
    """Backend compilations in this process since the counter was first used."""
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True
        return _count


@contextlib.contextmanager
def count_compilations():
    """`with count_compilations() as n: ...; n()` -> compilations inside the block so far."""
    start = compilations()
    yield lambda: compilations() - start
