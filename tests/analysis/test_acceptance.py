"""The acceptance figures papers plot, against cases worked by hand and against a simulated
chain whose acceptances are i.i.d. with a known rate."""
import numpy as np
import pytest

from specjax.analysis import (acceptance_length, al_by_depth, al_histogram, alpha, at_least,
                              conditional_acceptance, predicted_al)


def test_at_least_and_al_from_a_histogram():
    # 5 request-steps accepted 0, 1, 1, 3 and 2 drafts.
    h = [1, 2, 1, 1]
    assert at_least(h, 4) == pytest.approx([4 / 5, 2 / 5, 1 / 5, 0.0])
    assert acceptance_length(h) == pytest.approx(1 + 7 / 5) == pytest.approx(1 + sum(at_least(h, 3)))
    assert al_histogram(h, 3) == pytest.approx([1 / 5, 2 / 5, 1 / 5, 1 / 5])
    assert at_least([], 2) == [0.0, 0.0] and np.isnan(acceptance_length([]))


def test_conditional_rates_and_their_pooled_alpha():
    ar = [0.8, 0.4, 0.1]
    assert conditional_acceptance(ar) == pytest.approx([0.8, 0.5, 0.25])
    assert alpha(ar) == pytest.approx(1.3 / 2.2)
    assert np.isnan(conditional_acceptance([0.5, 0.0, 0.0])[2])  # no step reached position 3


def test_predicted_al_is_the_geometric_sum():
    assert predicted_al(0.5, 0) == 1.0
    assert predicted_al(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert predicted_al(1.0, 4) == 5.0 and predicted_al(0.0, 4) == 1.0
    assert predicted_al(0.6, np.arange(1, 4)) == pytest.approx([1.6, 1.96, 2.176])


def test_an_iid_chain_matches_the_formula_at_every_depth():
    # Each draft accepted with probability a once the ones before were: AL at depth D is
    # (1 - a^(D+1)) / (1 - a); alpha() recovers a from the measured AR_k, and cutting the
    # deepest run's steps at D predicts each depth's AL. n = 200k steps: the standard error
    # of AL is below 0.004, so 0.02 is five of them.
    rng = np.random.default_rng(0)
    a, D, n = 0.7, 6, 200_000
    accepted = np.argmin(np.concatenate([rng.random((n, D)) < a, np.zeros((n, 1), bool)], 1), 1)
    h = np.bincount(accepted, minlength=D + 1)
    ar = at_least(h, D)
    assert alpha(ar) == pytest.approx(a, abs=0.01)
    assert conditional_acceptance(ar) == pytest.approx([a] * D, abs=0.02)
    for d in range(1, D + 1):
        measured = acceptance_length(np.bincount(np.minimum(accepted, d)))
        assert measured == pytest.approx(predicted_al(a, d), abs=0.02)
        assert al_by_depth(ar, [d])[0] == pytest.approx(measured)
