"""The compile counter sees compilations (positive control), so "zero compiles after warm-up"
checks cannot pass by measuring nothing."""
import jax
import numpy as np
import pytest

from specjax.engine import compile_counter
from specjax.engine.compile_counter import CompileCounterBroken, count_compilations


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
