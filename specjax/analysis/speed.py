"""Speed figures: tokens/s of a run, the same over batch sizes, the target's verify-step
times, and efficiency (how much of the speedup acceptance allows was kept)."""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from specjax.analysis.timing import decode_rate, time_generation_steps
from specjax.llm import LLM
from specjax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Speed:
    """One timed `generate` call (or the fastest of several): its outputs, output tokens,
    wall seconds; `tps`: output tokens/s of the whole call (throughput, prefill included);
    `decode_tps`: tokens/s of one request after its first token (1 / TPOT, the requests'
    decode time summed), which falls as a batch grows while `tps` rises."""

    outputs: list
    tokens: int
    seconds: float

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tps(self) -> float:
        return decode_rate(self.outputs)


def measure(llm: LLM, prompts: Sequence[str], params: SamplingParams,
            repeats: int = 1) -> Speed:
    """Generate `prompts` in one call, `repeats` times; the fastest run (machine noise only
    ever slows a run down)."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(list(prompts), params)
        runs.append(Speed(outs, sum(len(o.token_ids) for o in outs),
                          time.perf_counter() - start))
    return min(runs, key=lambda s: s.seconds)


def speed_vs_batch_size(llm: LLM, prompts: Sequence[str], batch_sizes: Sequence[int],
                        params: SamplingParams, repeats: int = 1) -> list[Speed]:
    """For each batch size b: b requests at once (the prompts, cycled to b), the fastest of
    `repeats` runs. The engine's `max_batch_size` must be at least the largest b."""
    if max(batch_sizes) > llm.engine.config.max_batch_size:
        raise ValueError(f"batch size {max(batch_sizes)} > the LLM's max_batch_size "
                         f"{llm.engine.config.max_batch_size}")
    return [measure(llm, [prompts[i % len(prompts)] for i in range(b)], params, repeats)
            for b in batch_sizes]


def step_times(llm: LLM, widths: Sequence[int], position: int,
               batch_size: int = 1) -> list[float]:
    """Seconds per call of the target's compiled generation step for `batch_size` rows of each
    of `widths` query tokens (1: plain decoding, D + 1: verifying D drafts) at `position`:
    t(1) and t(D + 1) for `efficiency`. The LLM must be idle."""
    return time_generation_steps(llm.engine, batch_size, widths, position)


def efficiency(decode_speedup: float, per_step: float, t1: float, t_verify: float) -> float:
    """decode speedup / (tokens per step x t(1) / t(D+1)): the share of the speedup that
    tokens/step and the measured cost of verifying D drafts allow (1.0: the drafter and the
    extra host work cost nothing)."""
    return decode_speedup / (per_step * t1 / t_verify)
