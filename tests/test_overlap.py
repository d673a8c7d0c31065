"""deepreduce.collective.overlap: per-tensor chains on worker threads and the hidden-time measure."""
import threading

import pytest
from conftest import run_threads
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.collective import overlap
from deepreduce.errors import ConfigError


@pytest.mark.parametrize("value, expected", [(True, overlap.DEFAULT_WORKERS), (False, 1), (1, 1), (3, 3)])
def test_background_option_gives_the_thread_count(value, expected):
    assert overlap.check_workers(value, "owner") == expected


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", None])
def test_bad_background_option_is_a_config_error_naming_the_owner(value):
    with pytest.raises(ConfigError, match=r"DistributedThing: background must be True, False or a positive"):
        overlap.check_workers(value, "DistributedThing")


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_results_come_back_in_item_order(workers):
    assert overlap.run_in_order(lambda i: i * i, range(9), workers) == [i * i for i in range(9)]


def test_one_worker_runs_inline_on_the_caller():
    caller = threading.current_thread()
    assert overlap.run_in_order(lambda _: threading.current_thread(), range(3), 1) == [caller] * 3


def test_several_workers_run_on_other_threads():
    names = overlap.run_in_order(lambda _: threading.current_thread().name, range(4), 2)
    assert all(name.startswith("deepreduce-chain") for name in names)


def test_the_first_failure_in_item_order_is_raised_after_every_task_ran():
    ran = []
    errors = {3: KeyError("three"), 5: ValueError("five")}

    def task(i):
        ran.append(i)
        if i in errors:
            raise errors[i]
        return i

    with pytest.raises(KeyError) as caught:
        overlap.run_in_order(task, range(8), 3)
    assert caught.value is errors[3]          # the very object the task raised
    assert sorted(ran) == list(range(8))      # the tasks after it still ran


def test_inline_run_stops_at_the_first_failure():
    ran = []

    def task(i):
        ran.append(i)
        if i == 1:
            raise ValueError("one")

    with pytest.raises(ValueError, match="one"):
        overlap.run_in_order(task, range(4), 1)
    assert ran == [0, 1]


@settings(max_examples=15, deadline=None)
@given(workers=st.integers(1, 4), items=st.integers(1, 12), other_workers=st.integers(1, 4))
def test_ranks_blocking_on_matched_collectives_never_deadlock(workers, items, other_workers):
    """Two simulated ranks run the same tasks; task i blocks until both ranks reached it (a
    collective matched by name). Started in item order, every task completes whatever the
    thread counts of the two ranks."""
    barriers = [threading.Barrier(2, timeout=20) for _ in range(items)]
    results = {}

    def collective(i):
        barriers[i].wait()
        return i

    def rank(r, count):
        results[r] = overlap.run_in_order(collective, range(items), count)

    run_threads(rank, [(0, workers), (1, other_workers)], 60)
    assert results == {0: list(range(items)), 1: list(range(items))}


def test_covered_seconds_examples():
    assert overlap.covered_seconds([(0, 10)], [(2, 4), (3, 6), (8, 20)]) == 6     # overlapping covers count once
    assert overlap.covered_seconds([(0, 1), (5, 7)], [(1, 5)]) == 0               # touching is not covering
    assert overlap.covered_seconds([(0, 4), (2, 6)], [(3, 5)]) == 3               # each span counts
    assert overlap.covered_seconds([(3, 1)], [(0, 9)]) == 0                        # reversed span
    assert overlap.covered_seconds([(0, 9)], []) == 0


intervals = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=12)


@settings(max_examples=200, deadline=None)
@given(spans=intervals, covers=intervals)
def test_covered_seconds_counts_every_unit_inside_a_cover(spans, covers):
    """On integer endpoints the measure is the count of unit cells [k, k+1] inside a span and some cover."""
    covered = {k for low, high in covers for k in range(low, high)}
    expected = sum(1 for start, end in spans for k in range(start, end) if k in covered)
    assert overlap.covered_seconds(spans, covers) == expected


@pytest.mark.parametrize("workers", [1, 3])
def test_run_chains_gives_rest_of_each_encode_in_order_and_times_the_encodes(workers):
    results, seconds, hidden = overlap.run_chains(lambda i: i * 10, lambda i, encoded: (i, encoded), range(6), workers)
    assert results == [(i, i * 10) for i in range(6)]
    assert 0.0 <= hidden <= seconds
    if workers == 1:   # one chain after another: no encode runs while another chain's rest does
        assert hidden == 0.0
