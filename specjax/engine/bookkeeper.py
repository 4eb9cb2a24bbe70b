"""Applying a step's results on the host. A prompt chunk: the tokens now computed, saved hidden
states and prompt logprobs, the blocks it completed for the prefix cache, and the first token
of a prompt's last chunk. A generation step: accepted counts, the KV ledger, statistics and
the acceptance gate -- in the order that keeps them right:

    num_accepted        = new_tokens_lens - 1
    verified_len        = draft slots the step verified: its runtime draft length (a tree's
                          node count)
    drafted_len         = drafts the device verified, snapshotted before padding (a tree:
                          its depth)
    num_drafts_verified = min(drafted_len, draft length)      # acceptance-rate denominator
    rewind_len          = verified_len - num_accepted         # rejected positions to give back
    then give back the rest of the reservation, and only then replace the request's drafts
    with next_draft_tokens[:runtime draft length].

Statistics count a row's drafts only when it verified some (padding never does); such a row
also lands in `EngineStats`' histograms at (num_drafts_verified, num_accepted).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from specjax.core.batch import GenerationOutput
from specjax.engine.allocator import BlockAllocator
from specjax.engine.hidden_states import HiddenStateRecorder
from specjax.engine.output import logprob_entries
from specjax.engine.prefix_cache import PrefixCachePolicy
from specjax.engine.request import Request, Status
from specjax.engine.stats import EngineStats, StepRecord
from specjax.speculative.cost_model import AcceptanceModel
from specjax.speculative.schedule import SpeculationGate


Advance = tuple[Request, list[int], "list[dict[int, float]] | None"]


@dataclasses.dataclass(slots=True)
class GenerationRow:
    request: Request
    reserve: int     # KV positions reserved from the newest token on (`reserve_for`)
    drafted: int     # drafts the host knows of (host drafters); the device reports its own
    proposed: int = 0  # drafts the row held when dispatched (a host drafter's proposal, an
                       # in-step drafter's previous draft length), before this step's cut


@dataclasses.dataclass
class DispatchedStep:
    """A generation step on the device, not yet read."""

    step_id: int
    rows: list[GenerationRow]
    draft_len: int
    out: GenerationOutput
    verify_len: int | None = None   # draft slots verified (a tree's nodes); None: draft_len

    @property
    def verified_len(self) -> int:
        return self.draft_len if self.verify_len is None else self.verify_len


class Bookkeeper:
    def __init__(self, allocator: BlockAllocator, stats: EngineStats, rewinds: bool,
                 gate: SpeculationGate | None = None,
                 recorder: HiddenStateRecorder | None = None,
                 prefix_cache: PrefixCachePolicy | None = None,
                 acceptance: AcceptanceModel | None = None):
        self.allocator = allocator
        self.acceptance = acceptance
        self.prefix_cache = prefix_cache
        self.stats = stats
        self.rewinds = rewinds
        self.gate = gate
        self.recorder = recorder

    def apply_prefill(self, rows: list[tuple[Request, int]], out
                      ) -> tuple[list[Advance], list[tuple[Request, Exception]]]:
        """Settle a prompt-chunk step whose rows ran `n` tokens of their request each ->
        ([(request, [its first token], its logprob entries or None)] for rows that ended
        their prompt, [(request, error)] for rows whose settling raised)."""
        tokens = np.asarray(out.tokens)
        hidden = np.asarray(out.hidden_states) if self.recorder is not None else None
        advanced, failed = [], []
        for i, (request, n) in enumerate(rows):
            if request.status is not Status.RUNNING:
                continue  # its row failed to prepare (or it was cancelled meanwhile)
            try:
                if hidden is not None:
                    self.recorder.record(request, request.num_computed, hidden[:, i, :n])
                if request.wants_prompt_logprobs:
                    _record_prompt_logprobs(request, out.prompt_logprobs, i, n)
                request.num_computed += n
                if self.prefix_cache is not None:
                    self.prefix_cache.publish(request)
                if request.num_computed == request.num_tokens:
                    request.prefilled = True
                    token = int(tokens[i])
                    advanced.append((request, [token], None if request.logprobs is None else
                                     logprob_entries(out.logprobs, i, [token],
                                                     request.params.logprobs)))
            except Exception as e:
                failed.append((request, e))
        return advanced, failed

    def apply(self, step: DispatchedStep) -> tuple[list[Advance], bool,
                                                   list[tuple[Request, Exception]]]:
        """Settle each row of `step` -> ([(request, its new tokens, their logprob entries or
        None)], whether the gate turned speculation off just now, [(request, error)] for rows
        whose settling raised).
        Rows whose request finished or was cancelled while the step was in flight are
        skipped: their blocks are already back."""
        out = step.out
        # One conversion per output, then Python ints: indexing numpy scalars per row costs
        # more than the row's own bookkeeping at large batches.
        new_tokens = np.asarray(out.new_tokens).tolist()
        lens = np.asarray(out.new_tokens_lens).tolist()
        draft_lens = np.asarray(out.draft_lens).tolist()
        D = step.draft_len
        next_drafts = np.asarray(out.next_draft_tokens)[:, :D].tolist() if D else None
        confidence = (None if out.draft_confidence is None or self.acceptance is None
                      else np.asarray(out.draft_confidence))
        hidden = np.asarray(out.hidden_states) if self.recorder is not None else None
        advanced, failed = [], []
        settled = [] if self.stats.trace is not None else None  # rows for the trace
        accepted_sum, drafted_sum, with_drafts, proposed_sum = 0, 0, 0, 0
        verified_len = step.verified_len
        recorded = []   # (request, start, row) whose hidden states the recorder keeps
        for i, row in enumerate(step.rows):
            request = row.request
            if request.status is not Status.RUNNING:
                continue
            try:
                num_accepted = lens[i] - 1
                num_drafts_verified = min(draft_lens[i], D)
                rewind_len = verified_len - num_accepted
                if hidden is not None:
                    recorded.append((request, request.num_computed, i))
                self._give_back(request, row, step.step_id, num_accepted, rewind_len)
                # Only now do the next drafts replace the verified ones.
                request.draft_tokens = next_drafts[i] if D else []
            except Exception as e:  # this row's ledger: fail its request, settle the others
                failed.append((request, e))
                continue
            proposed_sum += row.proposed
            stats = request.stats
            stats.num_draft_tokens += num_drafts_verified
            stats.num_accepted_draft_tokens += num_accepted
            if num_drafts_verified > 0:
                stats.num_steps_with_drafts += 1
                self.stats.record_request_step(num_drafts_verified, num_accepted)
                if self.acceptance is not None:
                    self.acceptance.update(request.request_id, num_drafts_verified,
                                           num_accepted)
                with_drafts += 1
                accepted_sum += num_accepted
                drafted_sum += num_drafts_verified
            if confidence is not None:
                if request.draft_confidence is not None and num_drafts_verified:
                    self.stats.record_confidence(request.draft_confidence,
                                                 num_drafts_verified, num_accepted)
                request.draft_confidence = [float(c) for c in confidence[i]]
                self.acceptance.confide(request.request_id, confidence[i])
            tokens = new_tokens[i][:num_accepted + 1]
            if request.logprobs is None:
                logprobs = None
            else:
                try:
                    logprobs = logprob_entries(out.logprobs, i, tokens, request.params.logprobs)
                except Exception as e:
                    failed.append((request, e))
                    continue
            advanced.append((request, tokens, logprobs))
            if settled is not None:
                settled.append((request.request_id, num_drafts_verified, num_accepted,
                                row.proposed))
        if hidden is not None:
            self.recorder.record_step(recorded, hidden)
        self.stats.record_step(with_drafts, accepted_sum, drafted_sum, step.draft_len,
                               proposed_sum)
        tripped = False
        if self.gate is not None and drafted_sum > 0:
            tripped, _ = self.gate.record_acceptance_rate(accepted_sum / drafted_sum)
        if settled is not None:
            ids, verified, accepted, proposed = zip(*settled) if settled else ((),) * 4
            self.stats.trace.append(StepRecord(
                step.draft_len, ids, verified, accepted,
                None if self.gate is None else self.gate.rolling_mean(),
                self.gate is not None and self.gate.disabled, time.perf_counter(),
                self.stats.draft_time, proposed))
        return advanced, tripped, failed

    def _give_back(self, request: Request, row: GenerationRow, step_id: int, num_accepted: int,
                   rewind_len: int) -> None:
        """The newest token and the accepted drafts are now computed; the reservation past
        them goes back: the rejected positions (`rewind_len`) and the slack an in-step drafter
        wrote or left unused -- except what a newer, still unread step has reserved."""
        request.num_computed += num_accepted + 1
        slack = row.reserve - 1 - num_accepted - rewind_len
        if request.latest_step != step_id:  # a newer step holds the positions after these
            self.allocator.rewind(request.request_id, self.allocator.length(request.request_id)
                                  - request.num_computed - request.latest_reserve)
            return
        if self.rewinds and rewind_len:
            self.allocator.rewind(request.request_id, rewind_len)
        if slack:
            self.allocator.rewind(request.request_id, slack)
        assert self.allocator.length(request.request_id) == request.num_computed


def _record_prompt_logprobs(request: Request, out, row: int, n: int) -> None:
    """Row j of a chunk starting at s gives the logprobs of token s + j + 1: keep those of
    prompt tokens not yet recorded."""
    start, P = request.num_computed, len(request.prompt_ids)
    first = len(request.prompt_logprobs)          # the next prompt token without them
    last = min(start + n, P - 1)                  # the last prompt token this chunk gives
    if first > last or first < start + 1:
        return
    tokens = request.prompt_ids[first:last + 1]
    entries = logprob_entries(out, row, tokens, request.params.prompt_logprobs,
                              start=first - start - 1)
    request.prompt_logprobs.extend(entries)
