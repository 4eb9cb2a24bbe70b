"""The measured cost of each compiled generation step on this machine: T(batch bucket, width).

Measured when the engine warms up (`Engine.warmup`, `LLM(warmup=True)`, the server, the
benches) and again on `Engine.measure_costs()`: each compiled (bucket, run width) step runs on
an empty padded batch a few times and keeps the median wall time. The cost model
(`specjax.speculative.cost_model`) divides expected tokens by these. Without a measurement for
a bucket the engine verifies the configured length there, as a fixed schedule would.

An empty batch reads no context and leaves out the host's share of an iteration (scheduling,
bookkeeping, detokenising; on a fast accelerator most of a small model's step), so the engine
also times its real iterations (`observe`: those that dispatched only a generation step) and
corrects the table: a shape observed often enough costs what it was observed to cost, any other
its measured time plus the excess the observed widths show (`_excess`).
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Callable, Iterable


# A shape's cost is the median of its latest observations (a compile or a pause is one
# outlier), once there are enough of them.
MIN_OBSERVED = 3
OBSERVED_WINDOW = 15


@dataclasses.dataclass
class CostTable:
    seconds: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    recent: dict[tuple[int, int], collections.deque] = dataclasses.field(default_factory=dict)
    seen_at: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    _ticks: int = 0

    def observe(self, bucket: int, width: int, seconds: float) -> None:
        """A real iteration of this shape took `seconds` (the engine's step, end to end)."""
        key = (bucket, width)
        if key in self.seconds:
            self.recent.setdefault(key, collections.deque(maxlen=OBSERVED_WINDOW)).append(seconds)
            self.touch(bucket, width)

    def touch(self, bucket: int, width: int) -> None:
        """This shape was just seen (observed, or chosen to be)."""
        self._ticks += 1
        self.seen_at[bucket, width] = self._ticks

    def stalest(self, bucket: int, widths) -> int:
        """Of these run widths, the one seen longest ago (or never)."""
        return min(widths, key=lambda w: (self.seen_at.get((bucket, w), -1), w))

    @property
    def observed(self) -> dict[tuple[int, int], float]:
        """(bucket, width) -> median seconds of its recent real iterations, where enough."""
        return {key: statistics.median(times) for key, times in self.recent.items()
                if len(times) >= MIN_OBSERVED}

    def for_bucket(self, bucket: int) -> dict[int, float]:
        """run width -> seconds for one batch bucket, corrected by what real iterations took
        ({} before it is measured)."""
        measured = {w: t for (b, w), t in self.seconds.items() if b == bucket}
        observed = self.observed
        seen = {w: observed[bucket, w] for w in measured if (bucket, w) in observed}
        return {w: seen.get(w, max(t + _excess(seen, measured, w), 1e-6))
                for w, t in measured.items()}

    def as_dict(self) -> dict[str, float]:
        """{"b8_w5": seconds, ...}: what `/metrics` and JSON reports carry."""
        return {f"b{b}_w{w}": t for (b, w), t in sorted(self.seconds.items())}

    def format(self) -> str:
        """One line per bucket, ms per step for each run width (1 = plain): measured, then
        observed in real iterations."""
        buckets = sorted({b for b, _ in self.seconds})
        widths = sorted({w for _, w in self.seconds})
        if not buckets:
            return "(no step costs measured)"
        lines = ["step ms  " + " ".join(f"{'w=' + str(w):>8}" for w in widths)]
        for name, table in (("measured", self.seconds), ("observed", self.observed)):
            if not table:
                continue
            lines.append(f"{name} (w = run width: 1 + drafts verified)")
            for b in buckets:
                lines.append(f"batch {b:<3}" + " ".join(
                    f"{table[b, w] * 1e3:8.2f}" if (b, w) in table else f"{'-':>8}"
                    for w in widths))
        return "\n".join(lines)


def _excess(seen: dict[int, float], measured: dict[int, float], width: int) -> float:
    """What real iterations of an unobserved width are expected to cost beyond its measured
    time: the observed widths' excess, fitted as a + b * width with b >= 0 (the host's share
    of an iteration is the same for every width; sampled rows and real contexts cost more
    per position verified), or their mean where one width or a falling fit says no more."""
    if not seen:
        return 0.0
    xs = list(seen)
    ys = [seen[w] - measured[w] for w in xs]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = 0.0 if spread == 0 else max(
        0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread)
    return mean_y + slope * (width - mean_x)


def measure(run: Callable[[int, int], object], shapes: Iterable[tuple[int, int]],
            repeats: int = 7) -> CostTable:
    """Median seconds of `run(bucket, width)` (one call blocks until its step is done) per
    shape, after one call that is not timed."""
    table = CostTable()
    for shape in sorted(shapes):
        run(*shape)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(*shape)
            times.append(time.perf_counter() - t0)
        table.seconds[shape] = statistics.median(times)
    return table
