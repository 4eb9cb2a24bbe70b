"""Each generation step's draft length: `DraftLengthPolicy`, the one object the engine asks.

The rules, in order (`choose`):

- the fixed length: the schedule's for the batch size (`draft_len_schedule`, else the longest),
  0 once the gate has tripped -- what every step runs where the cost model has no choice to
  make: a schedule is set, nothing drafts, no step cost is measured for the batch's bucket, or a
  row's text depends on the lengths its steps verify (`decides_output`);
- a pinned length (`pinned`, an experiment's) wherever the fixed one drafts;
- the cost model (`specjax.speculative.cost_model`): the length with the most expected tokens
  per second among the measured ones, held against noise by its hysteresis; every
  `explore_every` steps, for `explore_steps` steps, the length whose real cost was observed
  longest ago instead (`CostTable.stalest`), so no length's cost or acceptance estimate goes
  stale -- a request whose text turned repetitive, sampled rows that cost more than the warm-up's
  empty batches. A step's cost is observed only in the steady state (`observe`): after
  `STEADY_AFTER` reads of its shape in a row, since the first intervals after a switch carry
  the other shape's work (on a CPU, host and steps share the cores);
- a host drafter's second look (`choose(..., caps, longest)`): its proposals are known, so
  the cost model counts only the drafts each row has;
- at least what a row's grammar forces (`forced_len`), whatever was chosen.

The step cost table (`specjax.engine.costs.CostTable`: `for_bucket`, `stalest`, `touch`,
`observe`) and the batch bucketing are the engine's, handed in: this package sits below it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from specjax.speculative.build import Speculation
from specjax.speculative.cost_model import AcceptanceModel, candidate_lengths, choose_draft_len
from specjax.speculative.schedule import SpeculationGate

EXPLORE_EVERY = 256
EXPLORE_STEPS = 8
# Reads of one generation shape in a row before its intervals count as its cost: under the
# overlap scheduler the first intervals after a switch still hold the other shape's step or
# its host work, which on a 2-core CPU made short explorations choose lengths 15-30% slower
# than the best fixed one (issue 45). An exploration runs long enough to leave steady ones.
STEADY_AFTER = 3


class DraftLengthPolicy:
    """`speculation`: what the engine runs; `costs`: the step cost table (measured at warm-up,
    replaced by `Engine.measure_costs`); `bucket(batch_size)`: the batch bucket a generation
    step of that many rows compiles for; `gate`: the acceptance gate, if any; `explore_every`,
    `explore_steps`: how often and for how many steps the cost model explores;
    `keep_seeded_text`: a sampled request that names its seed keeps its text, so its steps verify
    the fixed length (False lets the cost model choose for it too: a statistical test's seeded
    rows)."""

    def __init__(self, speculation: Speculation, costs: Any, bucket: Callable[[int], int],
                 gate: SpeculationGate | None = None, *, explore_every: int = EXPLORE_EVERY,
                 explore_steps: int = EXPLORE_STEPS, keep_seeded_text: bool = True):
        spec = self.speculation = speculation
        self.costs, self.bucket, self.gate = costs, bucket, gate
        self.explore_every, self.explore_steps = explore_every, explore_steps
        self.keep_seeded_text = keep_seeded_text
        # The cost model is the default wherever no `draft_len_schedule` is configured; it
        # needs measured step costs, and verifies the fixed length where none are.
        self.adaptive = spec.drafting and spec.config.schedule is None
        self.acceptance = (AcceptanceModel(spec.max_draft_len, getattr(
            spec.config, "confidence_scheduling", False)) if spec.drafting else None)
        self.candidates = candidate_lengths(spec.max_draft_len, spec.tree is not None)
        self.pinned: int | None = None   # an experiment's fixed length (benches)
        self._since_explore = 0
        self._exploring: tuple[int, int] | None = None   # (length, steps left)
        self._current: int | None = None   # the cost model's last choice (not exploring)
        self._explored = False   # the last choice was an exploration
        self._last_read: tuple[float, int, tuple[int, int]] | None = None  # time, id, shape
        self._run = 0   # reads of the last read's shape in a row
        self._prefill_since_read = False

    def fixed_len(self, batch_size: int) -> int:
        """The draft length of a generation batch of this size before the cost model's choice
        (0 = plain decoding): the schedule's (or the longest), 0 once the gate has tripped."""
        if self.gate is not None and self.gate.disabled:
            return 0
        return self.speculation.draft_len_for(batch_size)

    def width(self, draft_len: int) -> int:
        """The run width of a step of this draft length: the newest token and what it verifies."""
        return self.speculation.verify_len(draft_len) + 1

    def shapes(self, buckets: Sequence[int], max_batch_size: int) -> list[tuple[int, int]]:
        """(batch bucket, run width) of every generation step this policy can choose: each
        batch size's fixed length, plain steps once the gate can trip, and with the cost model
        every candidate length in every bucket. In the order serving needs them first (what a
        background warm-up compiles first): by bucket, smallest first; in a bucket, the
        fixed length's width, then plain steps, then the rest."""
        first: dict[int, int] = {}
        for n in range(1, max_batch_size + 1):
            first.setdefault(self.bucket(n), self.width(self.fixed_len(n)))
        shapes = {(self.bucket(n), self.width(self.fixed_len(n)))
                  for n in range(1, max_batch_size + 1)}
        if self.gate is not None:  # after the gate trips
            shapes |= {(b, 1) for b in buckets}
        if self.adaptive:
            shapes |= {(b, self.width(d)) for b in buckets for d in self.candidates}
        return sorted(shapes, key=lambda s: (s[0], s[1] != first.get(s[0]), s[1] != 1, s[1]))

    def decides_output(self, request) -> bool:
        """Whether this request's tokens depend on the draft lengths its steps verify: a
        sampled request that names its seed (its text must repeat), accepted by rejection
        sampling along a chain or down a tree (the draws consumed depend on where steps
        start). Strict matching emits the target's own (seed, position) draws at any length."""
        spec = self.speculation
        return (self.keep_seeded_text and request.params.seed is not None
                and request.params.temperature > 0
                and bool(spec.config.use_rejection_sampling) and spec.worker is not None)

    def step_costs(self, batch_size: int) -> dict[int, float]:
        """draft length -> measured seconds of its step, for the bucket of this batch size
        ({} where that bucket is not measured)."""
        measured = self.costs.for_bucket(self.bucket(batch_size))
        return {d: measured[self.width(d)] for d in self.candidates
                if self.width(d) in measured}

    def choose(self, requests: Sequence, caps: np.ndarray | None = None,
               longest: int | None = None) -> int:
        """This step's draft length for these rows (engine `Request`s): the cost model's
        choice among the measured lengths (up to `longest`; `caps` `[rows]`: drafts each row
        can verify), or the fixed length where there is no choice to make."""
        fixed = self.fixed_len(len(requests))
        if longest is not None:
            fixed = min(fixed, longest)
        if self.pinned is not None and fixed:
            return min(self.pinned, self.speculation.max_draft_len)
        if not (self.adaptive and fixed) or any(map(self.decides_output, requests)):
            return fixed
        costs = self.step_costs(len(requests))
        if longest is not None:
            costs = {d: t for d, t in costs.items() if d <= longest}
        if 0 not in costs or len(costs) < 2:
            return fixed
        if longest is not None:  # a host drafter's second look: its proposals are known
            if self.exploring:   # an exploring step runs the length it explores
                return longest
            return choose_draft_len(self._survival(requests), costs, caps)
        explored = self._explore(len(requests), costs)
        if explored is not None:
            return explored
        # A drafter's own confidences move with its drafts step by step, and a block drafted
        # at full width makes a switch between draft lengths free: the hysteresis holds only
        # against leaving plain decoding, whose step drafted nothing for the next to verify.
        current = self._current
        if self.acceptance.drafter_confidence and current:
            current = None
        self._current = choose_draft_len(self._survival(requests), costs, caps, current)
        return self._current

    def _survival(self, requests: Sequence) -> np.ndarray:
        return self.acceptance.survival([r.request_id for r in requests])

    def _explore(self, batch_size: int, costs: dict[int, float]) -> int | None:
        """The length this step explores, or None where it does not explore."""
        self._since_explore += 1
        self._explored = True
        if self._exploring and self._exploring[1] > 0 and self._exploring[0] in costs:
            self._exploring = (self._exploring[0], self._exploring[1] - 1)
            return self._exploring[0]
        if self._since_explore >= self.explore_every:
            self._since_explore = 0
            b = self.bucket(batch_size)
            width = {self.width(d): d for d in costs}
            stalest = self.costs.stalest(b, width)
            self.costs.touch(b, stalest)
            self._exploring = (width[stalest], self.explore_steps - 1)
            return width[stalest]
        self._explored = False
        return None

    @property
    def exploring(self) -> bool:
        """The last choice was an exploration (it runs its length, drafts or not)."""
        return self._explored

    def forced_len(self, requests: Sequence) -> int:
        """The most tokens a row's grammar forces next (capped at the longest chain), where
        the cost model chooses lengths: the step verifies them whatever it chose, since they
        are accepted unless the target spells the same text otherwise, and a step of 1 + k
        tokens costs less than k + 1 steps. Not for trees (a tree's run is its nodes), nor
        where a schedule, the gate or a pinned length decides."""
        D = self.speculation.max_draft_len
        if (not self.adaptive or self.speculation.tree is not None
                or self.pinned is not None or not requests
                or not self.fixed_len(len(requests))):
            return 0
        return max((len(r.grammar.forced(D)) for r in requests if r.grammar is not None),
                   default=0)

    def prefill_ran(self) -> None:
        """A prompt-chunk step ran: the next generation step read does not time its shape."""
        self._prefill_since_read = True

    def observe(self, rows: int, verified_len: int, step_id: int) -> None:
        """What a generation shape really costs: the time from reading one generation step to
        reading the next of the same shape, when no prompt chunk ran between (the caller's
        loop included; with the overlap scheduler that is the device's time for the step
        read, or the host's iteration where the host is slower)."""
        if not self.adaptive:
            return
        now = time.perf_counter()
        shape = (self.bucket(rows), verified_len + 1)
        last, self._last_read = self._last_read, (now, step_id, shape)
        if (last is None or self._prefill_since_read or step_id != last[1] + 1
                or shape != last[2]):  # on a CPU, host and steps share the cores: a step
            self._prefill_since_read = False  # after another shape times a mix of both
            self._run = 1
            return
        self._run += 1
        if self._run >= STEADY_AFTER:
            self.costs.observe(*shape, now - last[0])

    def forget(self, request_id: int) -> None:
        """A request finished: drop its acceptance estimates."""
        if self.acceptance is not None:
            self.acceptance.forget(request_id)
