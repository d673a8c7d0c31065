"""Small non-negative least-squares fits of measured costs (seconds, bytes) to linear models.

Measured costs are fitted as ``y = sum_j c_j x_j`` with every ``c_j >= 0`` (a per-call or
per-element cost cannot be negative; a noisy timing on a busy machine would otherwise give a
negative intercept). The fit minimises the *relative* error, so a 0.1 ms point weighs as much as
a 40 ms one and the per-call constant is not swamped by the large sizes. With a handful of
columns every subset of them is tried (an exact active-set search): deterministic, NumPy only.
"""
from __future__ import annotations

import itertools
import math
from typing import List, Sequence

import numpy as np

from ..errors import ConfigError


def fit_nonnegative(columns: Sequence[Sequence[float]], y: Sequence[float], name: str) -> List[float]:
    """Coefficients ``c >= 0`` of ``y ~ sum_j c_j columns[j]`` minimising ``sum ((fit - y) / y)^2``.

    ``columns``: one sequence per coefficient, each as long as ``y``; ``y`` must be positive and
    finite (``name`` labels it in errors). Columns left out of the best fit get coefficient 0.
    """
    target = np.asarray(y, dtype=np.float64)
    if target.ndim != 1 or target.size == 0 or not np.all(np.isfinite(target)) or np.any(target <= 0):
        raise ConfigError(f"{name}: need one or more positive finite measurements, got {list(y)!r}")
    design = np.asarray(columns, dtype=np.float64).reshape(len(columns), -1).T
    if design.shape[0] != target.size or not np.all(np.isfinite(design)):
        raise ConfigError(f"{name}: {design.shape[0]} finite predictor rows for {target.size} measurements")
    weighted, ones = design / target[:, None], np.ones_like(target)
    best, best_error = [0.0] * design.shape[1], math.inf
    for size in range(1, design.shape[1] + 1):
        for subset in itertools.combinations(range(design.shape[1]), size):
            coef = np.linalg.lstsq(weighted[:, subset], ones, rcond=None)[0]
            if np.any(coef < 0):
                continue
            error = float(np.sum((weighted[:, subset] @ coef - ones) ** 2))
            if error < best_error * (1 - 1e-12):   # a larger subset must fit strictly better
                best, best_error = [0.0] * design.shape[1], error
                for j, c in zip(subset, coef):
                    best[j] = float(c)
    return best
