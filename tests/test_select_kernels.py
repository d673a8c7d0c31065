"""The C++ hot-path kernels (deepreduce._select) against their NumPy paths: identical results,
whatever the thread count."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from deepreduce import ContainerError, _native, kernels
from deepreduce.sparsify import _topk

native = _native.load("select")
needs_native = pytest.mark.skipif(native is None, reason="C++ extension _select not built")


def gradient(d, seed, ties=False):
    rng = np.random.default_rng(seed)
    g = rng.laplace(scale=1e-3, size=d).astype(np.float32)
    if ties:  # many exact ties of magnitude, both signs, at every scale
        g = np.round(g * 2e3).astype(np.float32) / np.float32(2e3)
    return g


def numpy_path(monkeypatch):
    monkeypatch.setenv("DEEPREDUCE_BACKEND", "numpy")


@needs_native
@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 5000), frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**16), ties=st.booleans(),
       threads=st.integers(1, 4))
def test_topk_matches_numpy_with_ties(d, frac, seed, ties, threads):
    g = gradient(d, seed, ties)
    r = int(frac * d)
    magnitudes = np.abs(g)
    if 0 < r < d:
        got = native.topk(g, r, None, threads)
        cut = np.partition(magnitudes, d - r)[d - r]
        above = np.flatnonzero(magnitudes > cut)
        want = np.sort(np.concatenate([above, np.flatnonzero(magnitudes == cut)[: r - above.size]]))
        np.testing.assert_array_equal(got, want)
        hist = kernels.magnitude_histogram(g)
        np.testing.assert_array_equal(native.topk(g, r, hist, threads), want)
    else:
        np.testing.assert_array_equal(_topk.topk_positions(g, r, threads), np.arange(d if r >= d else 0))


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_large_tensor_selection_and_scan_do_not_depend_on_threads(threads, monkeypatch):
    d = 700_001
    g = gradient(d, 3, ties=True)
    residual = gradient(d, 4)
    ref_residual = residual.copy()
    finite, hist = native.scan(g, residual, True, threads)
    assert finite
    np.add(ref_residual, g, out=ref_residual)
    np.testing.assert_array_equal(residual, ref_residual)
    np.testing.assert_array_equal(hist, kernels.magnitude_histogram(ref_residual))
    for r in (1, 7001, 350_000, d - 1):
        got = _topk.topk_positions(residual, r, threads, hist)
        numpy_path(monkeypatch)
        want = _topk.topk_positions(residual, r)
        monkeypatch.delenv("DEEPREDUCE_BACKEND")
        np.testing.assert_array_equal(got, want)
    got = _topk.threshold_positions(residual, 2e-3, threads)
    np.testing.assert_array_equal(got, np.flatnonzero(np.abs(residual) >= np.float32(2e-3)))


@pytest.mark.parametrize("threads", [1, 3])
def test_refused_step_restores_the_residual_identically_in_both_paths(threads, monkeypatch):
    d = 300_000
    g = gradient(d, 5)
    g[[10, 150_000, d - 1]] = [np.nan, np.inf, -np.inf]
    start = gradient(d, 6)
    results = []
    for backend in ("", "numpy"):
        monkeypatch.setenv("DEEPREDUCE_BACKEND", backend)
        residual = start.copy()
        finite, hist = kernels.scan(g, residual, True, threads)
        assert not finite and hist is None
        results.append(residual)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], start, rtol=0, atol=float(np.nanmax(np.abs(start + g)[np.isfinite(g)])) * 2**-23)


@pytest.mark.parametrize("threads", [1, 4])
def test_scatter_add_checks_and_adds(threads, monkeypatch):
    d = 400_000
    idx = np.sort(np.random.default_rng(0).choice(d, 200_000, replace=False))
    vals = gradient(idx.size, 1)
    for backend in ("", "numpy"):
        monkeypatch.setenv("DEEPREDUCE_BACKEND", backend)
        out = np.ones(d, np.float32)
        kernels.scatter_add(out, idx, vals, True, threads)
        want = np.ones(d, np.float32)
        want[idx] += vals
        np.testing.assert_array_equal(out, want)
        shuffled = np.random.default_rng(1).permutation(idx.size)
        out2 = np.ones(d, np.float32)
        kernels.scatter_add(out2, idx[shuffled], vals[shuffled], False, threads)
        np.testing.assert_array_equal(out2, want)
        for bad, message in ((np.r_[idx[:5], idx[4]], "not strictly ascending"), (np.r_[idx[:5], d], "out of range"),
                             (np.r_[-1, idx[:5]], "out of range"), (idx[::-1].copy(), "not strictly ascending")):
            with pytest.raises(ContainerError, match=message):
                kernels.scatter_add(np.zeros(d, np.float32), bad, np.ones(bad.size, np.float32), True, threads)
        with pytest.raises(ContainerError, match="repeats an index"):
            kernels.scatter_add(np.zeros(d, np.float32), np.r_[5, 3, 5], np.ones(3, np.float32), False, threads)


@needs_native
def test_in_place_arguments_are_never_copied():
    with pytest.raises(TypeError):
        native.scan(np.ones(10, np.float32), np.zeros(10, np.float64), False, 1)
    with pytest.raises(ValueError):
        native.scan(np.ones(10, np.float32), np.zeros(10, np.float32)[::-1].copy()[:5], False, 1)
    with pytest.raises(ValueError, match="histogram"):
        native.topk(np.ones(100, np.float32), 5, np.zeros(2048, np.uint64), 1)
