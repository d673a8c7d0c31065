"""Fit-DExp: one double exponential ``a e^{b t} + c e^{d t}`` through the sorted values (DR §5).

Encode (spec §1.11, reading III.13): sort descending by signed value (as Fit-Poly, the
permutation is ``ValueEncoding.order``), abscissa ``t_j = j / (n - 1)``, ordinates scaled by
``smax = max |y|``. Initial point ``a = y_0 / smax, b = -10, d = +10, c = (y_{n-1} / smax)
e^{-d}`` (a decaying positive head and a growing negative tail). Solver: Levenberg-Marquardt
with a fixed budget of ``iterations`` steps, deterministic damping (start 1e-3, divide by 3 on an
accepted step, multiply by 4 on a rejected one; the damping matrix is ``diag(J^T J)``), the
exponents clipped to ``[-max_rate, max_rate]``; the best parameters seen are kept. No random
restarts, no tolerance-dependent early exit, so a given input always yields the same bytes on
the same platform.

Wire: no params; payload ``a, b, c, d`` as four float32 (a and c rescaled to the data), 128 bits.
Decode evaluates the model at ``t_j`` in float64 and rounds to float32. With ``n <= 4`` the four
parameters would not be smaller than the values, so the sorted values travel verbatim (4n
bytes) instead; the decoder tells the two cases apart by ``n``.

Decode uses ``exp``, whose last-bit rounding may differ between math libraries; ranks on
different CPU types could then disagree in the last bit of a decoded value (Fit-Poly has no
such caveat).
"""
from __future__ import annotations

import numpy as np

from ..errors import ContainerError, DeepReduceError
from ..params import Param
from ..registry import register
from ._base import ValueCodec, ValueEncoding, in_input_order
from ._sorting import sort_descending

VERBATIM_MAX = 4


def model(params: np.ndarray, t: np.ndarray) -> np.ndarray:
    a, b, c, d = (float(p) for p in params)
    return a * np.exp(b * t) + c * np.exp(d * t)


def evaluate(params: np.ndarray, count: int) -> np.ndarray:
    """The decoded (sorted) values: the model at ``t_j = j / (count - 1)``, float64 rounded to float32."""
    t = np.arange(count, dtype=np.float64) / float(count - 1)
    with np.errstate(over="ignore", invalid="ignore"):
        return model(params, t).astype(np.float32)


def fit_dexp(y: np.ndarray, iterations: int, max_rate: float) -> np.ndarray:
    """LM fit of ``a e^{bt} + c e^{dt}`` to ``y`` (float64, descending) at ``t = j/(n-1)``."""
    n = y.size
    t = np.arange(n, dtype=np.float64) / float(n - 1)
    smax = float(np.max(np.abs(y)))
    if smax == 0.0:
        return np.zeros(4)
    ys = y / smax
    p = np.array([ys[0], -10.0, (ys[-1]) * np.exp(-10.0), 10.0])
    p[[1, 3]] = np.clip(p[[1, 3]], -max_rate, max_rate)

    def residual(q):
        return model(q, t) - ys

    r = residual(p)
    cost = float(r @ r)
    best, best_cost = p.copy(), cost
    lam = 1e-3
    for _ in range(iterations):
        eb, ed = np.exp(p[1] * t), np.exp(p[3] * t)
        jac = np.stack([eb, p[0] * t * eb, ed, p[2] * t * ed], axis=1)
        jtj = jac.T @ jac
        g = jac.T @ r
        damp = np.diag(np.maximum(np.diag(jtj), 1e-12))
        try:
            step = np.linalg.solve(jtj + lam * damp, -g)
        except np.linalg.LinAlgError:
            lam *= 4.0
            continue
        cand = p + step
        cand[[1, 3]] = np.clip(cand[[1, 3]], -max_rate, max_rate)
        with np.errstate(over="ignore", invalid="ignore"):
            rc = residual(cand)
            cand_cost = float(rc @ rc)
        if np.isfinite(cand_cost) and cand_cost < cost:
            p, r, cost = cand, rc, cand_cost
            lam = max(lam / 3.0, 1e-12)
            if cost < best_cost:
                best, best_cost = p.copy(), cost
        else:
            lam = min(lam * 4.0, 1e12)
    return np.array([best[0] * smax, best[1], best[2] * smax, best[3]])


@register
class DExpFit(ValueCodec):
    """Fit-DExp: four float32 parameters for the whole sorted value curve (reorders values)."""

    id = "dexp"
    wire_id = 3
    keeps_order = False
    PARAMS = {
        "iterations": Param(int, default=100, low=1, high=10000, doc="Levenberg-Marquardt steps (fixed)"),
        "max_rate": Param(float, default=60.0, low=1.0, high=80.0, doc="bound on |b| and |d|"),
    }

    def encode(self, values, ctx):
        values = np.ascontiguousarray(values, dtype=np.float32)
        perm = sort_descending(values)
        y = values[perm]
        if y.size <= VERBATIM_MAX:
            return ValueEncoding(b"", y.astype("<f4").tobytes(), perm, in_input_order(y, perm))
        params = fit_dexp(y.astype(np.float64), self.iterations, self.max_rate).astype("<f4")
        if not np.isfinite(params).all():
            raise DeepReduceError(f"dexp: the fit of tensor {ctx.name!r} produced non-finite parameters")
        curve = evaluate(params.astype(np.float64), y.size)
        if not np.isfinite(curve).all():
            raise DeepReduceError(f"dexp: the fit of tensor {ctx.name!r} decodes to non-finite values")
        return ValueEncoding(b"", params.tobytes(), perm, in_input_order(curve, perm))

    def decode(self, params, payload, count):
        if params:
            raise ContainerError(f"dexp takes no parameters, container has {len(params)} bytes")
        if count <= VERBATIM_MAX:
            if len(payload) != 4 * count:
                raise ContainerError(f"dexp value section has {len(payload)} bytes, expected {4 * count}")
            return np.frombuffer(payload, dtype="<f4").astype(np.float32)
        if len(payload) != 16:
            raise ContainerError(f"dexp value section has {len(payload)} bytes, expected 16")
        q = np.frombuffer(payload, dtype="<f4").astype(np.float64)
        if not np.isfinite(q).all():
            raise ContainerError("dexp value section holds non-finite parameters")
        out = evaluate(q, count)
        if not np.isfinite(out).all():
            raise ContainerError("dexp parameters decode to non-finite values")
        return out
