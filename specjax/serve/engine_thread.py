"""The engine's host loop in one background thread, fed and drained through thread-safe hand-offs.

Only this thread touches the `Engine`. HTTP handlers `submit` a `Submission` whose `deliver`
callback (made thread-safe by the caller, e.g. `loop.call_soon_threadsafe` into an asyncio
queue) receives `RequestOutput`s, or one `EngineFailure` when the request cannot complete.

Failures stay with the request they belong to: an output the engine finished with
`finish_reason == "error"` fails that request alone; a step that raises (a device fault) fails
the requests it was running. Cancelling is a request too: the thread aborts the engine request,
which frees its slot and KV blocks. `fail_all` ends every open request at once, from any thread
(a shutdown that ran out of time), without waiting for the engine.
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

# What clients are told; engine internals go to the log only.
STEP_FAILED = "internal server error; the request was not completed"
REQUEST_FAILED = ("internal server error: the engine could not complete this request "
                  "(other requests were not affected)")
ADD_FAILED = "internal server error: the engine refused a request the server had accepted"


class QueueFull(Exception):
    """More requests wait for a slot than the server accepts (answered with 429)."""


class EngineStopped(Exception):
    """The engine thread is not running or is shutting down (answered with 503)."""


@dataclasses.dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of an output when the request cannot complete; the request is over.
    `message` is shown to the client; `status` and `code` are what a non-streaming client
    gets as its HTTP status and OpenAI error code."""

    message: str
    status: int = 500
    code: str = "internal_error"


Event = RequestOutput | EngineFailure


