"""Count XLA compilations, to prove that serving after warm-up never compiles.

The count comes from one JAX monitoring event, named below. JAX sends it for a program XLA
built and for one loaded from the persistent compilation cache instead: either way the step
waited for a program that was not in memory. Should JAX rename or stop sending it, every "no
compilation" check would pass without measuring anything, so the first use in a process
compiles a fresh function and raises `CompileCounterBroken` unless that was counted.
"""
from __future__ import annotations

import contextlib
import threading
import time

import jax
import numpy as np
from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()        # the count (the listener may run on any thread)
_setup_lock = threading.Lock()  # installing and checking the listener, once per process
_count = 0
_installed = False
_verified = False


class CompileCounterBroken(RuntimeError):
    """Compiling a fresh function did not reach the counter: it cannot prove zero compiles."""


def _listener(event: str, duration: float, **_) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def _current() -> int:
    with _lock:
        return _count


def _positive_control() -> None:
    """Compile a function no cache can hold (a new closure over a constant unique to this
    call) and raise unless the listener counted it."""
    before = _current()
    salt = np.float32(time.perf_counter_ns() % 1_000_003)
    jax.block_until_ready(jax.jit(lambda x: x * salt + 1)(np.float32(1)))
    if _current() == before:
        raise CompileCounterBroken(
            f"compiling a fresh jitted function sent no {_BACKEND_COMPILE_EVENT!r} event "
            f"(jax {jax.__version__}): the compile counter would report 0 for anything; "
            "update _BACKEND_COMPILE_EVENT in specjax/engine/compile_counter.py")


def compilations() -> int:
    """Backend compilations in this process since the counter was first used. The first call
    checks that the counter sees compilations at all (`CompileCounterBroken` otherwise)."""
    global _installed, _verified
    with _setup_lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True
        if not _verified:
            _positive_control()
            _verified = True
    return _current()


@contextlib.contextmanager
def count_compilations():
    """`with count_compilations() as n: ...; n()` -> compilations inside the block so far."""
    start = compilations()
    yield lambda: compilations() - start
