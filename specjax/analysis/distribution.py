"""Is a sampler drawing from the distribution it should? Empirical frequencies, total variation
distance (TVD), and the bound a correct sampler stays under.

The bound: with N independent draws over K categories, Hoeffding gives, for every subset A,
P(P_hat(A) - P(A) > t) <= exp(-2 N t^2); the TVD is the largest such difference over the 2^K
subsets, so by the union bound P(TVD > t) <= 2^K exp(-2 N t^2) = delta for
t = sqrt((K ln 2 + ln(1/delta)) / (2N))."""
from __future__ import annotations

import math

import numpy as np


def empirical(values, k: int) -> np.ndarray:
    """[k] the share of `values` (ints in 0..k-1) equal to each category."""
    values = np.asarray(values, int).ravel()
    return np.bincount(values, minlength=k)[:k] / len(values)


def tvd(p, q) -> float:
    """Total variation distance: half the L1 distance between two distributions."""
    return 0.5 * float(np.abs(np.asarray(p, float) - np.asarray(q, float)).sum())


def tvd_bound(n: int, k: int, delta: float = 1e-6) -> float:
    """The TVD that N draws over K categories from the right distribution exceed with
    probability at most `delta` (module docstring)."""
    return math.sqrt((k * math.log(2) + math.log(1 / delta)) / (2 * n))
