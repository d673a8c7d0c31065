"""Bloom P2 (conflict-set selection, Algorithm 1): the C++ kernel against the NumPy twin.

The C++ kernel serves the singleton conflict sets in one streaming pass over the blocks and only
builds the larger sets, restricted to the members still unchosen, when the singletons do not
reach r (docs/bloom.md). These tests pin that it chooses exactly what the literal Algorithm 1
of ``np_select_conflict`` chooses on both sides of that split, on the sort path used for block
counts far above the positives, with repeated probe bits, and across calls that reuse the
kernel's per-thread scratch, and through the per-set index of unchosen members over many passes.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepreduce.backend import _native
from deepreduce.index import bloom as bl

NATIVE = _native.load("bloom")
pytestmark = pytest.mark.skipif(NATIVE is None, reason="C++ extension deepreduce._bloom not built")


def algorithm_1(P, r, size, k, seed, draw_seed, family="blocked"):
    """Algorithm 1 written out on Python objects, straight from docs/bloom.md (the reference)."""
    sets = {}
    for a, row in enumerate(bl.positions(P, size, k, seed, family).tolist()):
        for bit in set(row):
            sets.setdefault(bit, []).append(a)   # members ascending
    active = sorted(sets, key=lambda bit: (len(sets[bit]), bit))
    chosen, draw = set(), 0
    while len(chosen) < r and active:
        following = []
        for bit in active:
            if len(chosen) == r:
                break
            cand = [a for a in sets[bit] if a not in chosen]
            if not cand:
                continue
            pick = 0
            if len(cand) > 1:
                draw += 1
                pick = (bl.mix64_int(draw_seed + draw * bl.GAMMA) * len(cand)) >> 64
                following.append(bit)
            chosen.add(cand[pick])
        active = following
    return P[sorted(chosen)]


def singletons_cover(P, r, blocks, k, seed):
    """Whether the members of singleton conflict sets alone number at least r (then the kernel
    never builds a larger set)."""
    pos = bl.blocked_positions(P, blocks, k, seed)
    pairs = np.unique(np.stack([pos.ravel(), np.repeat(np.arange(P.size), k)]), axis=1)
    bits, counts = np.unique(pairs[0], return_counts=True)
    single = np.isin(pairs[0], bits[counts == 1])
    return np.unique(pairs[1][single]).size >= r


def filter_positives(d, n, fpr, seed):
    """The positives of a blocked filter holding n random indices of [0, d), and its shape."""
    idx = np.sort(np.random.default_rng(seed).choice(d, n, replace=False)).astype(np.uint64)
    blocks, k = bl.filter_params(n, fpr)
    bits = NATIVE.build(idx, blocks, k, seed, 1)
    return NATIVE.query(bits, blocks, k, seed, d, d, 1), blocks, k


def assert_same_choice(P, r, size, k, seed, draw_seed, family="blocked", reference=True):
    """C++ == the NumPy twin (== the written-out reference where it is fast enough)."""
    got = NATIVE.select_conflict(P, r, size, k, seed, draw_seed, family)
    assert np.array_equal(got, bl.np_select_conflict(P, r, size, k, seed, draw_seed, family))
    if reference:
        assert np.array_equal(got, algorithm_1(P, r, size, k, seed, draw_seed, family))
    assert got.size == r and np.all(got[1:] > got[:-1])


@pytest.mark.parametrize("fpr", [0.001, 0.01, 0.3, 0.6])
def test_filter_positives_choose_as_algorithm_1(fpr):
    n = 1_500
    P, blocks, k = filter_positives(30_000, n, fpr, seed=int(fpr * 1000))
    for r in (0, 1, n // 2, n, P.size):
        assert_same_choice(P, r, blocks, k, 5, 77)


def test_both_phases_are_exercised():
    P, blocks, k = filter_positives(30_000, 1_500, 0.6, seed=3)
    assert not singletons_cover(P, P.size, blocks, k, 5)    # phase B needed
    assert_same_choice(P, P.size, blocks, k, 5, 1)
    P, blocks, k = filter_positives(30_000, 1_500, 0.001, seed=3)
    assert singletons_cover(P, 1_500, blocks, k, 5)         # phase A alone
    assert_same_choice(P, 1_500, blocks, k, 5, 1)


def test_crowded_blocks_and_repeated_probe_bits():
    P = np.arange(0, 3_000, 3, dtype=np.uint64)
    for blocks, k in [(1, 64), (2, 40), (7, 9)]:   # hundreds of members per block; k = 64 repeats bits
        for r in (1, 500, P.size):
            assert_same_choice(P, r, blocks, k, 11, 2**64 - 1)


def test_many_passes_over_large_sets_draw_through_the_index_as_algorithm_1():
    """One block, k = 1: 512 sets of about 16 members each, and r up to every positive, so the
    greedy runs pass after pass, every draw a descent of the per-set index of unchosen members
    and every choice a removal from it (the all-ones filter's shape, scaled down)."""
    P = np.arange(0, 3 * 8_192, 3, dtype=np.uint64)
    for r in (600, 4_000, P.size):
        assert_same_choice(P, r, 1, 1, 6, 2**63 + 5)
        assert_same_choice(P, r, 64 * 8, 1, 6, 3, "splitmix")


def test_block_count_far_above_the_positives_takes_the_sort_path():
    P = np.array([0, 5, 9, 2**40, 2**63 + 1], dtype=np.uint64)
    for blocks in (4 * P.size + 4097, bl.MAX_BLOCKS, 1):
        assert_same_choice(P, 3, blocks, 4, 0, 8)


def test_scratch_reuse_across_calls_changes_nothing():
    big, bb, bk = filter_positives(60_000, 3_000, 0.05, seed=1)
    small, sb, sk = filter_positives(2_000, 50, 0.05, seed=2)
    first = NATIVE.select_conflict(big, 2_900, bb, bk, 1, 4)
    for _ in range(2):
        assert_same_choice(small, 50, sb, sk, 1, 4)
        assert np.array_equal(NATIVE.select_conflict(big, 2_900, bb, bk, 1, 4), first)
    # 1.2M positives grow the scratch past what a thread keeps: it is released after the call
    huge = np.arange(0, 2_400_000, 2, dtype=np.uint64)
    hb, hk = bl.filter_params(huge.size, 0.05)
    picked = NATIVE.select_conflict(huge, huge.size - 5_000, hb, hk, 3, 5)
    assert picked.size == huge.size - 5_000 and np.isin(picked, huge).all()
    assert_same_choice(small, 50, sb, sk, 1, 4)
    assert np.array_equal(NATIVE.select_conflict(huge, huge.size - 5_000, hb, hk, 3, 5), picked)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 600), size=st.integers(1, 300), k=st.integers(1, 64),
       family=st.sampled_from(["blocked", "splitmix"]), seed=st.integers(0, 2**64 - 1),
       draw_seed=st.integers(0, 2**64 - 1))
def test_property_cpp_and_numpy_choose_as_algorithm_1(data, n, size, k, family, seed, draw_seed):
    rng = np.random.default_rng(seed % 2**32)
    P = np.unique(rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True))
    r = data.draw(st.integers(0, P.size))
    assert_same_choice(P, r, size, k, seed, draw_seed, family)
