"""The engine thread over a scripted fake engine: hand-offs, the exact queue limit,
cancellation, an errored output that fails its request alone, a failing step that fails only
the requests it was running, `fail_all`, and a bounded stop."""
from __future__ import annotations

import dataclasses
import logging
import queue
import time

import pytest
from fakes import FakeEngine

from specjax.sampling_params import SamplingParams
from specjax.serve.engine_thread import (REQUEST_FAILED, EngineFailure, EngineStopped,
                                         EngineThread, QueueFull, Submission)


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
    events: queue.Queue = queue.Queue()

    def hold_next_step(event):      # after the first output the next step blocks
        if events.empty() and not event.finished and event.token_ids == [1]:
            engine.in_step.clear()
            engine.gate.clear()
        events.put(event)

    thread.submit(Submission([1, 2], SamplingParams(max_tokens=2), hold_next_step))
    first = (None, events)
    events.get(timeout=10)          # it is running ...
    assert engine.in_step.wait(10)  # ... and the engine thread published that
    queued = [_submit(thread, max_tokens=2) for _ in range(2)]
    with pytest.raises(QueueFull, match="queue is full"):
        _submit(thread)
    engine.gate.set()
    for _, events in [first, *queued]:   # nothing was dropped
        assert _until_final(events)[-1].token_ids == [1, 2]
    assert thread.queue_depth == 0


def test_queue_limit_is_exact_while_the_engine_thread_adds(fake):
    engine, thread, _ = fake
    thread.max_queue = 4
    engine.add_gate.clear()         # the engine thread takes the inbox, then stops in add
    _submit(thread)
    assert engine.in_add.wait(10)
    for _ in range(3):
        _submit(thread)
    with pytest.raises(QueueFull):  # 4 wait: the one being added counts
        _submit(thread)
    assert thread.queue_depth == 4
    engine.add_gate.set()


def test_error_output_fails_that_request_alone(caplog):
    engine = FakeEngine(slots=2)
    engine.error_ids.add(0)
    finished = []
    thread = EngineThread(engine, on_finished=lambda s, e: finished.append(e))
    thread.start()
    try:
        for stream in (True, False):
            engine.error_ids.add(engine._next)
            bad, bad_events = _submit(thread, max_tokens=5, stream=stream)
            good, good_events = _submit(thread, max_tokens=3, stream=stream)
            with caplog.at_level(logging.ERROR, logger="specjax.serve"):
                failure = _until_final(bad_events)[-1]
            assert failure == EngineFailure(REQUEST_FAILED)    # no engine internals
            assert failure.status == 500 and "secret" not in failure.message
            assert bad_events.empty()                          # nothing after the final
            assert _until_final(good_events)[-1].token_ids == [1, 2, 3]
        assert "injected: device secret" in caplog.text     # the log has the engine's words
        assert thread.errors == [] and engine.aborted == []  # the engine ended it itself
        assert [type(e) for e in finished].count(EngineFailure) == 2 and len(finished) == 4
        assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
    finally:
        thread.stop(10)


def test_failed_step_fails_running_requests_and_keeps_serving(fake, caplog):
    engine, thread, finished = fake
    engine.gate.clear()
    a = _submit(thread, max_tokens=2)
    assert engine.in_step.wait(10)
    b = _submit(thread, max_tokens=2)     # waits: one slot
    engine.fail_next = True
    with caplog.at_level(logging.ERROR, logger="specjax.serve"):
        engine.gate.set()
        assert isinstance(_until_final(a[1])[-1], EngineFailure)
    assert "failing 1 running request(s)" in caplog.text   # a, not b (which waited)
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


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_until_ends_a_request_early_and_frees_it(fake, stream, caplog):
    engine, thread, finished = fake
    cut = lambda out: (dataclasses.replace(out, text="cut", finish_reason="length")
                       if len(out.token_ids) == 2 else None)
    events: queue.Queue = queue.Queue()
    sub = Submission([1, 2], SamplingParams(max_tokens=100), events.put, stream=stream,
                     until=cut)
    thread.submit(sub)
    got = _until_final(events)
    assert [o.token_ids for o in got] == ([[1], [1, 2]] if stream else [[1, 2]])
    assert got[-1].text == "cut" and finished == [got[-1]]
    assert engine.aborted == [sub.request_id]
    # A check that raises fails its own request alone.
    boom = lambda out: 1 / 0
    bad = Submission([1], SamplingParams(max_tokens=100), events.put, stream=stream, until=boom)
    thread.submit(bad)
    with caplog.at_level(logging.ERROR, logger="specjax.serve"):
        assert _until_final(events) == [EngineFailure(REQUEST_FAILED)]
    assert len(thread.errors) == 1 and engine.aborted == [sub.request_id, bad.request_id]
    thread.errors.clear()
    assert _until_final(_submit(thread, max_tokens=2)[1])[-1].token_ids == [1, 2]
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


def test_fail_all_ends_every_open_request_once(fake):
    engine, thread, finished = fake
    engine.gate.clear()
    running, running_events = _submit(thread, max_tokens=100)
    assert engine.in_step.wait(10)
    waiting, waiting_events = _submit(thread, max_tokens=100, stream=False)
    failure = EngineFailure("shutting down", 503, "shutting_down")
    assert thread.fail_all(failure) == 2
    assert _until_final(running_events)[-1] == failure
    assert _until_final(waiting_events) == [failure]
    thread.cancel(running)             # too late: already over
    assert thread.fail_all(failure) == 0
    engine.gate.set()
    deadline = time.monotonic() + 10
    while engine.has_unfinished():     # the engine thread aborts what fail_all ended
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert running_events.empty() and waiting_events.empty()   # nothing after the final
    assert finished == [failure, failure]                      # reported once each
    assert thread.alive and _until_final(_submit(thread, max_tokens=1)[1])[-1].finished


def test_stop_is_bounded_when_a_step_hangs(fake):
    engine, thread, _ = fake
    engine.gate.clear()
    _submit(thread)
    assert engine.in_step.wait(10)
    start = time.monotonic()
    assert thread.stop(0.2) is False   # the step never returns: give up, do not hang
    assert time.monotonic() - start < 2
    with pytest.raises(EngineStopped, match="shutting down"):
        _submit(thread)


def test_a_background_warm_up_goes_on_only_while_no_request_is_in_hand():
    engine = FakeEngine(step_delay=0.01)
    engine.warm_up = 10 ** 9                  # still warming up through the request below
    thread = EngineThread(engine)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not engine.background_calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.warming                 # what /health reports
        _until_final(_submit(thread, max_tokens=5)[1])
        deadline = time.monotonic() + 10
        while not engine.background_calls[-1][0] and time.monotonic() < deadline:
            time.sleep(0.01)
        calls = list(engine.background_calls)
        # Held while the request ran (its steps saw it), idle again once it finished.
        assert (False, 1) in calls and calls[0][0] and calls[-1][0]
        assert all(not idle for idle, running in calls if running)
        engine.warm_up = 1
        deadline = time.monotonic() + 10
        while thread.warming and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not thread.warming
        done = len(engine.background_calls)
        time.sleep(0.3)                       # done: the thread sleeps until work comes
        assert len(engine.background_calls) <= done + 1
    finally:
        thread.stop(10)
