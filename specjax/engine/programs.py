"""The compiled programs of one executor: each step shape compiled once, ahead of time or in
the background while a server already answers, or on demand when a batch first needs it.

A shape is compiled by lowering its jitted function for the arguments' shapes and compiling
that (`jax.jit(f).lower(...).compile()`): JAX keeps the executable where a call with real
arguments of those shapes finds it, so the call then runs with no compile. Whoever needs a
shape first compiles it, and a caller that needs a shape another thread is compiling waits
for that compile rather than starting a second one.

The background thread compiles a list of shapes in order (what the first requests need
first), and only while `idle` is set: a request that arrives shares the cores with at most
the one compile already under way, never with the rest of the list.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Hashable, Iterable

log = logging.getLogger("specjax.engine")

Key = Hashable


class Programs:
    """`ensure(key)` before running the program `key` names; `compile(key)` does the work."""

    def __init__(self, compile: Callable[[Key], None]):
        self._compile = compile
        self._lock = threading.Lock()
        self._futures: dict[Key, concurrent.futures.Future] = {}
        self.idle = threading.Event()         # the background thread starts compiles only then
        self.idle.set()
        self._thread: threading.Thread | None = None
        self.pending = 0                      # background keys not compiled yet

    def ready(self, key: Key) -> bool:
        with self._lock:
            future = self._futures.get(key)
        return future is not None and future.done() and future.exception() is None

    def ensure(self, key: Key) -> None:
        """Return once `key` is compiled: at once if it is, after the compile under way if
        another thread is compiling it, else after compiling it here. A failed compile raises
        here (and in every caller that waited for it); the next call tries again."""
        with self._lock:
            future = self._futures.get(key)
            owner = future is None
            if owner:
                future = self._futures[key] = concurrent.futures.Future()
        if not owner:
            future.result()
            return
        try:
            self._compile(key)
        except BaseException as e:
            with self._lock:
                del self._futures[key]
            future.set_exception(e)
            raise
        future.set_result(None)

    # -- in the background ------------------------------------------------------------------

    @property
    def compiling(self) -> bool:
        """Whether the background thread still has keys to compile."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, keys: Iterable[Key]) -> None:
        """Compile `keys` in order on a daemon thread, each only once `idle` is set (a
        process that ends mid-warm-up leaves it waiting: it holds no lock and dies with the
        process)."""
        keys = list(keys)
        self.pending = len(keys)
        self._thread = threading.Thread(target=self._run, args=(keys,), daemon=True,
                                        name="specjax-compile")
        self._thread.start()

    def _run(self, keys: list[Key]) -> None:
        start = time.perf_counter()
        for key in keys:
            self.idle.wait()
            try:
                self.ensure(key)
            except Exception:  # the caller that needs it will compile (and fail) again
                log.exception("compiling %s in the background failed", key)
            self.pending -= 1
        log.info("warm-up: %d programs compiled (or loaded) in the background in %.1f s",
                 len(keys), time.perf_counter() - start)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background thread (True if it is done)."""
        if self._thread is not None:
            self.idle.set()
            self._thread.join(timeout)
        return not self.compiling
