"""Verify lengths chosen by a measured cost model: the default for every mode.

Each generation step the engine picks the draft length D (0 = plain decoding) that maximises
expected tokens per second over the lengths compiled for the batch's bucket:

    (rows + sum_r E_r[accepted | min(D, cap_r) drafts]) / T(bucket, D)

`T` is the measured seconds of the compiled step (`specjax.engine.costs.CostTable`; a tree's
D is its depth and its cost that of its nodes). E_r[accepted | d] = sum_{j <= d} S_r(j), with
the survival S_r(j) = prod_{i <= j} a_r(i) built from request r's per-position conditional
acceptance a_r(i) = P(draft i accepted | draft i - 1 was): its own decayed counts
(`AcceptanceTracker`) shrunk toward the engine-wide ones. `cap_r` is what the row can verify
(a host drafter's proposal length); drafts verified past it count nothing. A drafter with a
confidence head (DSpark) supplies a_r(i) itself for the drafts it just made (`confide`): the
confidences of the newest drafts read, one step behind under the overlap scheduler, as in the
reference.

Why one D per step rather than per-row lengths: steps run over fixed-shape padded buffers, so a
step's cost is T(bucket, D) whatever each row verifies, and verifying a draft never lowers a
row's expected output. Rows that propose fewer drafts (a host drafter's short match) verify
fewer in the same step; the choice counts only what they can gain.

Exactness does not depend on the choice: any number of verified drafts gives greedy output
equal to plain decoding and, with rejection sampling, the target's distribution.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

# A request's own counts weigh against the engine-wide rates as if the latter were this many
# observations of each position.
PRIOR_WEIGHT = 4.0
# Per observation the old counts keep this share: a request's estimate follows its recent
# drafts (~10 steps), the engine's its recent traffic (~100 row-steps).
REQUEST_DECAY = 0.9
ENGINE_DECAY = 0.99
# A new draft length must promise this much more than the current one (`choose_draft_len`).
HYSTERESIS = 0.05
# Before anything is observed, drafts are assumed mostly accepted: an engine starts by
# speculating wherever that could pay, and every such step teaches it the real rates (one
# observation outweighs this prior); a pessimistic start would decode plainly and learn only
# from exploration.
INITIAL_RATE = 0.9


class AcceptanceTracker:
    """Decayed counts, per draft position i (1-based), of rows that verified draft i with
    drafts 1..i-1 accepted (`reached`) and of those that accepted it too (`hits`)."""

    def __init__(self, depth: int, decay: float):
        self.decay = decay
        self.reached = np.zeros(depth)
        self.hits = np.zeros(depth)

    def update(self, verified: int, accepted: int) -> None:
        """One row's step: it verified `verified` drafts and accepted the first `accepted`."""
        n = min(verified, accepted + 1, len(self.reached))  # positions decided this step
        if n <= 0:
            return
        self.reached[:n] *= self.decay
        self.hits[:n] *= self.decay
        self.reached[:n] += 1
        self.hits[:min(accepted, n)] += 1

    def rates(self, prior: np.ndarray, weight: float = PRIOR_WEIGHT) -> np.ndarray:
        """Per-position acceptance, these counts shrunk toward `prior` `[depth]`."""
        return (self.hits + weight * prior) / (self.reached + weight)


