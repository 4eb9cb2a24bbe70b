"""The step cost table: measured medians, real iterations correcting them, the stalest shape."""
import itertools

from specjax.engine import costs
from specjax.engine.costs import MIN_OBSERVED, CostTable, measure


def test_measure_keeps_the_median_of_the_timed_calls_after_an_untimed_one(monkeypatch):
    # A fake clock that only `run` advances: a loaded CI machine cannot turn a fast call slow.
    now = [0.0]
    monkeypatch.setattr(costs.time, "perf_counter", lambda: now[0])
    calls = []
    pauses = itertools.chain([5.0], itertools.cycle([1.0, 1.0, 3.0]))  # first: the compile

    def run(b, w):
        calls.append((b, w))
        now[0] += next(pauses) if (b, w) == (1, 2) else 0.5

    table = measure(run, [(1, 2), (4, 1)], repeats=3)
    assert calls.count((1, 2)) == 4 and calls.count((4, 1)) == 4
    assert table.seconds[1, 2] == 1.0   # the median ignores the one slow call and the untimed one
    assert table.seconds[4, 1] == 0.5
    assert set(table.for_bucket(1)) == {2} and set(table.for_bucket(4)) == {1}


def test_observed_costs_replace_the_measured_ones_and_shift_the_unobserved():
    t = CostTable({(1, 1): 1.0, (1, 2): 2.0, (1, 3): 3.0, (2, 1): 5.0})
    assert t.for_bucket(1) == {1: 1.0, 2: 2.0, 3: 3.0}
    for _ in range(MIN_OBSERVED - 1):
        t.observe(1, 2, 4.0)
    assert t.for_bucket(1)[2] == 2.0    # not enough observations yet
    t.observe(1, 2, 100.0)              # an outlier among them
    t.observe(1, 2, 4.0)
    assert t.for_bucket(1) == {1: 3.0, 2: 4.0, 3: 5.0}   # +2 s everywhere
    assert t.for_bucket(2) == {1: 5.0}  # other buckets keep their own
    t.observe(9, 9, 1.0)                # a shape never measured is ignored
    assert (9, 9) not in t.observed
    assert "observed" in t.format() and "batch 1" in t.format()


def test_the_stalest_shape_is_the_one_never_or_least_recently_seen():
    t = CostTable({(1, 1): 1.0, (1, 2): 2.0, (1, 3): 3.0})
    assert t.stalest(1, [1, 2, 3]) == 1
    t.touch(1, 1)
    assert t.stalest(1, [1, 2, 3]) == 2
    t.observe(1, 2, 2.0)
    t.touch(1, 3)
    assert t.stalest(1, [1, 2, 3]) == 1


def test_an_excess_growing_with_width_is_extrapolated_and_a_falling_one_is_not():
    t = CostTable({(1, w): float(w) for w in (1, 2, 3, 4)})
    for _ in range(MIN_OBSERVED):
        t.observe(1, 2, 2.0 + 3.0)   # excess 3 at width 2
        t.observe(1, 3, 3.0 + 4.0)   # excess 4 at width 3: +1 per width
    costs = t.for_bucket(1)
    assert costs[1] == 1.0 + 2.0 and costs[4] == 4.0 + 5.0
    f = CostTable({(1, w): float(w) for w in (1, 2, 3, 4)})
    for _ in range(MIN_OBSERVED):
        f.observe(1, 2, 2.0 + 4.0)
        f.observe(1, 3, 3.0 + 2.0)   # falling: the mean excess, 3, for the others
    assert f.for_bucket(1)[1] == 1.0 + 3.0 and f.for_bucket(1)[4] == 4.0 + 3.0
