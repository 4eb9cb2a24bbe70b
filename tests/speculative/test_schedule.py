"""The draft-length schedule and the acceptance gate."""
import pytest

from specjax import SpeculationGate, get_draft_len_for_batch_size

SCHEDULE = {1: 8, 4: 4, 16: 1}


@pytest.mark.parametrize("batch, expected", [(1, 8), (3, 8), (4, 4), (15, 4), (16, 1), (100, 1)])
def test_largest_threshold_at_or_below_batch_size(batch, expected):
    assert get_draft_len_for_batch_size(SCHEDULE, batch, 8) == expected


def test_zero_turns_speculation_off_and_no_schedule_means_max():
    assert get_draft_len_for_batch_size({1: 4, 8: 0}, 9, 4) == 0
    assert get_draft_len_for_batch_size(None, 7, 5) == 5


@pytest.mark.parametrize("schedule, batch, match", [
    ({1: 8, 4: 4}, 0, "batch_size must be >= 1"),
    ({2: 8}, 1, None),  # below the smallest threshold -> max_draft_len
    ({1: 7}, 1, "must equal max_draft_len=8"),
    ({1: 8, 4: 9}, 1, r"\[0, max_draft_len=8\]"),
    ({1: 8, 4: -1}, 1, r"\[0, max_draft_len=8\]"),
    ({0: 8}, 1, "threshold 0 must be >= 1"),
    ({}, 1, None),
])
def test_validation(schedule, batch, match):
    if match is None:
        assert get_draft_len_for_batch_size(schedule, batch, 8) == 8
    else:
        with pytest.raises(ValueError, match=match):
            get_draft_len_for_batch_size(schedule, batch, 8)


def test_gate_waits_for_a_full_window():
    gate = SpeculationGate(window=3, threshold=0.5)
    assert gate.record_acceptance_rate(0.0) == (False, None)
    assert gate.record_acceptance_rate(0.0) == (False, None)
    disabled, mean = gate.record_acceptance_rate(0.0)
    assert disabled and mean == 0.0 and gate.disabled


def test_gate_threshold_is_strict_and_window_rolls():
    gate = SpeculationGate(window=2, threshold=0.5)
    assert gate.record_acceptance_rate(0.5) == (False, None)
    assert gate.record_acceptance_rate(0.5) == (False, 0.5)      # equal: not below
    assert gate.record_acceptance_rate(1.0) == (False, 0.75)     # oldest 0.5 dropped
    assert gate.record_acceptance_rate(0.2) == (False, 0.6)
    disabled, mean = gate.record_acceptance_rate(0.0)
    assert disabled and mean == pytest.approx(0.1)


def test_gate_is_permanent():
    gate = SpeculationGate(window=1, threshold=0.5)
    assert gate.record_acceptance_rate(0.1)[0]
    assert gate.record_acceptance_rate(1.0) == (False, 0.1)  # ignored: stays disabled
    assert gate.disabled


@pytest.mark.parametrize("rate", [-0.01, 1.01, float("nan")])
def test_gate_rejects_rates_outside_unit_interval(rate):
    with pytest.raises(ValueError, match=r"acceptance rate must be in \[0, 1\]"):
        SpeculationGate(2, 0.5).record_acceptance_rate(rate)


def test_gate_argument_errors():
    with pytest.raises(ValueError, match="acceptance_rate_window_size"):
        SpeculationGate(0, 0.5)
    with pytest.raises(ValueError, match="acceptance_rate_threshold"):
        SpeculationGate(3, 1.5)
