"""The compile counter sees compilations (positive control), so "zero compiles after warm-up"
checks cannot pass by measuring nothing."""
import jax
import numpy as np
import pytest

from specjax.engine import compile_counter
from specjax.engine.compile_counter import CompileCounterBroken, count_compilations

CACHE_LOAD_EVENT = "/jax/compilation_cache/cache_hits"


def test_a_fresh_jit_counts_and_a_cached_call_does_not():
    double = jax.jit(lambda x: 2 * x - 1)
    x = np.arange(4, dtype=np.float32)
    with count_compilations() as compiled:
        jax.block_until_ready(double(x))
        assert compiled() >= 1
    with count_compilations() as compiled:
        jax.block_until_ready(double(x))  # the same shapes: the cached executable
        assert compiled() == 0
    with count_compilations() as compiled:
        jax.block_until_ready(double(np.arange(5, dtype=np.float32)))  # a new shape
        assert compiled() >= 1


def test_a_renamed_event_is_caught(monkeypatch):
    compile_counter.compilations()  # listening, and checked once already
    # As if JAX had renamed the event: the listener hears none of it any more.
    monkeypatch.setattr(compile_counter, "_BACKEND_COMPILE_EVENT", "/jax/renamed/compile")
    with pytest.raises(CompileCounterBroken, match="update _BACKEND_COMPILE_EVENT"):
        compile_counter._positive_control()
    # The check runs on first use: a zero-compile block would raise instead of reading 0.
    monkeypatch.setattr(compile_counter, "_verified", False)
    with pytest.raises(CompileCounterBroken), count_compilations():
        pass
    assert not compile_counter._verified  # still unchecked: the next use checks again


def test_a_program_loaded_from_the_persistent_cache_counts():
    # tests/conftest.py gives this process an empty persistent cache: after the in-memory
    # executables are dropped, the same program comes back from disk, not from XLA.
    assert jax.config.jax_compilation_cache_dir
    loads = []
    listener = lambda event, **_: loads.append(event) if event == CACHE_LOAD_EVENT else None
    jax.monitoring.register_event_listener(listener)
    try:
        _build_drop_and_load(loads)
    finally:
        jax.monitoring.unregister_event_listener(listener)


def _build_drop_and_load(loads):
    salt = np.float32(np.random.default_rng().integers(1, 1_000_000))  # no other test's program
    program = jax.jit(lambda x: x * salt + 3)
    x = np.arange(3, dtype=np.float32)
    with count_compilations() as compiled:
        jax.block_until_ready(program(x))
        assert compiled() == 1 and not loads  # built by XLA
    jax.clear_caches()
    with count_compilations() as compiled:
        jax.block_until_ready(program(x))
        assert loads and compiled() == 1  # loaded: still a compilation the step waited for
