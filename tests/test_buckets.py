"""The bucket plan of deepreduce.collective.buckets (the 2-rank optimizer test is in test_multirank.py)."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepreduce.collective import buckets
from deepreduce.errors import ConfigError


def test_plan_fills_buckets_in_order_up_to_the_cap():
    # 4 bytes an element: caps of 40 bytes hold 10 elements
    assert buckets.plan([4, 6, 1, 9, 3], 40) == [[0, 1], [2, 3]]      # 3 is left alone: on its own
    assert buckets.plan([4, 6, 1, 9, 3], 1 << 20) == [[0, 1, 2, 3, 4]]


def test_a_tensor_alone_in_its_bucket_is_left_out():
    assert buckets.plan([2, 50, 3], 40) == []
    assert buckets.plan([50], 40) == [] and buckets.plan([], 40) == []
    assert buckets.plan([2, 3, 50, 1, 1], 40) == [[0, 1], [3, 4]]


@given(sizes=st.lists(st.integers(1, 10_000), max_size=60), cap=st.integers(4, 100_000))
def test_property_buckets_are_disjoint_runs_of_two_or_more_within_the_cap(sizes, cap):
    plan = buckets.plan(sizes, cap)
    flat = [i for bucket in plan for i in bucket]
    assert flat == sorted(set(flat))                                   # in order, each at most once
    for bucket in plan:
        assert len(bucket) > 1 and bucket == list(range(bucket[0], bucket[-1] + 1))
        assert 4 * sum(sizes[i] for i in bucket) <= cap
        nxt = bucket[-1] + 1                                           # closed only when the next did not fit
        assert nxt == len(sizes) or 4 * (sum(sizes[i] for i in bucket) + sizes[nxt]) > cap
    for i in set(range(len(sizes))) - set(flat):                      # a tensor left alone: the next did not fit
        assert i + 1 == len(sizes) or 4 * (sizes[i] + sizes[i + 1]) > cap


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


def test_a_cap_with_a_summable_compressor_is_a_config_error():
    with pytest.raises(ConfigError, match="deepreduce.tensorflow: bucket_cap_mb applies to deepreduce configs"):
        buckets.check_bucket_cap_for(1.0, True, "deepreduce.tensorflow")
    assert buckets.check_bucket_cap_for(None, True, "x") is None
    assert buckets.check_bucket_cap_for(2, False, "x") == 2
    with pytest.raises(ConfigError, match="positive number of MiB"):
        buckets.check_bucket_cap_for(-1, False, "x")


def test_plan_backward_takes_the_model_order_reversed_and_leaves_out_unknown_and_small_tensors():
    # positions 0..5 in model order; 1 has no known size (or another dtype), 4 is below min_numel
    numels = [100, None, 100, 100, 5, 100]
    assert buckets.plan_backward(numels, cap_mb=250 * 4 / buckets.MIB, min_numel=10) == [[5, 3], [2, 0]]
    assert buckets.plan_backward(numels, cap_mb=250 * 4 / buckets.MIB) == [[5, 4, 3], [2, 0]]
