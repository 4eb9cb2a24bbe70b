"""The cost model's pieces on the host: per-position acceptance estimates, expected tokens,
the choice of draft length, the candidate lengths."""
import numpy as np
import pytest

from specjax.speculative.cost_model import (HYSTERESIS, INITIAL_RATE, AcceptanceModel,
                                            AcceptanceTracker,
                                            candidate_lengths, choose_draft_len,
                                            expected_tokens)


def test_a_step_counts_the_positions_it_decided():
    t = AcceptanceTracker(4, decay=1.0)
    t.update(verified=4, accepted=1)   # draft 1 accepted, draft 2 rejected, 3-4 never reached
    np.testing.assert_array_equal(t.reached, [1, 1, 0, 0])
    np.testing.assert_array_equal(t.hits, [1, 0, 0, 0])
    t.update(verified=2, accepted=2)   # both verified drafts accepted
    np.testing.assert_array_equal(t.reached, [2, 2, 0, 0])
    np.testing.assert_array_equal(t.hits, [2, 1, 0, 0])
    t.update(verified=0, accepted=0)   # nothing verified: nothing learnt
    np.testing.assert_array_equal(t.reached, [2, 2, 0, 0])


def test_old_observations_fade():
    t = AcceptanceTracker(1, decay=0.5)
    for _ in range(10):
        t.update(1, 0)
    t.update(1, 1)
    rate = t.rates(np.zeros(1), weight=0.0)[0]
    assert 0.45 < rate < 0.55  # the newest counts as much as all the older ones together


def test_a_request_without_history_gets_the_engine_estimate_and_its_own_history_moves_it():
    m = AcceptanceModel(3)
    np.testing.assert_allclose(m.survival([7])[0], INITIAL_RATE ** np.arange(1, 4))
    for _ in range(50):
        m.update(1, 3, 3)   # request 1 accepts everything
        m.update(2, 3, 0)   # request 2 nothing
    s = m.survival([1, 2, 3])
    assert s[0, 2] > 0.8 and s[1, 0] < 0.2
    assert s[1, 0] < s[2, 0] < s[0, 0]   # a new request sits between them
    assert np.all(np.diff(s, axis=1) <= 0)  # survival never grows with depth
    m.forget(1)
    np.testing.assert_allclose(m.survival([1]), m.survival([3]))


def test_expected_tokens_add_the_survivals_up_to_each_rows_cap():
    s = np.asarray([[0.5, 0.25, 0.125], [0.9, 0.81, 0.729]])
    np.testing.assert_allclose(expected_tokens(s, np.asarray([0, 1, 3])),
                               [2, 2 + 1.4, 2 + 0.875 + 2.439])
    np.testing.assert_allclose(expected_tokens(s, np.asarray([3]), caps=np.asarray([1, 0])),
                               [2 + 0.5])


def test_the_choice_maximises_expected_tokens_per_second():
    high = np.full((4, 4), 0.9).cumprod(axis=1)
    low = np.full((4, 4), 0.1).cumprod(axis=1)
    flat = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    steep = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0}
    assert choose_draft_len(high, flat) == 4        # verifying is free: verify all
    assert choose_draft_len(low, steep) == 0        # costly and rarely accepted: plain
    assert choose_draft_len(high, {0: 1.0, 1: 1.2, 2: 1.9, 3: 2.6, 4: 3.3}) == 1
    # Rows with nothing to verify gain nothing from a longer step.
    assert choose_draft_len(high, {0: 1.0, 4: 1.1}, caps=np.zeros(4, int)) == 0
    assert choose_draft_len(high, {0: 1.0, 4: 1.1}, caps=np.full(4, 4)) == 4
    assert choose_draft_len(low, {0: 1.0, 2: 1.0}) == 2   # equal cost: more tokens wins
    assert choose_draft_len(np.zeros((2, 4)), {0: 1.0, 2: 1.0}) == 0   # a tie: the shorter
    with pytest.raises(ValueError, match="no measured step cost"):
        choose_draft_len(high, {})


def test_candidate_lengths():
    assert candidate_lengths(4, tree=False) == (0, 1, 2, 3, 4)
    assert candidate_lengths(8, tree=False) == (0, 1, 2, 3, 4, 8)
    assert candidate_lengths(2, tree=False) == (0, 1, 2)
    assert candidate_lengths(4, tree=True) == (0, 4)
    assert candidate_lengths(0, tree=False) == (0,)


def test_a_new_length_must_beat_the_current_one_by_the_hysteresis():
    s = np.full((1, 4), 0.5).cumprod(axis=1)          # D = 1 expects 1.5 tokens, D = 0 one
    slightly = {0: 1.0, 1: 1.5 / (1 + HYSTERESIS / 2)}
    clearly = {0: 1.0, 1: 1.5 / (1 + 2 * HYSTERESIS)}
    assert choose_draft_len(s, slightly) == 1
    assert choose_draft_len(s, slightly, current=0) == 0
    assert choose_draft_len(s, clearly, current=0) == 1
    assert choose_draft_len(s, slightly, current=1) == 1
    assert choose_draft_len(s, slightly, current=7) == 1   # not a measured length: no pull


def test_a_drafters_confidences_replace_the_online_estimates_of_its_requests():
    model = AcceptanceModel(4, drafter_confidence=True)
    for _ in range(20):
        model.update(1, verified=4, accepted=4)   # request 1 always accepts everything ...
    model.confide(1, np.array([0.5, 0.4, 1.5, -1.0]))   # ... but its drafter doubts these
    model.confide(2, np.array([0.9, 0.8]))               # a shorter block: the rest count 0
    survival = model.survival([1, 2, 3])
    np.testing.assert_allclose(survival[0], [0.5, 0.2, 0.2, 0.0])   # clipped to [0, 1]
    np.testing.assert_allclose(survival[1], [0.9, 0.72, 0.0, 0.0])
    # Request 3 has no confidences yet: the engine-wide online estimate, which request 1's
    # full acceptance raised.
    assert survival[2][0] > INITIAL_RATE
    model.forget(1)
    assert model.survival([1])[0][0] != 0.5
    ignored = AcceptanceModel(4)   # confidence scheduling off: confidences are not used
    ignored.confide(1, np.zeros(4))
    assert ignored.survival([1])[0][0] > 0.5
