"""Fit-Poly and Fit-DExp on real gradients: error falls with segments; fits are well conditioned."""
from __future__ import annotations

import numpy as np
import pytest

from deepreduce.values.dexp import DExpFit
from deepreduce.values.polyfit import PolyFit, evaluate_segment, fit_segment
from deepreduce.wire.seeding import EncodeContext
from experiments import gradients

CTX = EncodeContext(b"\x00" * 16, "conv", 0)


def topr_values(ratio=0.01, name=gradients.DEFAULT_GRADIENT):
    g = gradients.get(name).ravel()
    r = int(ratio * g.size)
    return g[np.sort(np.argsort(-np.abs(g), kind="stable")[:r])]


def rel_error(codec, v):
    enc = codec.encode(v, CTX)
    out = codec.decode(enc.params, enc.payload, v.size)
    target = v[enc.order] if enc.order is not None else v
    return float(np.linalg.norm(out - target) / max(float(np.linalg.norm(v)), 1e-30))


@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_polyfit_error_falls_as_segments_are_added(ratio):
    v = topr_values(ratio)
    errors = [rel_error(PolyFit(segments=s, min_points=8), v) for s in (1, 2, 3, 4, 6, 8)]
    for before, after in zip(errors, errors[1:]):
        assert after <= before * (1 + 1e-4) + 1e-7
    assert errors[-1] < 0.6 * errors[0]


def test_polyfit_error_falls_with_degree_on_one_segment():
    v = np.sort(topr_values(0.1))[::-1]
    errors = [rel_error(PolyFit(degree=d, segments=1), v) for d in (0, 1, 3, 5)]
    assert all(b <= a * (1 + 1e-4) for a, b in zip(errors, errors[1:]))


def test_legendre_least_squares_is_exact_for_polynomials_on_huge_segments():
    # Raw x**5 on x ~ 1e5 would be singular; the scaled Legendre basis is not.
    t = np.linspace(-1, 1, 200_000)
    y = 3e-3 - 2e-3 * t + 5e-4 * t ** 3 - 1e-4 * t ** 5
    coef = fit_segment(y, 5)
    np.testing.assert_allclose(evaluate_segment(coef, y.size), y, atol=1e-12)


def test_polyfit_float64_coefficients_are_at_least_as_accurate():
    v = topr_values(0.1)
    assert rel_error(PolyFit(coef_dtype="float64"), v) <= rel_error(PolyFit(), v) + 1e-6


def test_polyfit_handles_constant_and_one_signed_inputs():
    for v in (np.full(500, 0.25, np.float32), -np.linspace(1, 2, 500, dtype=np.float32),
              np.zeros(100, np.float32)):
        assert rel_error(PolyFit(), v) < 1e-5


def test_dexp_is_deterministic_and_beats_a_constant():
    v = topr_values(0.01)
    c = DExpFit()
    a, b = c.encode(v, CTX), c.encode(v, CTX)
    assert a.payload == b.payload
    y = v[a.order].astype(np.float64)
    out = c.decode(a.params, a.payload, v.size)
    assert np.linalg.norm(out - y) < np.linalg.norm(y - y.mean())
    assert np.all(np.diff(a.order) != 0)


def _heavy_tailed_top_values(d=2_555_703, ratio=0.01, seed=0):
    """Top-r values of a generalised-Pareto (Lomax, shape 0.2) gradient, transmission order."""
    rng = np.random.default_rng(seed)
    g = (rng.pareto(5.0, size=d) * 1e-3 * np.where(rng.random(d) < 0.5, -1.0, 1.0)).astype(np.float32)
    k = int(ratio * d)
    return g[np.sort(np.argpartition(np.abs(g), d - k)[d - k:])]


def test_automatic_segments_grow_with_n_and_stay_small_for_few_values():
    from deepreduce.values.polyfit import auto_segments

    assert [auto_segments(n) for n in (0, 40, 64, 127, 128, 256, 368, 1000, 1001, 2000, 255_570)] == \
        [1, 1, 1, 1, 2, 4, 4, 4, 5, 5, 12]
    assert all(auto_segments(n) <= auto_segments(n + 1) for n in range(0, 5000, 7))
    assert PolyFit().segments == 0 and PolyFit(segments=4).segments == 4   # config override


def test_automatic_segments_beat_four_on_a_heavy_tail_at_scale():
    """Top-r 1% of a heavy-tailed gradient (25,557 values here; bench-fit measures 255,570):
    the automatic count (9 per sign, points down to degree + 1) has a fraction of the error of
    4 segments of >= 20 points, for a value section of a few hundred bytes."""
    from deepreduce.values.polyfit import auto_segments, parse_lengths

    v = _heavy_tailed_top_values()
    old = rel_error(PolyFit(segments=4, min_points=20), v)
    auto = PolyFit()
    new = rel_error(auto, v)
    assert new < 0.0031 < old and new < old / 4, (old, new)
    enc = auto.encode(v, CTX)
    lengths, _, _ = parse_lengths(enc.payload, v.size, 5)
    assert len(lengths) == 2 * auto_segments(v.size)
    assert len(enc.payload) == 4 + 4 * len(lengths) + 4 * 6 * len(lengths) < 0.01 * 4 * v.size
