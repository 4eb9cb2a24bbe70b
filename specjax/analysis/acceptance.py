"""Acceptance figures from accepted-draft counts: per-position acceptance AR_k, the acceptance
length (AL) and its histogram, and AL against the draft length D, measured and predicted.

Every function takes an `accepted_histogram` (`h[a]` = request-steps that verified drafts and
accepted exactly `a` of them), as `EngineStats.accepted_histogram` and `Trace` give it."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specjax.engine.stats import at_least

__all__ = ["acceptance_length", "al_by_depth", "al_histogram", "alpha", "at_least",
           "conditional_acceptance", "output_acceptance", "predicted_al"]


def acceptance_length(accepted_histogram: Sequence[int]) -> float:
    """Tokens per target step over request-steps with drafts: mean accepted + 1 (nan: none)."""
    h = np.asarray(accepted_histogram, float)
    return float((h * np.arange(len(h))).sum() / h.sum() + 1) if h.sum() else float("nan")


def al_histogram(accepted_histogram: Sequence[int], depth: int) -> np.ndarray:
    """[depth + 1] shares of request-steps whose acceptance length was 1 .. depth + 1 (tokens
    the step gave: accepted + 1)."""
    h = np.zeros(depth + 1)
    counts = np.asarray(accepted_histogram, float)[:depth + 1]
    h[:len(counts)] = counts
    return h / h.sum() if h.sum() else h


def conditional_acceptance(ar: Sequence[float]) -> np.ndarray:
    """alpha_k = AR_k / AR_(k-1) (AR_0 = 1): the chance that draft k is accepted once drafts
    1..k-1 were (nan where no step reached position k)."""
    ar = np.asarray(ar, float)
    before = np.concatenate([[1.0], ar[:-1]])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(before > 0, ar / np.where(before > 0, before, 1), np.nan)


def alpha(ar: Sequence[float]) -> float:
    """The pooled per-position acceptance rate sum(AR_k) / sum(AR_(k-1)): the alpha for which
    a chain of i.i.d. acceptances reaches each depth as often as measured, overall."""
    ar = np.asarray(ar, float)
    return float(ar.sum() / (1 + ar[:-1].sum())) if len(ar) else float("nan")


def predicted_al(a: float, depth: int | np.ndarray) -> float | np.ndarray:
    """Expected tokens per step with `depth` drafts when each is accepted with probability `a`
    given the ones before were: (1 - a^(D+1)) / (1 - a), = D + 1 at a = 1."""
    d = np.asarray(depth, float)
    out = d + 1 if a == 1 else (1 - a ** (d + 1)) / (1 - a)
    return float(out) if out.ndim == 0 else out


def al_by_depth(ar: Sequence[float], depths: Sequence[int]) -> np.ndarray:
    """AL each depth D would give if acceptance per position stayed as measured (the steps of
    a run at depth >= D cut after D drafts): 1 + AR_1 + ... + AR_D."""
    ar = np.asarray(ar, float)
    return np.array([1 + ar[:d].sum() for d in depths])


def output_acceptance(outs) -> dict[str, float]:
    """Acceptance figures summed over `outs`.

    al: tokens per target step over the steps that verified at least one draft (accepted
        drafts + the target's own token, / those steps).
    per_step: output tokens after the first / generation steps. The first token comes from the
        prompt's prefill step, which `RequestStats.decoding_iterations` counts too, so both
        leave it out: every later target step counts, with or without drafts (a step without
        drafts gives 1 token). Exact without preemption (a readmitted request's prefill gives
        a token and an iteration again); `preemptions` says how many there were.
    no_drafts: the share of generation steps that verified no draft.
    verified_per_step: drafts verified per generation step (rate x verified_per_step =
        accepted drafts per step)."""
    with_drafts = sum(o.stats.num_steps_with_drafts for o in outs)
    accepted = sum(o.stats.num_accepted_draft_tokens for o in outs)
    steps = sum(o.stats.decoding_iterations - 1 for o in outs)
    tokens = sum(o.stats.num_generated_tokens - 1 for o in outs)
    return dict(al=(accepted + with_drafts) / max(with_drafts, 1),
                per_step=tokens / max(steps, 1),
                rate=accepted / max(sum(o.stats.num_draft_tokens for o in outs), 1),
                no_drafts=1 - with_drafts / max(steps, 1),
                verified_per_step=sum(o.stats.num_draft_tokens for o in outs) / max(steps, 1),
                preemptions=sum(o.stats.num_preemptions for o in outs))
