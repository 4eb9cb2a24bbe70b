"""The per-batch-size draft length schedule and the acceptance gate (host side)."""
from __future__ import annotations

import collections
from typing import Mapping


def validate_draft_len_schedule(schedule: Mapping[int, int], max_draft_len: int) -> dict[int, int]:
    """Check a {batch-size threshold: draft length} schedule; return it sorted by threshold."""
    if not schedule:
        raise ValueError("draft_len_schedule must not be empty")
    out = {}
    for threshold, length in sorted((int(k), v) for k, v in schedule.items()):
        if threshold < 1:
            raise ValueError(f"draft_len_schedule threshold {threshold} must be >= 1")
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= max_draft_len:
            raise ValueError(f"draft_len_schedule value {length!r} at threshold {threshold} must be "
                             f"an int in [0, max_draft_len={max_draft_len}]")
        out[threshold] = length
    first = next(iter(out))
    if out[first] != max_draft_len:
        raise ValueError(f"draft_len_schedule value at the smallest threshold ({first}) must equal "
                         f"max_draft_len={max_draft_len}, got {out[first]}")
    return out


def get_draft_len_for_batch_size(schedule: Mapping[int, int] | None, batch_size: int,
                                 max_draft_len: int) -> int:
    """The value at the largest threshold <= batch_size; max_draft_len without a schedule.

    `{1: 8, 4: 4, 16: 1}`: batch 1-3 -> 8, 4-15 -> 4, 16 and more -> 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not schedule:
        return max_draft_len
    schedule = validate_draft_len_schedule(schedule, max_draft_len)
    length = max_draft_len
    for threshold, value in schedule.items():
        if threshold > batch_size:
            break
        length = value
    return length


class SpeculationGate:
    """Turns speculation off for good once the rolling acceptance rate falls below a threshold.

    `record_acceptance_rate(rate)` keeps the last `window` rates (O(1) per call); once the window
    is full and its mean is strictly below `threshold`, the gate disables and stays disabled.
    """

    def __init__(self, window: int, threshold: float):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"acceptance_rate_window_size must be a positive int, got {window!r}")
        if not 0 <= threshold <= 1:
            raise ValueError(f"acceptance_rate_threshold must be in [0, 1], got {threshold}")
        self.window = window
        self.threshold = threshold
        self.disabled = False
        self._rates: collections.deque[float] = collections.deque()
        self._sum = 0.0

    def record_acceptance_rate(self, rate: float) -> tuple[bool, float | None]:
        """Returns (disabled by this call, rolling mean once the window is full else None)."""
        if not 0 <= rate <= 1:
            raise ValueError(f"acceptance rate must be in [0, 1], got {rate}")
        if self.disabled:
            return False, self.rolling_mean()
        self._rates.append(rate)
        self._sum += rate
        if len(self._rates) > self.window:
            self._sum -= self._rates.popleft()
        mean = self.rolling_mean()
        if mean is not None and mean < self.threshold:
            self.disabled = True
            return True, mean
        return False, mean

    def rolling_mean(self) -> float | None:
        if len(self._rates) < self.window:
            return None
        return self._sum / len(self._rates)
