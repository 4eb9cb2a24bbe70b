"""Engine-wide speculation statistics. Padding never counts: only real requests' drafts do."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence


def at_least(accepted_histogram: Sequence[int], depth: int) -> list[float]:
    """AR_k = P(accepted >= k) for k = 1..depth, from `accepted_histogram[a]` = request-steps
    that accepted exactly `a` drafts (all zeros before any)."""
    n = sum(accepted_histogram)
    return [sum(accepted_histogram[k:]) / n if n else 0.0 for k in range(1, depth + 1)]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One settled generation step, kept while `EngineStats.trace` is a list
    (`specjax.analysis.trace`). Rows are the step's requests that were still running."""

    draft_len: int                 # the step's runtime draft length (0: no drafts)
    request_ids: tuple[int, ...]   # [rows]
    verified: tuple[int, ...]      # [rows] drafts each row verified (0: none)
    accepted: tuple[int, ...]      # [rows] of those, how many were accepted
    gate_mean: float | None        # the gate's rolling acceptance after it (None: no gate or
                                   # its window is not full yet)
    gate_disabled: bool            # speculation is off for good after this step
    time: float                    # time.perf_counter() when the host settled it
    draft_time: float              # EngineStats.draft_time then (host drafting so far)
    proposed: tuple[int, ...] = () # [rows] drafts each row held before the step's cut


@dataclasses.dataclass
class EngineStats:
    """Running totals over every generation step since the engine started.

    Two histograms give the acceptance-length distribution, over request-steps that verified
    at least one draft (a request-step: one request's row in one generation step):

    - `verified_histogram[d]`: request-steps that verified exactly `d` drafts (`d >= 1`; index
      0 stays 0). Rows verify fewer than the step's draft length when their drafter proposed
      fewer or the request's length limit cut them; the last nonzero index is the deepest
      draft any row verified.
    - `accepted_histogram[a]`: request-steps that accepted exactly `a` of their drafts
      (`a >= 0`); each such step emitted `a + 1` tokens.

    Both lists grow as needed, so they are as long as the largest count seen plus one (empty
    until a draft is verified). Their sums equal `request_steps_with_drafts`;
    `sum(d * n)` over `verified_histogram` equals `drafted_tokens` and over
    `accepted_histogram` equals `accepted_draft_tokens`.
    """

    num_generated_tokens: int = 0
    spec_steps: int = 0               # generation steps that verified at least one draft
    request_steps_with_drafts: int = 0
    accepted_draft_tokens: int = 0
    drafted_tokens: int = 0           # drafts verified (the acceptance-rate denominator)
    proposed_tokens: int = 0          # drafts rows held when dispatched, before the step's
                                      # draft length cut them (`GenerationRow.proposed`)
    draft_time: float = 0.0           # host drafter time (in-step drafters are inside step_time)
    mask_time: float = 0.0            # host time computing structured output's token masks
    step_time: float = 0.0
    dispatch_time: float = 0.0        # host time inside the jitted steps' calls (launch)
    num_preemptions: int = 0          # requests sent back to the queue to free KV blocks
    num_failed_requests: int = 0      # finished with "error" (their own fault, or the device)
    # Which matmul the steps' dense projections run (`EngineConfig.matmul_path`): "kernel
    # (avx512)", "xla (<why>)". Kept by `reset`.
    matmul: str = ""
    prefix_cache_queries: int = 0     # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int = 0        # of those, tokens whose K/V came from the cache
    verified_histogram: list[int] = dataclasses.field(default_factory=list)
    # generation steps per draft length chosen (index 0: plain steps)
    draft_len_histogram: list[int] = dataclasses.field(default_factory=list)
    accepted_histogram: list[int] = dataclasses.field(default_factory=list)
    # A drafter with a confidence head (DSpark), per draft position k (index k - 1), over the
    # request-steps that reached k (verified at least k drafts, the first k - 1 accepted):
    # how many, the sum of the confidences it gave draft k, and how many accepted it.
    confidence_reached: list[int] = dataclasses.field(default_factory=list)
    confidence_sum: list[float] = dataclasses.field(default_factory=list)
    confidence_accepted: list[int] = dataclasses.field(default_factory=list)
    trace: list[StepRecord] | None = None   # per-step records while tracing, else None
    # The engine's measured step costs (`specjax.engine.costs.CostTable`; kept by reset)
    step_costs: Any = None

    def record_request_step(self, verified: int, accepted: int) -> None:
        """One request's row of a generation step that verified `verified >= 1` drafts and
        accepted `accepted` of them (rows without drafts are not recorded)."""
        _bump(self.verified_histogram, verified)
        _bump(self.accepted_histogram, accepted)

    def record_confidence(self, confidence: list[float], verified: int, accepted: int) -> None:
        """One request-step's verified drafts, with the confidences its drafter gave them."""
        for k in range(min(verified, accepted + 1, len(confidence))):
            for series in (self.confidence_reached, self.confidence_sum,
                           self.confidence_accepted):
                if k >= len(series):
                    series.append(0)
            self.confidence_reached[k] += 1
            self.confidence_sum[k] += confidence[k]
            self.confidence_accepted[k] += k < accepted

    @property
    def calibration(self) -> list[tuple[float, float, int]]:
        """Per draft position: (mean confidence the drafter predicted, measured acceptance,
        request-steps that reached it) -- how well a confidence head is calibrated on this
        traffic. Empty without one."""
        return [(s / n, a / n, n) for s, a, n in zip(self.confidence_sum,
                                                     self.confidence_accepted,
                                                     self.confidence_reached) if n]

    def record_step(self, with_drafts: int, accepted: int, drafted: int, draft_len: int,
                    proposed: int) -> None:
        _bump(self.draft_len_histogram, draft_len)
        self.proposed_tokens += proposed
        if with_drafts:
            self.spec_steps += 1
            self.request_steps_with_drafts += with_drafts
            self.accepted_draft_tokens += accepted
            self.drafted_tokens += drafted

    def reset(self) -> None:
        """Back to zero, in place: the engine's parts share this object. A trace being kept
        is emptied in place (its holder keeps the same list) and stays on."""
        trace, costs, matmul = self.trace, self.step_costs, self.matmul
        self.__dict__.update(EngineStats().__dict__)
        self.step_costs, self.matmul = costs, matmul
        if trace is not None:
            trace.clear()
            self.trace = trace

    @property
    def acceptance_length(self) -> float | None:
        """(sum accepted + n) / n over the n request-steps that had drafts: tokens per target
        step while speculating (the reference's AL; steps without drafts do not count)."""
        n = self.request_steps_with_drafts
        return (self.accepted_draft_tokens + n) / n if n else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """AR_k for draft positions k = 1, 2, ...: the share of request-steps with drafts that
        accepted at least k of them (`[AR_1, AR_2, ...]`, as long as the deepest draft
        verified; AL = 1 + sum of AR_k). Empty before any draft."""
        if not self.request_steps_with_drafts:
            return []
        return at_least(self.accepted_histogram, len(self.verified_histogram) - 1)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_draft_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of looked-up tokens whose K/V the prefix cache supplied (None before any)."""
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else None

    @property
    def draft_overhead(self) -> float | None:
        return self.draft_time / self.step_time if self.step_time else None


def _bump(histogram: list[int], index: int) -> None:
    if index >= len(histogram):
        histogram.extend([0] * (index + 1 - len(histogram)))
    histogram[index] += 1
