"""A generation step's plan: which rows run, what each reserves and verifies, and the step's
draft length (`GenerationPlanner.plan`).

The draft length is the length policy's (`specjax.speculative.length_policy`), at least what a
row's grammar forces. A host drafter proposes for each reserved row (checked before a proposal
can reach a device array); the policy then looks again with the proposals known. Reservations
cover the unread step's largest possible advance under the overlap scheduler; where the pool
cannot hold them, or where a host drafter or a grammar needs every token so far, the unread step
is read first (`drain`).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from specjax.core.steps import runs_on_device
from specjax.engine.allocator import BlockAllocator
from specjax.engine.bookkeeper import GenerationRow
from specjax.engine.executor import Executor
from specjax.engine.request import Request, Status
from specjax.engine.scheduler import Scheduler
from specjax.engine.stats import EngineStats
from specjax.speculative.build import Speculation
from specjax.speculative.length_policy import DraftLengthPolicy
from specjax.validation import check_draft_tokens


class GenerationPlanner:
    """`drain()` reads the unread step now; `fail(request, doing, error)` finishes one request
    whose own host work raised (the engine's)."""

    def __init__(self, scheduler: Scheduler, allocator: BlockAllocator, executor: Executor,
                 speculation: Speculation, lengths: DraftLengthPolicy, stats: EngineStats,
                 vocab_size: int, drain: Callable[[], None],
                 fail: Callable[[Request, str, BaseException], None]):
        self.scheduler, self.allocator, self.executor = scheduler, allocator, executor
        self.speculation, self.lengths, self.stats = speculation, lengths, stats
        self.vocab_size, self.drain, self.fail = vocab_size, drain, fail

    def plan(self) -> tuple[list[GenerationRow], int]:
        """Rows whose newest token is pending, with their reservations, and the step's runtime
        draft length."""
        candidates = self.scheduler.generation_candidates()
        lengths, spec = self.lengths, self.speculation
        draft_len = lengths.choose(candidates) if candidates else 0
        if draft_len and not self._worth_waiting(candidates):
            draft_len = 0
        if (not runs_on_device(spec.worker, draft_len, spec.suffix)
                or any(r.grammar is not None for r in candidates)):
            # A host drafter needs every token so far, and so does a grammar's next masks.
            candidates = self._drained(candidates)
        forced = lengths.forced_len(candidates)
        draft_len = max(draft_len, forced)
        reserve = self.scheduler.reserve_for(draft_len)
        positions = self._positions(candidates, reserve)
        if (self.executor.inflight is not None
                and self.scheduler.blocks_needed(candidates, positions)
                > self.allocator.num_free_blocks):
            # Exact lengths free the unread step's worst-case reservation.
            candidates = self._drained(candidates)
            positions = self._positions(candidates, reserve)
        drafter = spec.drafter
        reserved = []
        for request in self.scheduler.reserve(candidates, positions):
            if draft_len and drafter is not None:
                try:
                    request.draft_tokens = self._propose(drafter, request, draft_len)
                except Exception as e:
                    self.fail(request, "drafting for it", e)
                    continue
            room = request.max_len - request.num_tokens - 1
            reserved.append((request, max(0, min(len(request.draft_tokens), draft_len, room))))
        if draft_len and drafter is not None and reserved and lengths.adaptive:
            # A host drafter's proposals are known now: choose again, counting only the
            # drafts each row has (a row without a match gains nothing from a longer step).
            caps = np.asarray([n for _, n in reserved])
            draft_len = max(lengths.choose([r for r, _ in reserved], caps, draft_len), forced)
        rows = []
        for request, drafted in reserved:
            held = request.drafts_held
            if drafter is not None:
                held, drafted = drafted, min(drafted, draft_len)
            request.drafts_held = draft_len  # what this step drafts for the next (in-step)
            rows.append(GenerationRow(request, reserve, drafted, proposed=held))
        return rows, draft_len

    def _positions(self, candidates: list[Request], reserve: int) -> list[int]:
        """KV positions each candidate's reservation adds: `reserve` from the newest token
        on, past what the unread step may still advance it."""
        unread = self.executor.unread_advances(candidates)
        length = self.allocator.length
        return [max(0, r.num_computed + u + reserve - length(r.request_id))
                for r, u in zip(candidates, unread)]

    def _worth_waiting(self, candidates: list[Request]) -> bool:
        """Whether a host drafter's proposals are worth reading the step in flight first
        (`Drafter.may_propose`, from the tokens read so far): where no row expects one, the
        step runs plainly and keeps the overlap. Not asked with nothing in flight, while the
        cost model explores (its step runs its length), nor for grammar rows (they wait
        anyway)."""
        drafter = self.speculation.drafter
        if (drafter is None or self.executor.inflight is None or self.lengths.exploring
                or any(r.grammar is not None for r in candidates)):
            return True
        for request in candidates:
            try:
                if drafter.may_propose(request.request_id, request.all_ids):
                    return True
            except Exception:
                return True   # propose_for, after the wait, reports it against the request
        return False

    def _drained(self, candidates: list[Request]) -> list[Request]:
        """The candidates still running once the unread step is read."""
        self.drain()
        return [r for r in candidates if r.status is Status.RUNNING]

    def _propose(self, drafter, request: Request, draft_len: int) -> list[int]:
        """A host drafter's proposal, checked before it can reach a device array."""
        t0 = time.perf_counter()
        try:
            drafts = drafter.propose_for(request.request_id, request.all_ids, draft_len)
            return check_draft_tokens(drafts, draft_len, self.vocab_size)
        finally:
            self.stats.draft_time += time.perf_counter() - t0
