"""The C++ hot-path kernels (deepreduce._select) against their NumPy paths: identical results,
whatever the thread count."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce import ContainerError
from deepreduce.backend import _native, kernels

native = _native.load("select")
needs_native = pytest.mark.skipif(native is None, reason="C++ extension _select not built")


def gradient(d, seed, ties=False):
    rng = np.random.default_rng(seed)
    g = rng.laplace(scale=1e-3, size=d).astype(np.float32)
    if ties:  # many exact ties of magnitude, both signs, at every scale
        g = np.round(g * 2e3).astype(np.float32) / np.float32(2e3)
    return g


def reference_topk(g, r):
    """The tie rule spelled out: stable sort by descending magnitude, first r, ascending."""
    return np.sort(np.argsort(-np.abs(g), kind="stable")[:r])


def with_backend(monkeypatch, backend, fn):
    monkeypatch.setenv("DEEPREDUCE_BACKEND", backend)
    try:
        return fn()
    finally:
        monkeypatch.delenv("DEEPREDUCE_BACKEND")


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 5000), frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**16), ties=st.booleans(),
       threads=st.integers(1, 4))
def test_topk_follows_the_tie_rule(d, frac, seed, ties, threads):
    g = gradient(d, seed, ties)
    r = int(frac * d)
    np.testing.assert_array_equal(kernels.topk_positions(g, r, threads), reference_topk(g, r))


@settings(max_examples=30, deadline=None)
@given(digit=st.sampled_from([(20, 11), (9, 11), (0, 9), (0, 31)]), spread=st.integers(1, 2048),
       frac=st.floats(0.001, 0.999), seed=st.integers(0, 2**16), threads=st.integers(1, 3))
def test_topk_cut_among_many_candidates(digit, spread, frac, seed, threads):
    """The cut among more than 4,096 candidates (radix select, digit by digit): magnitudes that
    differ only in one digit of their bit pattern, in few values (many ties) or many. The
    tensor is large enough for scan's sampled bound."""
    shift, width = digit
    rng = np.random.default_rng(seed)
    d = 70_000
    base = np.uint32(0x3F000000) & ~np.uint32(((1 << width) - 1) << shift)
    low = rng.integers(0, min(spread, 1 << width), size=d, dtype=np.uint32)
    keys = base | (low << np.uint32(shift))
    signs = rng.integers(0, 2, size=d, dtype=np.uint32) << np.uint32(31)
    g = (keys | signs).view(np.float32)
    r = max(1, int(frac * d))
    np.testing.assert_array_equal(kernels.topk_positions(g, r, threads), reference_topk(g, r))
    residual = np.zeros(d, np.float32)
    finite, chosen = kernels.scan(g, residual, r, threads)
    np.testing.assert_array_equal(chosen, reference_topk(g, r))


def sparse_gradient(d, density, seed):
    """Non-zeros at ``density``, with -0.0 (a zero) and NaN (a non-zero) among them."""
    rng = np.random.default_rng(seed)
    g = np.where(rng.random(d) < density, rng.standard_normal(d), 0.0).astype(np.float32)
    g[rng.random(d) < 0.01] = -0.0
    g[rng.random(d) < 0.001] = np.nan
    return g


@settings(max_examples=60, deadline=None)
@given(d=st.integers(0, 3000), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16), threads=st.integers(1, 4))
def test_nonzero_is_flatnonzero(d, density, seed, threads):
    g = sparse_gradient(d, density, seed)
    got = kernels.nonzero(g, threads)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.flatnonzero(g))


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.6, 1.0])
def test_nonzero_over_several_chunks(threads, density, monkeypatch):
    """Tensors large enough for several threads: each chunk's branch-free writes stay in its share."""
    g = sparse_gradient(400_003, density, 7)
    results = [with_backend(monkeypatch, backend, lambda: kernels.nonzero(g, threads)) for backend in ("", "numpy")]
    np.testing.assert_array_equal(results[0], np.flatnonzero(g))
    np.testing.assert_array_equal(results[1], np.flatnonzero(g))


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("ties", [False, True])
def test_fused_scan_selects_like_topk_whatever_the_threads(threads, ties, monkeypatch):
    d = 700_001
    g = gradient(d, 3, ties)
    start = gradient(d, 4)
    for r in (1, 7001, 70_000, d - 1):
        results = []
        for backend in ("", "numpy"):
            residual = start.copy()
            finite, chosen = with_backend(monkeypatch, backend, lambda: kernels.scan(g, residual, r, threads))
            assert finite
            results.append((residual, chosen))
        np.testing.assert_array_equal(results[0][0], start + g)
        np.testing.assert_array_equal(results[1][0], start + g)
        np.testing.assert_array_equal(results[0][1], results[1][1])
        np.testing.assert_array_equal(results[0][1], kernels.topk_positions(start + g, r, threads))
    np.testing.assert_array_equal(kernels.threshold_positions(g, 2e-3, threads),
                                  np.flatnonzero(np.abs(g) >= np.float32(2e-3)))


