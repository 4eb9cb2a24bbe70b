"""The engine's host loop in one background thread, fed and drained through thread-safe hand-offs.

Only this thread touches the `Engine`. HTTP handlers `submit` a `Submission` whose `deliver`
callback (made thread-safe by the caller, e.g. `loop.call_soon_threadsafe` into an asyncio
queue) receives `RequestOutput`s and, if a step fails, one `EngineFailure`. Cancelling is a
request too: the thread aborts the engine request, which frees its slot and KV blocks.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from specjax.engine.engine import Engine, EngineSnapshot
from specjax.engine.request import RequestOutput
from specjax.sampling_params import SamplingParams

log = logging.getLogger("specjax.serve")


class QueueFull(Exception):
    """More requests wait for a slot than the server accepts (answered with 429)."""


class EngineStopped(Exception):
    """The engine thread is not running (answered with 503)."""


@dataclasses.dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of an output when a step raised; the request is over."""

    message: str


Event = RequestOutput | EngineFailure


@dataclasses.dataclass(eq=False)
class Submission:
    """One request on its way through the engine thread.

    `deliver` is called from the engine thread; with `stream=False` only the final output is
    delivered, since a non-streaming client reads nothing before it.
    """

    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[Event], None]
    stream: bool = True
    request_id: int | None = None     # the engine's id, set by the engine thread
    cancelled: bool = False
    submit_time: float = dataclasses.field(default_factory=time.perf_counter)


class EngineThread:
    """Runs `engine.step()` while there is work and sleeps on a condition when there is none."""

    def __init__(self, engine: Engine, max_queue: int = 256,
                 on_finished: Callable[[Submission, Event | None], None] | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.on_finished = on_finished
        self.errors: list[BaseException] = []   # step failures, for logs and for tests
        self.snapshot = EngineSnapshot()
        self._cond = threading.Condition()
        self._inbox: list[Submission] = []
        self._cancels: list[Submission] = []
        self._engine_waiting = 0
        self._live: dict[int, Submission] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._publish()

    # -- called from other threads --------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_active(self) -> int:
        """Requests handed over and not yet finished (a racy read; for tests and logs)."""
        return len(self._inbox) + len(self._live)

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._inbox) + self._engine_waiting

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specjax-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop once the work in hand is done (uvicorn drains connections before this)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, submission: Submission) -> None:
        """Hand a validated request to the engine; raises QueueFull or EngineStopped."""
        with self._cond:
            if not self.alive:
                raise EngineStopped("the engine is not running")
            if len(self._inbox) + self._engine_waiting >= self.max_queue:
                raise QueueFull(f"the server's queue is full ({self.max_queue} requests "
                                "waiting); retry later")
            self._inbox.append(submission)
            self._cond.notify()

    def cancel(self, submission: Submission) -> None:
        """Abort a request (its client went away); safe to call more than once."""
        with self._cond:
            if submission.cancelled:
                return
            submission.cancelled = True
            self._cancels.append(submission)
            self._cond.notify()

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._inbox or self._cancels or self._stopping
                           or engine.has_unfinished()):
                    self._cond.wait()
                if self._stopping and not (self._inbox or engine.has_unfinished()):
                    break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            for sub in inbox:
                self._add(sub)
            for sub in cancels:
                if sub.request_id is None:
                    continue  # cancelled before it was added (then never added), or failed
                if self._live.pop(sub.request_id, None) is not None:
                    engine.abort(sub.request_id)
                    self._finished(sub, None)
            if engine.has_unfinished():
                self._step()
            self._publish()
        self._publish()

    def _add(self, sub: Submission) -> None:
        if sub.cancelled:
            self._finished(sub, None)
            return
        try:
            sub.request_id = self.engine.add_request(sub.prompt_ids, sub.params)
        except Exception as e:  # handlers validate first, so this is a bug: fail one request
            log.exception("engine rejected a request the server had validated")
            self.errors.append(e)
            self._send(sub, EngineFailure("the engine rejected the request"), final=True)
            return
        self._live[sub.request_id] = sub

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # Keep serving: fail the requests the step was working on, free their blocks.
            log.exception("engine step failed; failing %d running request(s)", len(self._live))
            self.errors.append(e)
            self._fail_running()
            return
        for out in outputs:
            sub = self._live.get(out.request_id)
            if sub is None:
                continue  # cancelled while its step was in flight
            if out.finished:
                del self._live[out.request_id]
                self._send(sub, out, final=True)
            elif sub.stream:
                self._send(sub, out, final=False)

    def _fail_running(self) -> None:
        """After a failed step, end every request that was in the batch; waiting ones hold no
        device state and carry on -- unless nothing was running, when the failure must have
        come from them (admission), and retrying them would fail forever."""
        failed = set(self.engine.snapshot().running_ids) & set(self._live)
        for request_id in sorted(failed or self._live):
            sub = self._live.pop(request_id)
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort after a failed step failed too")
            self._send(sub, EngineFailure("engine step failed"), final=True)

    def _send(self, sub: Submission, event: Event, final: bool) -> None:
        try:
            sub.deliver(event)
        except RuntimeError:
            pass  # the event loop is closed: the server is shutting down
        if final:
            self._finished(sub, event)

    def _finished(self, sub: Submission, event: Event | None) -> None:
        """Tell the hook a request is over (`event` None: cancelled by its client)."""
        if self.on_finished is not None:
            try:
                self.on_finished(sub, event)
            except Exception:
                log.exception("on_finished hook failed")

    def _publish(self) -> None:
        """Take the engine's snapshot on this thread; other threads read only the copy (with
        the requests handed over but not yet added counted as waiting)."""
        snap = self.engine.snapshot()
        with self._cond:
            self._engine_waiting = snap.waiting
            inbox = len(self._inbox)
        self.snapshot = dataclasses.replace(snap, waiting=snap.waiting + inbox)