@dataclasses.dataclass(eq=False)
class Submission:
    """One request on its way through the engine thread.

    `deliver` is called from the engine thread (or by `fail_all`'s caller); with
    `stream=False` only the final event is delivered, since a non-streaming client reads
    nothing before it. `until`, called on the engine thread with each output, may end the
    request early: it returns the output to deliver as final (the engine request is aborted,
    which frees its blocks), or None to go on.
    """

    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[Event], None]
    stream: bool = True
    request_id: int | None = None     # the engine's id, set by the engine thread
    cancelled: bool = False
    done: bool = False                # its final event went out (or it was cancelled)
    submit_time: float = dataclasses.field(default_factory=time.perf_counter)
    until: Callable[[RequestOutput], RequestOutput | None] | None = None


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
        self._open: set[Submission] = set()    # submitted and not done
        # Requests waiting in the engine: raised under the lock as the inbox is taken, reset
        # from the engine's own count after every iteration. It never under-counts (the queue
        # limit is exact); those a step in progress admits count until the step returns.
        self._engine_waiting = 0
        self._live: dict[int, Submission] = {}  # engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        # A background warm-up (`Engine.warmup(background=True)`) is under way: compiles while
        # no request is in hand, then the step costs measured (`Engine.background_work`).
        self.warming = False
        self._publish()

    # -- called from other threads --------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_active(self) -> int:
        """Requests handed over and not yet finished (a racy read; for tests and logs)."""
        return len(self._open)

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._inbox) + self._engine_waiting

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specjax-engine", daemon=True)
        self._thread.start()

    def begin_stop(self) -> None:
        """Refuse new requests; the thread exits once the work in hand is done."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def stop(self, timeout: float | None = 30.0) -> bool:
        """`begin_stop`, then wait at most `timeout` for the thread; True if it ended (a step
        that hangs on the device leaves the daemon thread behind)."""
        self.begin_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %s s", timeout)
                return False
        return True

    def submit(self, submission: Submission) -> None:
        """Hand a validated request to the engine; raises QueueFull or EngineStopped."""
        self.submit_all([submission])

    def submit_all(self, submissions: list[Submission]) -> None:
        """Hand over the engine requests of one HTTP request (its choices) all at once, or
        none of them: raises QueueFull if they do not all fit in the queue."""
        with self._cond:
            if not self.alive:
                raise EngineStopped("the server is shutting down" if self._stopping
                                    else "the engine is not running")
            if len(self._inbox) + self._engine_waiting + len(submissions) > self.max_queue:
                raise QueueFull(f"the server's queue is full ({self.max_queue} requests "
                                "waiting); retry later")
            self._inbox.extend(submissions)
            self._open.update(submissions)
            self._cond.notify()

    def cancel(self, submission: Submission) -> None:
        """Abort a request (its client went away); safe to call more than once."""
        with self._cond:
            if submission.cancelled or submission.done:
                return
            submission.cancelled = True
            self._cancels.append(submission)
            self._cond.notify()

    def fail_all(self, failure: EngineFailure) -> int:
        """End every open request with `failure` now, and have the engine thread abort them
        when it next can; returns how many there were."""
        with self._cond:
            victims = [sub for sub in list(self._open)
                       if self._deliver_locked(sub, failure, final=True)]
            self._cancels.extend(victims)
            self._cond.notify()
        for sub in victims:
            self._report(sub, failure)
        return len(victims)

    # -- the engine thread ----------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._inbox or self._cancels or self._stopping
                    or self.engine.has_unfinished())

    def _run(self) -> None:
        engine = self.engine
        self.warming = engine.background_work(idle=True)
        while True:
            with self._cond:
                while not self._has_work() and not self.warming:
                    self._cond.wait()
                if self.warming and not self._has_work():
                    self._cond.wait(0.1)   # a background warm-up goes on: look again soon
                idle = not self._has_work()
                if self._stopping and not (self._inbox or self._cancels
                                           or engine.has_unfinished()):
                    break
            if self.warming:
                # A request holds the warm-up's next compile; idle, the engine measures the
                # step costs once everything is compiled.
                self.warming = engine.background_work(idle)
            if idle:
                continue
            with self._cond:
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                self._engine_waiting += len(inbox)
            for sub in inbox:
                self._add(sub)
            for sub in cancels:
                if sub.request_id is None:
                    continue  # never added: cancelled or failed before the engine saw it
                if self._live.pop(sub.request_id, None) is not None:
                    engine.abort(sub.request_id)
                    self._deliver(sub, None, final=True)
            if engine.has_unfinished():
                self._step()
            self._publish()
        engine.background_work(idle=False)   # a background warm-up starts no more compiles
        self._publish()

    def _add(self, sub: Submission) -> None:
        if sub.cancelled or sub.done:
            self._deliver(sub, None, final=True)
            return
        try:
            sub.request_id = self.engine.add_request(sub.prompt_ids, sub.params)
        except Exception as e:  # handlers validate first, so this is a bug: fail one request
            log.exception("engine rejected a request the server had validated")
            self.errors.append(e)
            self._deliver(sub, EngineFailure(ADD_FAILED), final=True)
            return
        self._live[sub.request_id] = sub

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # Keep serving: fail the requests the step was working on, free their blocks.
            failed = self._running_at_failure()
            log.exception("engine step failed; failing %d running request(s)", len(failed))
            self.errors.append(e)
            self._fail(failed)
            return
        for out in outputs:
            sub = self._live.get(out.request_id)
            if sub is None:
                continue  # cancelled while its step was in flight
            if sub.until is not None and out.finish_reason != "error":
                out = self._until(sub, out)
            if out.finished:
                del self._live[out.request_id]
            if out.finish_reason == "error":
                # The engine ended this request alone (and freed what it held).
                log.error("engine failed request %d: %s", out.request_id, out.error)
                self._deliver(sub, EngineFailure(REQUEST_FAILED), final=True)
            elif out.finished or sub.stream:
                self._deliver(sub, out, final=out.finished)

    def _until(self, sub: Submission, out: RequestOutput) -> RequestOutput:
        """The output as the submission's own stop leaves it (a stop that raises fails this
        request alone)."""
        try:
            early = sub.until(out)
        except Exception as e:
            log.exception("request %d: its stop check failed", out.request_id)
            self.errors.append(e)
            early = dataclasses.replace(out, finish_reason="error", error=repr(e)[:500])
        if early is not None and not out.finished:
            self.engine.abort(out.request_id)
        return out if early is None else early

    def _running_at_failure(self) -> list[int]:
        """The requests a failed step was working on: those in the batch; waiting ones hold
        no device state and carry on -- unless nothing was running, when the failure must
        have come from them (admission), and retrying them would fail forever."""
        failed = set(self.engine.snapshot().running_ids) & set(self._live)
        return sorted(failed or self._live)

    def _fail(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            sub = self._live.pop(request_id)
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort after a failed step failed too")
            self._deliver(sub, EngineFailure(STEP_FAILED), final=True)

    def _deliver(self, sub: Submission, event: Event | None, final: bool) -> None:
        with self._cond:
            finished = self._deliver_locked(sub, event, final)
        if finished:
            self._report(sub, event)

    def _deliver_locked(self, sub: Submission, event: Event | None, final: bool) -> bool:
        """The one way events leave, under the lock, so that nothing reaches a request after
        its final event whichever thread sent that; True if this call finished the request.
        `event` None: cancelled, nothing to say."""
        if sub.done:
            return False
        if event is not None:
            try:
                sub.deliver(event)
            except RuntimeError:
                pass  # the event loop is closed: the server is shutting down
        if final:
            sub.done = True
            self._open.discard(sub)
        return final

    def _report(self, sub: Submission, event: Event | None) -> None:
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
