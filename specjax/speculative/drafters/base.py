"""Host-side drafters (modes with `has_spec_drafter()`): they propose, the target verifies.

The engine calls `propose_for(request_id, token_ids, max_draft_len)` for every generation
request each step; proposals may be shorter than asked, or empty. The engine pads them to the
compiled width and remembers the real length, which is what acceptance statistics count.
"""
from __future__ import annotations

import abc
from typing import Sequence


class Drafter(abc.ABC):
    """Subclass and implement `propose` to plug any drafting method into specjax."""

    @abc.abstractmethod
    def propose(self, token_ids: Sequence[int], max_draft_len: int) -> list[int]:
        """Return up to `max_draft_len` tokens predicted to follow `token_ids`."""

    def propose_for(self, request_id: int, token_ids: Sequence[int], max_draft_len: int) -> list[int]:
        return self.propose(token_ids, max_draft_len)

    def may_propose(self, request_id: int, token_ids: Sequence[int]) -> bool:
        """Whether a proposal is worth waiting for, asked while a step is still in flight:
        `token_ids` lacks that step's tokens. Where every row says no, the engine runs the next
        step plainly without waiting for the one in flight (the overlap scheduler keeps host
        and device busy together); a yes makes it wait, then `propose_for`. Default: yes."""
        return True

    def on_request_finished(self, request_id: int) -> None:
        """Drop per-request state; called once when a request finishes or is cancelled."""
