"""TVD and its bound: a right sampler stays under it, a wrong one does not."""
import numpy as np
import pytest

from specjax.analysis import empirical, tvd, tvd_bound


def test_tvd_and_empirical():
    assert tvd([0.5, 0.5, 0], [0, 0.5, 0.5]) == 0.5
    assert empirical([0, 2, 2, 1], 3) == pytest.approx([0.25, 0.25, 0.5])


def test_the_bound_separates_a_right_sampler_from_a_wrong_one():
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    n = 20_000
    bound = tvd_bound(n, len(p))  # delta = 1e-6
    assert tvd(empirical(rng.choice(4, n, p=p), 4), p) < bound
    wrong = np.array([0.3, 0.3, 0.2, 0.2])  # TVD 0.1 from p
    assert tvd(empirical(rng.choice(4, n, p=wrong), 4), p) > bound
    assert tvd_bound(4 * n, 4) == pytest.approx(bound / 2)
