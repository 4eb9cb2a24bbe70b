"""The engine thread over a scripted fake engine: hand-offs, queue limit, cancellation, and a
failing step that fails only the requests it was running."""
from __future__ import annotations

import collections
import queue
import threading

import pytest

from specjax.engine.engine import EngineSnapshot
from specjax.engine.request import RequestOutput, RequestStats
from specjax.sampling_params import SamplingParams
from specjax.serve.engine_thread import (EngineFailure, EngineStopped, EngineThread, QueueFull,
                                         Submission)


class FakeAllocator:
    total_blocks = 10

    def __init__(self):
        self.num_free_blocks = self.total_blocks


class FakeEngine:
    """`slots` requests run at once, each holding one block and gaining one token a step."""

    def __init__(self, slots: int = 1):
        self.slots = slots
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.allocator = FakeAllocator()
        self.num_steps = 0
        self.gate = threading.Event()       # a step waits for it (tests hold steps back)
        self.gate.set()
        self.in_step = threading.Event()    # set once a step has admitted its requests
        self.fail_next = False
        self.aborted: list[int] = []
        self._next = 0

    def add_request(self, prompt_ids, params):
        rid, self._next = self._next, self._next + 1
        self.waiting.append(type("R", (), dict(request_id=rid, prompt=list(prompt_ids),
                                               params=params, out=[]))())
        return rid

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def abort(self, rid):
        self.aborted.append(rid)
        for r in list(self.waiting):
            if r.request_id == rid:
                self.waiting.remove(r)
        for r in list(self.running):
            if r.request_id == rid:
                self.running.remove(r)
                self.allocator.num_free_blocks += 1

    def snapshot(self):
        return EngineSnapshot(
            running=len(self.running), waiting=len(self.waiting),
            running_ids=tuple(r.request_id for r in self.running),
            kv_blocks_free=self.allocator.num_free_blocks,
            kv_blocks_total=self.allocator.total_blocks, num_steps=self.num_steps)

    def step(self):
        self.num_steps += 1
        while self.waiting and len(self.running) < self.slots:
            self.running.append(self.waiting.popleft())
            self.allocator.num_free_blocks -= 1
        self.in_step.set()
        assert self.gate.wait(10), "a test held the step back too long"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        outs = []
        for r in list(self.running):
            r.out.append(len(r.out) + 1)
            done = len(r.out) == r.params.max_tokens
            if done:
                self.running.remove(r)
                self.allocator.num_free_blocks += 1
            outs.append(RequestOutput(r.request_id, r.prompt, list(r.out), "",
                                      "length" if done else None, RequestStats()))
        return outs


def _submit(thread: EngineThread, max_tokens: int = 3, stream: bool = True):
    events: queue.Queue = queue.Queue()
    sub = Submission([1, 2], SamplingParams(max_tokens=max_tokens), events.put, stream=stream)
    thread.submit(sub)
    return sub, events


def _until_final(events: queue.Queue) -> list:
    got = []
    while not got or not (isinstance(got[-1], EngineFailure) or got[-1].finished):
        got.append(events.get(timeout=10))
    return got


@pytest.fixture
def fake():
    engine = FakeEngine()
    finished = []
    thread = EngineThread(engine, max_queue=2, on_finished=lambda s, e: finished.append(e))
    thread.start()
    yield engine, thread, finished
    engine.gate.set()
    thread.stop(10)
    assert not thread.alive


def test_streams_cumulative_outputs_then_the_final_one(fake):
    engine, thread, finished = fake
    _, events = _submit(thread, max_tokens=3)
    got = _until_final(events)
    assert [o.token_ids for o in got] == [[1], [1, 2], [1, 2, 3]]
    assert got[-1].finish_reason == "length" and finished == [got[-1]]


def test_non_streaming_gets_only_the_final_output(fake):
    _, thread, _ = fake
    _, events = _submit(thread, max_tokens=4, stream=False)
    got = _until_final(events)
    assert len(got) == 1 and got[0].token_ids == [1, 2, 3, 4]


def test_queue_limit_counts_requests_not_yet_running(fake):
    engine, thread, _ = fake
    engine.gate.clear()             # the first step blocks: later requests pile up
    first = _submit(thread, max_tokens=2)
    assert engine.in_step.wait(10)
    queued = [_submit(thread, max_tokens=2) for _ in range(2)]
    with pytest.raises(QueueFull, match="queue is full"):
        _submit(thread)
    engine.gate.set()
    for _, events in [first, *queued]:   # nothing was dropped
        assert _until_final(events)[-1].token_ids == [1, 2]
    assert thread.queue_depth == 0


def test_failed_step_fails_running_requests_and_keeps_serving(fake):
    engine, thread, finished = fake
    engine.gate.clear()
    a = _submit(thread, max_tokens=2)
    assert engine.in_step.wait(10)
    b = _submit(thread, max_tokens=2)     # waits: one slot
    engine.fail_next = True
    engine.gate.set()
    assert isinstance(_until_final(a[1])[-1], EngineFailure)
    assert _until_final(b[1])[-1].token_ids == [1, 2]
    assert len(thread.errors) == 1 and "boom" in str(thread.errors[0])
    assert engine.aborted == [a[0].request_id]
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
    assert thread.alive and _until_final(_submit(thread, max_tokens=1)[1])[-1].finished
    assert sum(isinstance(e, EngineFailure) for e in finished) == 1


def test_cancel_aborts_and_frees(fake):
    engine, thread, finished = fake
    sub, events = _submit(thread, max_tokens=10_000)
    events.get(timeout=10)              # it is running
    thread.cancel(sub)
    thread.cancel(sub)                  # twice is harmless
    done = _submit(thread, max_tokens=1)[1]
    assert _until_final(done)[-1].finished   # the slot came back
    assert engine.aborted == [sub.request_id]
    assert None in finished             # reported to the hook as cancelled
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks


def test_cancel_before_the_engine_saw_it(fake):
    engine, thread, _ = fake
    engine.gate.clear()
    _submit(thread, max_tokens=1)
    assert engine.in_step.wait(10)
    sub, _ = _submit(thread)
    thread.cancel(sub)
    engine.gate.set()
    thread.stop(10)
    assert sub.request_id is None and engine._next == 1   # never added


def test_submit_after_stop_is_refused(fake):
    _, thread, _ = fake
    thread.stop(10)
    with pytest.raises(EngineStopped):
        _submit(thread)


def test_snapshot_is_published(fake):
    engine, thread, _ = fake
    _until_final(_submit(thread, max_tokens=2)[1])
    thread.stop(10)
    snap = thread.snapshot
    assert (snap.running, snap.waiting) == (0, 0)
    assert snap.kv_blocks_free == snap.kv_blocks_total == 10
    assert snap.num_steps == engine.num_steps