def test_fused_scan_is_exact_when_the_sample_misleads():
    # the sampled blocks hold the large entries, so the sampled bound is far too high
    d = 1 << 20
    g = gradient(d, 8)
    starts = (d - 256) * np.arange(256) // 255
    for s in starts:
        g[s:s + 256] *= 1000
    g[123_457] = 5.0   # an outsider bigger than everything sampled
    finite, chosen = kernels.scan(g, None, 20_000, 2)
    assert finite
    np.testing.assert_array_equal(chosen, reference_topk(g, 20_000))


@pytest.mark.parametrize("threads", [1, 3])
def test_refused_step_restores_the_residual_identically_in_both_paths(threads, monkeypatch):
    d = 300_000
    g = gradient(d, 5)
    g[[10, 150_000, d - 1]] = [np.nan, np.inf, -np.inf]
    start = gradient(d, 6)
    results = []
    for backend in ("", "numpy"):
        residual = start.copy()
        finite, chosen = with_backend(monkeypatch, backend, lambda: kernels.scan(g, residual, 3000, threads))
        assert not finite and chosen is None
        results.append(residual)
    np.testing.assert_array_equal(results[0], results[1])
    bound = float(np.nanmax(np.abs(start + g)[np.isfinite(g)])) * 2**-23
    np.testing.assert_allclose(results[0], start, rtol=0, atol=bound)


@pytest.mark.parametrize("threads", [1, 4])
def test_scatter_add_checks_and_adds(threads, monkeypatch):
    d = 400_000
    idx = np.sort(np.random.default_rng(0).choice(d, 200_000, replace=False))
    vals = gradient(idx.size, 1)
    want = np.ones(d, np.float32)
    want[idx] += vals
    shuffled = np.random.default_rng(1).permutation(idx.size)
    for backend in ("", "numpy"):
        monkeypatch.setenv("DEEPREDUCE_BACKEND", backend)
        out = np.ones(d, np.float32)
        kernels.scatter_add(out, idx, vals, True, threads)
        np.testing.assert_array_equal(out, want)
        out = np.ones(d, np.float32)
        kernels.scatter_add(out, idx[shuffled], vals[shuffled], False, threads)
        np.testing.assert_array_equal(out, want)
        for bad, message in ((np.r_[idx[:5], idx[4]], "not strictly ascending"), (np.r_[idx[:5], d], "out of range"),
                             (np.r_[-1, idx[:5]], "out of range"), (idx[::-1].copy(), "not strictly ascending")):
            with pytest.raises(ContainerError, match=message):
                kernels.scatter_add(np.zeros(d, np.float32), bad, np.ones(bad.size, np.float32), True, threads)
        with pytest.raises(ContainerError, match="repeats an index"):
            kernels.scatter_add(np.zeros(d, np.float32), np.r_[5, 3, 5], np.ones(3, np.float32), False, threads)
        # no order promised: indices the ascending kernel refuses are checked again, and nothing
        # is written before a refusal
        for bad, message in ((np.r_[idx[:5], idx[4]], "repeats an index"), (np.r_[idx[:5], d], "out of range"),
                             (np.r_[idx[5], idx[:5], -1], "out of range")):
            out = np.zeros(d, np.float32)
            with pytest.raises(ContainerError, match=message):
                kernels.scatter_add(out, bad, np.ones(bad.size, np.float32), False, threads)
            assert not out.any()


@needs_native
def test_the_backend_variable_is_read_at_every_call(monkeypatch):
    # _native reads os.environ's own dict: every way of setting the variable must reach it
    import os
    from unittest import mock

    for set_numpy in (lambda: monkeypatch.setenv("DEEPREDUCE_BACKEND", "NumPy"),
                      lambda: os.environ.__setitem__("DEEPREDUCE_BACKEND", "numpy")):
        monkeypatch.delenv("DEEPREDUCE_BACKEND", raising=False)
        assert kernels.native() is native and not _native.forced_numpy()
        set_numpy()
        assert kernels.native() is None and _native.forced_numpy()
        monkeypatch.setenv("DEEPREDUCE_BACKEND", "c++")
        assert kernels.native() is native
    monkeypatch.delenv("DEEPREDUCE_BACKEND")
    with mock.patch.dict(os.environ, {"DEEPREDUCE_BACKEND": "numpy"}):
        assert kernels.native() is None
    assert kernels.native() is native


@needs_native
def test_in_place_arguments_are_never_copied():
    with pytest.raises(TypeError):
        native.scan(np.ones(10, np.float32), np.zeros(10, np.float64), 0, 1)
    with pytest.raises(ValueError, match="differ in size"):
        native.scan(np.ones(10, np.float32), np.zeros(5, np.float32), 0, 1)
    with pytest.raises(TypeError):
        native.scatter_add(np.zeros(10, np.float64), np.arange(3), np.ones(3, np.float32), 1)
