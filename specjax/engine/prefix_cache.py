"""The prefix cache's rules: when a request's blocks may be published, which requests may read
the cache, and its figures. The cache itself (keys, reference counts, eviction) lives in
`specjax.engine.allocator`.

A block is published once every position in it holds K/V -- the target's and every drafter
pool's, all on the same block tables -- exactly as a prefill of its tokens would write them:

- its positions are committed (below `num_computed`): a rejected draft's position is
  rewritten by the step that commits that position, so committed K/V never come from drafts;
- the tokens a drafter's K/V at a position depend on exist, and join the block's key
  (`lookahead`: 1 for EAGLE-3 / MTP-Eagle, whose row t pairs the hidden state at t with the
  token at t+1; vanilla MTP's module s reads token t+s+1);
- a drafter whose pool keeps K/V computed from drafts (vanilla MTP rewrites none of them, so
  `rewrites_committed` is False) publishes only what its prompt's prefill wrote.

A request reads the cache unless it asked for prompt logprobs (those need every prompt
position's logits) or the engine records hidden states (the recorder needs every position's).
The cached chain is capped one token short of the prompt (`shareable_blocks`): the step that
computes the rest ("recompute tail") gives the logits and hidden states the first generated
token and the drafter start from.
"""
from __future__ import annotations

import dataclasses

from specjax.engine.allocator import BlockAllocator
from specjax.engine.request import Request
from specjax.engine.stats import EngineStats


def pool_lookahead(worker) -> int:
    """Tokens after position t that an in-step drafter's K/V at t depend on."""
    return 0 if worker is None else worker.pool_lookahead


def rewrites_committed(worker) -> bool:
    """Whether the drafter's K/V at every committed position are what a prefill would write."""
    return True if worker is None else worker.rewrites_committed


@dataclasses.dataclass
class PrefixCachePolicy:
    allocator: BlockAllocator
    stats: EngineStats
    prefill_only: bool = False     # publish only blocks a prompt's prefill wrote
    recording: bool = False        # hidden states are recorded: no request reads the cache
    _prefilled_until: dict[int, int] = dataclasses.field(default_factory=dict)

    def reads(self, request: Request) -> bool:
        return (not self.recording
                and getattr(request.params, "prompt_logprobs", None) is None)

    def admitted(self, request: Request, blocks: list[int]) -> None:
        """A request was admitted with `blocks` from the cache."""
        self.stats.prefix_cache_queries += request.num_tokens
        self.stats.prefix_cache_hits += len(blocks) * self.allocator.tokens_per_block
        # Everything it holds now goes through its prefill.
        self._prefilled_until[request.request_id] = request.num_tokens

    def publish(self, request: Request) -> None:
        """Publish the request's full blocks that became exact since the last call."""
        alloc, rid = self.allocator, request.request_id
        if rid not in alloc or (request.num_computed // alloc.tokens_per_block
                                <= len(alloc.entries(rid))):
            return   # no block completed since (every step asks, for every row)
        known = request.num_tokens    # prompt and emitted tokens: all committed
        if self.prefill_only:
            known = min(known, self._prefilled_until.get(rid, 0))
        limit = min(request.num_computed, known - alloc.lookahead)
        num_blocks = max(0, limit) // alloc.tokens_per_block
        if num_blocks > len(alloc.entries(rid)):
            alloc.publish(rid, request.all_ids, num_blocks)

    def forget(self, request: Request) -> None:
        self._prefilled_until.pop(request.request_id, None)
