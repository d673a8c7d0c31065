"""The bucket plan of deepreduce.buckets (the 2-rank optimizer test is in test_multirank.py)."""
import pytest
from hypothesis import given, strategies as st

from deepreduce import buckets
from deepreduce.errors import ConfigError


def test_plan_fills_buckets_in_order_up_to_the_cap():
    # 4 bytes an element: caps of 40 bytes hold 10 elements
    assert buckets.plan([4, 6, 1, 9, 3], 40) == [[0, 1], [2, 3], [4]]
    assert buckets.plan([4, 6, 1, 9, 3], 1 << 20) == [[0, 1, 2, 3, 4]]


def test_a_tensor_larger_than_the_cap_is_a_bucket_of_its_own():
    assert buckets.plan([2, 50, 3], 40) == [[0], [1], [2]]
    assert buckets.plan([50], 40) == [[0]]
    assert buckets.plan([], 40) == []


@given(sizes=st.lists(st.integers(1, 10_000), max_size=60), cap=st.integers(4, 100_000))
def test_property_every_tensor_once_in_order_and_no_bucket_over_the_cap_unless_alone(sizes, cap):
    plan = buckets.plan(sizes, cap)
    assert [i for bucket in plan for i in bucket] == list(range(len(sizes)))
    for bucket in plan:
        assert bucket and (len(bucket) == 1 or 4 * sum(sizes[i] for i in bucket) <= cap)
    for before, after in zip(plan, plan[1:]):   # a bucket closes only when the next tensor does not fit
        assert 4 * (sum(sizes[i] for i in before) + sizes[after[0]]) > cap


def test_offsets_of_concatenated_tensors():
    assert buckets.offsets([3, 1, 5]) == [0, 3, 4]
    assert buckets.offsets([]) == []


@pytest.mark.parametrize("cap", [0, -1, float("nan"), float("inf"), True, "25", [25]])
def test_bad_cap_is_a_config_error_naming_the_owner(cap):
    with pytest.raises(ConfigError, match="DistributedOptimizer: bucket_cap_mb must be a positive number"):
        buckets.check_bucket_cap(cap, "DistributedOptimizer")


def test_no_cap_means_no_buckets_and_numbers_pass():
    assert buckets.check_bucket_cap(None, "x") is None
    assert buckets.check_bucket_cap(25, "x") == 25 and buckets.check_bucket_cap(0.5, "x") == 0.5
