"""SketchML: quantile buckets, MinMaxSketch (min insert, max query), sign separation, Huffman."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.values.sketchml import (
    SketchML,
    SketchMLHuffman,
    minmax_insert,
    minmax_query,
    quantile_buckets,
    sketch_hash,
)
from deepreduce.wire.seeding import EncodeContext

CTX = EncodeContext(b"\x00" * 16, "w", 0)


def gradient_values(n, seed=0):
    return np.random.default_rng(seed).laplace(scale=1e-3, size=n).astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 400), q=st.integers(1, 64), rows=st.integers(1, 4),
       ratio=st.floats(0.05, 2.0), seed=st.integers(0, 2**32 - 1))
def test_minmax_sketch_only_underestimates(n, q, rows, ratio, seed):
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, q, size=n)
    keys = rng.choice(10 * n, size=n, replace=False)
    t = max(1, int(np.ceil(ratio * n)))
    got = minmax_query(minmax_insert(keys, truth, rows, t, seed, q), keys, seed)
    assert np.all(got <= truth) and np.all(got >= 0)
    if t >= 50 * n:   # a sketch far wider than the key set is almost always exact
        assert np.mean(got == truth) > 0.9


def test_paper_example_max_of_candidates():
    # SketchML Fig. 5: candidates {0, 2, 2} -> 2 (the query takes the max over rows).
    cells = np.array([[0], [2], [2]])
    assert minmax_query(cells, np.array([5]), 0).tolist() == [2]


def test_hash_is_explicit_and_seeded():
    keys = np.arange(5, dtype=np.uint64)
    assert sketch_hash(keys, 0, 0, 1000).tolist() == sketch_hash(keys, 0, 0, 1000).tolist()
    assert sketch_hash(keys, 0, 0, 2**40).tolist() != sketch_hash(keys, 1, 0, 2**40).tolist()
    assert sketch_hash(keys, 0, 0, 2**40).tolist() != sketch_hash(keys, 0, 1, 2**40).tolist()


def _reference_hash(key, row, seed, width):
    mask = 2**64 - 1
    z = (key + (row + 1) * 0x9E3779B97F4A7C15 + seed * 0xD1B54A32D192ED03) & mask
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & mask
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return z % width


def test_hash_matches_the_documented_formula_for_many_rows_and_seeds():
    keys = np.array([0, 1, 7, 2**40 + 3], dtype=np.uint64)
    for row, seed, width in ((0, 0, 97), (3, 12345, 10**6), (1, 2**32 - 1, 3)):
        assert sketch_hash(keys, row, seed, width).tolist() == [
            _reference_hash(int(k), row, seed, width) for k in keys]


def test_quantile_buckets_equal_counts_and_midpoints():
    x = np.arange(1000, dtype=np.float32)
    index, means = quantile_buckets(x, 10)
    counts = np.bincount(index)
    assert counts.size == 10 and counts.min() >= 99 and counts.max() <= 101   # equal counts, +-1
    assert means[0] == pytest.approx((0 + 99.9) / 2, abs=0.6)
    assert np.all(np.diff(means) >= 0)


@pytest.mark.parametrize("cls", [SketchML, SketchMLHuffman])
@pytest.mark.parametrize("params", [{}, {"groups": 4}, {"buckets": 8, "col_ratio": 0.05},
                                    {"sketch": False}, {"rows": 4, "hash_seed": 99}])
def test_never_flips_a_sign_and_never_increases_the_bucket(cls, params):
    v = gradient_values(3000, seed=len(params))
    v[:10] = 0.0
    c = cls(**params)
    enc = c.encode(v, CTX)
    out = c.decode(enc.params, enc.payload, v.size)
    assert np.all(np.sign(out) * np.sign(v) >= 0)
    # a decoded magnitude is the bucket value of the true bucket or of a lower one
    for sign in (1, -1):
        part = (v >= 0) if sign == 1 else (v < 0)
        idx, means = quantile_buckets(np.abs(v[part]), c.buckets)
        assert np.all(np.abs(out[part]) <= means[idx] + 1e-12)
        assert np.all(np.isin(np.abs(out[part]), means))
    if not c.sketch:   # without the sketch every value lands on its own bucket value
        idx, means = quantile_buckets(np.abs(v[v >= 0]), c.buckets)
        np.testing.assert_array_equal(out[v >= 0], means[idx])


def test_quantisation_error_bound_without_sketch():
    # SketchML Thm. A.2 with a split at 0: E||g_hat - g||^2 <= d/(4q) (phi_min^2 + phi_max^2)
    v = np.random.default_rng(3).uniform(-1, 1, size=4096).astype(np.float32)
    c = SketchML(buckets=64, sketch=False)
    enc = c.encode(v, CTX)
    out = c.decode(enc.params, enc.payload, v.size)
    bound = v.size / (4 * 64) * (v.min() ** 2 + v.max() ** 2)
    assert float(np.sum((out - v) ** 2)) <= bound


def test_grouping_reduces_the_error():
    v = gradient_values(5000, seed=1)
    errors = []
    for groups in (1, 8):
        c = SketchML(buckets=128, groups=groups)
        enc = c.encode(v, CTX)
        errors.append(np.linalg.norm(c.decode(enc.params, enc.payload, v.size) - v))
    assert errors[1] < errors[0]


def test_huffman_variant_decodes_like_the_plain_one_and_is_smaller_on_skewed_indices():
    v = gradient_values(4000, seed=2)
    plain, huff = SketchML(sketch=False, separate_signs=False), SketchMLHuffman(sketch=False, separate_signs=False)
    a, b = plain.encode(v, CTX), huff.encode(v, CTX)
    np.testing.assert_array_equal(plain.decode(a.params, a.payload, v.size), huff.decode(b.params, b.payload, v.size))
    # in a sketch, most cells hold small offsets (min insert), so Huffman pays off there
    s_plain, s_huff = SketchML(), SketchMLHuffman()
    assert len(s_huff.encode(v, CTX).payload) < len(s_plain.encode(v, CTX).payload) * 1.05


def test_unsigned_mode_can_flip_signs_which_is_why_separation_exists():
    v = np.array([-0.05, 0.03, 0.01, -0.01] * 50, dtype=np.float32)
    c = SketchML(buckets=2, separate_signs=False, sketch=False)
    enc = c.encode(v, CTX)
    out = c.decode(enc.params, enc.payload, v.size)
    assert np.any(np.sign(out) * np.sign(v) < 0)
