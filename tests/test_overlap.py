"""deepreduce.collective.overlap: the `background` option and the hidden-time measure."""

import pytest
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
