"""Who runs each step: admission, prompt-chunk rows, generation rows with their KV
reservations, and preemption when the pool runs out.

Requests wait in a queue holding nothing; once admitted they hold a slot (their row of the
device's slot state) and KV blocks. The one reservation rule is `reserve_for(draft_len)`.
"""
from __future__ import annotations

import collections
from typing import Callable

from specjax.engine.allocator import BlockAllocator, OutOfBlocks
from specjax.engine.prefix_cache import PrefixCachePolicy
from specjax.engine.request import Request, Status


def kv_reserve(draft_len: int, drafts_in_step: bool, verify_len: int | None = None) -> int:
    """KV positions a generation step of this draft length may write from a request's newest
    token on: the newest token and the drafts it verifies (`verify_len`: D for a chain, a
    tree's T nodes), and D more when the step drafts in it (the drafter's K/V past the
    verified window)."""
    verify = draft_len if verify_len is None else verify_len
    return 1 + verify + (draft_len if drafts_in_step else 0)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, num_slots: int, prefill_chunk: int,
                 max_prefill_rows: int, max_draft_len: int, drafts_in_step: bool,
                 on_preempt: Callable[[Request], None] = lambda request: None,
                 verify_len: Callable[[int], int] = lambda draft_len: draft_len,
                 prefix_cache: PrefixCachePolicy | None = None):
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.max_prefill_rows = max_prefill_rows
        self.max_draft_len = max_draft_len
        self.drafts_in_step = drafts_in_step
        self.verify_len = verify_len
        self.on_preempt = on_preempt
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def reserve_for(self, draft_len: int) -> int:
        """The reservation of this engine's generation steps (`kv_reserve`)."""
        return kv_reserve(draft_len, self.drafts_in_step, self.verify_len(draft_len))

    # -- admission ---------------------------------------------------------------------------

    def admit(self) -> list[Request]:
        """Admit waiting requests, oldest first, while a slot is free and the pool holds the
        whole prompt plus a generation step, so admission cannot thrash. A request starts
        with the prefix cache's blocks for its leading tokens (`num_computed` past them).
        Returns the requests admitted."""
        admitted = []
        if not (self.waiting and self._free_slots):
            return admitted
        headroom = self.reserve_for(self.max_draft_len)
        # Blocks already promised to running requests' unprocessed tokens are not free to give.
        budget = self.allocator.num_free_blocks - sum(
            self.allocator.blocks_needed(r.request_id, r.pending + headroom) for r in self.running)
        while self.waiting and self._free_slots:
            request = self.waiting[0]
            cached: tuple[list[int], list[int]] = ([], [])
            if self.prefix_cache is not None and self.prefix_cache.reads(request):
                tokens = request.all_ids
                cached = self.allocator.match(tokens)
                if self._being_computed(self.allocator.next_key(tokens, cached[1])):
                    break  # a running prompt is computing this prefix: share it when done
            bs = self.allocator.tokens_per_block
            need = (self.allocator.blocks_needed(None, request.num_tokens + headroom)
                    - len(cached[0]) + self.allocator.cost(cached[0]))
            if need > budget:
                break
            budget -= need
            self.waiting.popleft()
            request.status = Status.RUNNING
            request.slot = self._free_slots.pop()
            self.allocator.allocate(request.request_id, cached)
            request.num_computed = len(cached[0]) * bs
            request.stats.num_cached_tokens = request.num_computed
            if self.prefix_cache is not None:
                self.prefix_cache.admitted(request, cached[0])
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _being_computed(self, key) -> bool:
        """Whether a running request still taking in its prompt will publish the block of
        this key (so a request sharing the prefix waits rather than computes it twice)."""
        if key is None:
            return False
        for r in self.running:
            if not r.prefilled and r.request_id in self.allocator:
                if self.allocator.next_key(r.all_ids, self.allocator.entries(r.request_id)) == key:
                    return True
        return False

    # -- rows of the next steps ----------------------------------------------------------------

    def schedule_prefill(self) -> list[tuple[Request, int]]:
        """(request, tokens) for up to `max_prefill_rows` requests still taking in their
        tokens, each a chunk of at most `prefill_chunk`, its blocks taken now."""
        rows = []
        for request in self.running:
            if len(rows) == self.max_prefill_rows:
                break
            if not request.prefilled:
                n = min(request.pending, self.prefill_chunk)
                if self.allocator.can_add(request.request_id, n):
                    self.allocator.add_tokens(request.request_id, n)
                    rows.append((request, n))
        return rows

    def generation_candidates(self) -> list[Request]:
        """Running requests whose newest token awaits a generation step."""
        return [r for r in self.running if r.prefilled]

    def blocks_needed(self, requests: list[Request], positions: list[int]) -> int:
        """Blocks that growing each request by its `positions` entry takes."""
        return sum(self.allocator.blocks_needed(r.request_id, n)
                   for r, n in zip(requests, positions))

    def reserve(self, candidates: list[Request], positions: list[int]) -> list[Request]:
        """Grow each candidate's KV length by its `positions` entry, preempting the most
        recently admitted other requests while the pool is short; returns the candidates that
        got their reservation (a preempted candidate is dropped)."""
        rows: list[Request] = []
        for request, grow in zip(candidates, positions):
            if request.status is not Status.RUNNING:
                continue  # preempted while making room for an earlier row
            while True:
                try:
                    self.allocator.add_tokens(request.request_id, grow)
                    rows.append(request)
                    break
                except OutOfBlocks:
                    victim = self._pick_victim(exclude=request)
                    if victim is None:
                        break  # cannot happen while one request fits the pool; wait a step
                    if victim in rows:
                        rows.remove(victim)
                    self.preempt(victim)
        return rows

    # -- leaving -----------------------------------------------------------------------------

    def _pick_victim(self, exclude: Request) -> Request | None:
        for request in reversed(self.running):  # the most recently admitted goes first
            if request is not exclude:
                return request
        return None

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and slot and queue it first, to be recomputed from
        its tokens. Sampling keys depend on (seed, position) only, so the recomputed request
        continues exactly as it would have."""
        self._release(request)
        request.num_computed = 0
        request.prefilled = False  # recompute every token, then sample the next one
        request.draft_tokens = []
        request.draft_confidence = None
        request.status = Status.WAITING
        request.stats.num_preemptions += 1
        self.on_preempt(request)
        self.waiting.appendleft(request)

    def remove(self, request: Request) -> None:
        """A finished or cancelled request leaves the queue or gives back what it holds."""
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        elif request.status is Status.RUNNING:
            self._release(request)

    def _release(self, request: Request) -> None:
        self.allocator.free(request.request_id)
        self.running.remove(request)
        self._free_slots.append(request.slot)
        request.slot = None
