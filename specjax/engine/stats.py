"""Engine-wide speculation statistics. Padding never counts: only real requests' drafts do."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    num_generated_tokens: int = 0
    spec_steps: int = 0               # generation steps that verified at least one draft
    request_steps_with_drafts: int = 0
    accepted_draft_tokens: int = 0
    drafted_tokens: int = 0           # drafts verified (the acceptance-rate denominator)
    draft_time: float = 0.0           # host drafter time (in-step drafters are inside step_time)
    step_time: float = 0.0
    num_preemptions: int = 0          # requests sent back to the queue to free KV blocks
    num_failed_requests: int = 0      # finished with "error" (their own fault, or the device)

    def record_step(self, with_drafts: int, accepted: int, drafted: int) -> None:
        if with_drafts:
            self.spec_steps += 1
            self.request_steps_with_drafts += with_drafts
            self.accepted_draft_tokens += accepted
            self.drafted_tokens += drafted

    @property
    def acceptance_length(self) -> float | None:
        """(sum accepted + n) / n over request-steps that had drafts."""
        n = self.request_steps_with_drafts
        return (self.accepted_draft_tokens + n) / n if n else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_draft_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def draft_overhead(self) -> float | None:
        return self.draft_time / self.step_time if self.step_time else None
