"""A scripted stand-in for the engine, for tests of the engine thread and of the HTTP layer
that need no model (and so no JAX compile)."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
import types

from specjax.engine.engine import EngineSnapshot
from specjax.engine.request import RequestOutput, RequestStats


class FakeAllocator:
    total_blocks = 10

    def __init__(self):
        self.num_free_blocks = self.total_blocks


def fake_logprobs(token: int, k: int) -> dict[int, float]:
    """Deterministic {id: logprob} in the engine's convention: the top k in descending order,
    then the chosen token if it is not among them. An even token is the top one; an odd one
    is outside the top k (so it comes last)."""
    top = [(1000 + j, -0.1 * (j + 1)) for j in range(k)]
    if token % 2 == 0 and k > 0:
        top = [(token, -0.05)] + top[:k - 1]
    entries = dict(top)
    if token not in entries:
        entries[token] = -3.0 - 0.01 * token
    return entries


class FakeEngine:
    """`slots` requests run at once, each holding one block and gaining one token a step
    (token id = its position, 1, 2, ...), a step taking `step_delay` seconds. With
    `tokenizer`, a finished output's text is its tokens decoded (else ""); logprobs and
    prompt logprobs are `fake_logprobs` when the parameters ask for them."""

    max_len = 128
    model_config = types.SimpleNamespace(vocab_size=4096)
    grammars = None   # no structured output
    eos_token_ids = ()
    stats = types.SimpleNamespace(matmul="xla (fake engine)")

    def __init__(self, slots: int = 1, step_delay: float = 0.0, tokenizer=None):
        self.tokenizer = tokenizer
        self.slots = slots
        self.step_delay = step_delay
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.allocator = FakeAllocator()
        self.num_steps = 0
        self.gate = threading.Event()       # a step waits for it (tests hold steps back)
        self.gate.set()
        self.in_step = threading.Event()    # set once a step has admitted its requests
        self.fail_next = False
        self.error_ids: set[int] = set()    # requests the engine ends with "error"
        self.add_gate = threading.Event()   # add_request waits for it
        self.add_gate.set()
        self.in_add = threading.Event()
        # A background warm-up: `warm_up` idle calls of `background_work` before it is done.
        self.warm_up = 0
        self.background_calls: list[tuple[bool, int]] = []   # (idle, running requests)
        self.aborted: list[int] = []
        self.added: list[tuple[list[int], object]] = []   # (prompt, params) per request
        self._next = 0

    def add_request(self, prompt_ids, params):
        self.in_add.set()
        assert self.add_gate.wait(10), "a test held add_request back too long"
        rid, self._next = self._next, self._next + 1
        self.waiting.append(type("R", (), dict(request_id=rid, prompt=list(prompt_ids),
                                               params=params, out=[]))())
        self.added.append((list(prompt_ids), params))
        return rid

    def background_work(self, idle: bool) -> bool:
        self.background_calls.append((idle, len(self.waiting) + len(self.running)))
        self.warm_up -= idle
        return self.warm_up > 0

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
        time.sleep(self.step_delay)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        outs = []
        for r in list(self.running):
            r.out.append(len(r.out) + 1)
            failed = r.request_id in self.error_ids
            done = failed or len(r.out) == r.params.max_tokens
            if done:
                self.running.remove(r)
                self.allocator.num_free_blocks += 1
            reason = "error" if failed else "length" if done else None
            p = r.params
            text = self.tokenizer.decode(r.out) if done and self.tokenizer else ""
            logprobs = (None if getattr(p, "logprobs", None) is None else
                        [fake_logprobs(t, p.logprobs) for t in r.out])
            prompt_logprobs = (None if getattr(p, "prompt_logprobs", None) is None else
                               [None] + [fake_logprobs(t, p.prompt_logprobs)
                                         for t in r.prompt[1:]])
            outs.append(RequestOutput(r.request_id, r.prompt, list(r.out), text, reason,
                                      RequestStats(), "injected: device secret" if failed
                                      else None, logprobs=logprobs,
                                      prompt_logprobs=prompt_logprobs))
        return outs


def fake_llm(tokenizer, engine: FakeEngine):
    """What `create_app` reads of an `LLM`."""
    return types.SimpleNamespace(tokenizer=tokenizer, engine=engine, model_path=None)


def failing_prompt_step(engine, prompt: list[int], error: str = "injected"):
    """`engine.step` (the real one) with every request of `prompt` failed at its first output,
    as the engine fails a request: aborted (its blocks freed) and reported with
    finish_reason "error". Patch it in with `monkeypatch.setattr(engine, "step", ...)`."""
    real_step = engine.step

    def step():
        outs = []
        for out in real_step():
            if out.prompt_token_ids == prompt and not out.finished:
                engine.abort(out.request_id)
                out = dataclasses.replace(out, finish_reason="error", error=error)
            outs.append(out)
        return outs

    return step
