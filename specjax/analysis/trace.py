"""Per-step acceptance records of a run: `with trace(llm) as t: llm.generate(...)`."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import numpy as np

from specjax.engine.stats import StepRecord
from specjax.llm import LLM


@dataclasses.dataclass
class Trace:
    """The generation steps an engine settled while tracing, in order (`StepRecord`s: draft
    length, rows' request ids, drafts verified and accepted per row, the gate's rolling
    acceptance, host times)."""

    records: list[StepRecord] = dataclasses.field(default_factory=list)

    def accepted(self, request_ids: Sequence[int] | None = None) -> np.ndarray:
        """[request-steps] accepted drafts of each request-step that verified drafts (of
        `request_ids` only, when given), in step order."""
        keep = None if request_ids is None else set(request_ids)
        return np.array([a for r in self.records
                         for rid, v, a in zip(r.request_ids, r.verified, r.accepted)
                         if v > 0 and (keep is None or rid in keep)], int)

    def accepted_histogram(self, request_ids: Sequence[int] | None = None) -> list[int]:
        """h[a] = request-steps that accepted exactly a drafts (`EngineStats`' histogram, for
        this trace or some of its requests)."""
        return np.bincount(self.accepted(request_ids)).tolist()

    def per_request(self) -> dict[int, np.ndarray]:
        """request id -> [its steps with drafts] accepted drafts per step."""
        out: dict[int, list[int]] = {}
        for r in self.records:
            for rid, v, a in zip(r.request_ids, r.verified, r.accepted):
                if v > 0:
                    out.setdefault(rid, []).append(a)
        return {k: np.array(v) for k, v in out.items()}

    def step_acceptance(self) -> np.ndarray:
        """[steps] accepted / verified drafts over each step's rows (nan: a step without
        drafts): what the gate averages."""
        return np.array([sum(r.accepted) / sum(r.verified) if sum(r.verified) else np.nan
                         for r in self.records])

    def gate_means(self) -> np.ndarray:
        """[steps] the gate's rolling acceptance after each step (nan until its window fills;
        after it trips the gate records nothing more, so the value stays the one that
        tripped it)."""
        return np.array([np.nan if r.gate_mean is None else r.gate_mean for r in self.records])

    def gate_tripped_at(self) -> int | None:
        """Index of the step after which the gate turned speculation off (None: it did not)."""
        return next((i for i, r in enumerate(self.records) if r.gate_disabled), None)

    def draft_lens(self) -> np.ndarray:
        return np.array([r.draft_len for r in self.records], int)

    def step_seconds(self) -> np.ndarray:
        """[steps - 1] host time between consecutive settled steps: the step time while the
        engine is busy (a gap between generate calls shows up once)."""
        return np.diff([r.time for r in self.records])

    def draft_seconds(self) -> np.ndarray:
        """[steps - 1] host drafting time between consecutive settled steps (in-step drafters
        draft inside the step: zero here)."""
        return np.diff([r.draft_time for r in self.records])


@contextlib.contextmanager
def trace(llm: LLM) -> Iterator[Trace]:
    """Record every generation step `llm` settles inside the block. Statistics are kept as
    usual; the trace's list is `llm.stats.trace` while the block runs (`llm.reset_stats()`
    empties both)."""
    stats = llm.engine.stats
    if stats.trace is not None:
        raise RuntimeError("this LLM is already being traced")
    out = Trace()
    stats.trace = out.records
    try:
        yield out
    finally:
        stats.trace = None