class AcceptanceModel:
    """The engine-wide estimate and each running request's, for one drafter."""

    def __init__(self, depth: int, drafter_confidence: bool = False):
        self.depth = depth
        self.engine = AcceptanceTracker(depth, ENGINE_DECAY)
        self._requests: dict[int, AcceptanceTracker] = {}
        # DSpark's confidence scheduling: a request's newest per-position confidences from
        # its drafter stand in for its online estimates.
        self.drafter_confidence = drafter_confidence
        self._confidence: dict[int, np.ndarray] = {}

    def prior(self) -> np.ndarray:
        return self.engine.rates(np.full(self.depth, INITIAL_RATE), weight=1.0)

    def update(self, request_id: int, verified: int, accepted: int) -> None:
        self.engine.update(verified, accepted)
        tracker = self._requests.get(request_id)
        if tracker is None:
            tracker = self._requests[request_id] = AcceptanceTracker(self.depth, REQUEST_DECAY)
        tracker.update(verified, accepted)

    def confide(self, request_id: int, confidence: np.ndarray) -> None:
        """The drafter's confidences `[K]` in a request's newest drafts: c_k = P(draft k
        accepted | drafts 1..k-1 accepted). Used only with `drafter_confidence`."""
        if self.drafter_confidence:
            c = np.clip(np.asarray(confidence, np.float64)[:self.depth], 0.0, 1.0)
            self._confidence[request_id] = np.pad(c, (0, self.depth - len(c)))

    def forget(self, request_id: int) -> None:
        self._requests.pop(request_id, None)
        self._confidence.pop(request_id, None)

    def survival(self, request_ids: list[int]) -> np.ndarray:
        """`[rows, depth]`: S_r(j) = P(drafts 1..j all accepted) for each request."""
        prior = self.prior()
        hits = np.zeros((len(request_ids), self.depth))
        reached = np.zeros_like(hits)
        for i, r in enumerate(request_ids):
            tracker = self._requests.get(r)
            if tracker is not None:
                hits[i], reached[i] = tracker.hits, tracker.reached
        rates = (hits + PRIOR_WEIGHT * prior) / (reached + PRIOR_WEIGHT)
        for i, r in enumerate(request_ids):
            confidence = self._confidence.get(r)
            if confidence is not None:
                rates[i] = confidence
        return np.cumprod(np.clip(rates, 0.0, 1.0), axis=1)


def expected_tokens(survival: np.ndarray, draft_lens: np.ndarray,
                    caps: np.ndarray | None = None) -> np.ndarray:
    """Tokens a step of each of `draft_lens` `[L]` drafts is expected to emit over rows with
    these survivals `[rows, depth]`: one per row plus its expected accepted drafts (at most
    `caps[r]`) -> `[L]`."""
    rows, depth = survival.shape
    upto = np.concatenate([np.zeros((rows, 1)), np.cumsum(survival, axis=1)], axis=1)
    d = np.minimum(np.asarray(draft_lens)[None, :], depth)              # [1, L]
    if caps is not None:
        d = np.minimum(d, np.asarray(caps)[:, None])                    # [rows, L]
    d = np.broadcast_to(d, (rows, d.shape[1]))
    return rows + np.take_along_axis(upto, d, axis=1).sum(axis=0)


def choose_draft_len(survival: np.ndarray, costs: Mapping[int, float],
                     caps: np.ndarray | None = None, current: int | None = None) -> int:
    """The draft length among `costs` (draft length -> measured seconds of its step) with the
    most expected tokens per second; ties go to the shorter. With `current` (the length the
    last steps ran), another must beat it by HYSTERESIS: an in-step drafter's first step at
    a longer length verifies only the drafts the shorter one made, and estimates this noisy
    would otherwise flip the length back and forth, paying that step each time."""
    if not costs:
        raise ValueError("no measured step cost to choose a draft length from")
    lens = np.asarray(sorted(costs))
    rate = expected_tokens(survival, lens, caps) / np.asarray([costs[d] for d in lens])
    best = int(lens[int(np.argmax(rate >= rate.max() * (1 - 1e-9)))])
    if current is not None and current in costs and current != best:
        if rate.max() < rate[int(np.flatnonzero(lens == current)[0])] * (1 + HYSTERESIS):
            return current
    return best


def candidate_lengths(max_draft_len: int, tree: bool) -> tuple[int, ...]:
    """The draft lengths the cost model chooses among (each one compiled step per batch
    bucket): every length up to 4 and the longest for chains; plain or the full depth for
    trees, whose shallower shapes are a different set of nodes."""
    if max_draft_len == 0:
        return (0,)
    if tree:
        return (0, max_draft_len)
    return tuple(sorted({0, max_draft_len} | set(range(1, min(max_draft_len, 4) + 1))))
