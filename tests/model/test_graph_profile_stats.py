"""perf/graph_profile.py's arithmetic on a replay's kernel intervals: busy time as the union of overlapping
intervals, idle time as the span's rest, exposed time per kernel name, replays split at their gaps."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))


def test_busy_idle_and_exposed_of_overlapping_kernels():
    from graph_profile import replay_stats
    # a: 0-10 alone, then b overlaps it 5-10 and runs on to 14; a gap 14-20; c 20-25
    st = replay_stats([(0.0, 10.0, "a"), (5.0, 14.0, "b"), (20.0, 25.0, "c")])
    assert st["span_us"] == pytest.approx(25) and st["busy_us"] == pytest.approx(19)
    assert st["idle_us"] == pytest.approx(6) and st["kernel_sum_us"] == pytest.approx(24)
    assert st["exposed"] == pytest.approx({"a": 5.0, "b": 4.0, "c": 5.0})
    assert sorted(st["by_name"]) == ["a", "b", "c"]


def test_nested_interval_is_never_exposed():
    from graph_profile import replay_stats
    st = replay_stats([(0.0, 10.0, "outer"), (2.0, 3.0, "inner"), (4.0, 6.0, "inner")])
    assert st["busy_us"] == pytest.approx(10) and st["idle_us"] == 0
    assert st["exposed"].get("inner", 0.0) == 0 and st["exposed"]["outer"] == pytest.approx(7)


def test_replays_split_at_the_largest_gaps():
    from graph_profile import split_replays
    one = [(0.0, 2.0, "x"), (3.0, 5.0, "y"), (5.5, 6.0, "z")]
    ks = [(s + off, e + off, n) for off in (0.0, 100.0, 200.0) for s, e, n in one]
    parts = split_replays(ks, 3)
    assert [len(p) for p in parts] == [3, 3, 3] and parts[1][0][0] == 100.0
