"""Deep Gradient Compression's sampled threshold (Lin et al., 2018; SIDCo's DGC baseline).

Estimate the Top-r threshold from a random sample of the magnitudes, select every entry that
reaches it, and if that selects more than ``r`` entries run an exact Top-r on the candidates
(the hierarchical selection). Fewer than ``r`` entries may be selected when the sample
over-estimates the threshold; like DGC, that is accepted (error feedback keeps the rest).
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import arrays, kernels
from ..params import Param
from ..registry import register
from ..wire.seeding import EncodeContext
from ._base import Sparsifier, count_for
from .basic import RATIO


def sample_positions(d: int, sample_ratio: float, min_samples: int, ctx: EncodeContext) -> np.ndarray:
    """The sampled positions (int64, with replacement) for a tensor of ``d`` entries.

    Drawn from ``ctx.rng("dgc")`` -- seeded from (config, tensor name, step) -- by NumPy in
    every binding (the torch binding copies them to the tensor's device), so all bindings use
    the same sample. When the sample would cover the tensor, every position is used once.
    """
    n = max(min_samples, int(math.ceil(sample_ratio * d)))
    if n >= d:
        return np.arange(d, dtype=np.int64)
    return ctx.rng("dgc").integers(0, d, size=n, dtype=np.int64)


def sample_count(k: int, n_samples: int, d: int) -> int:
    """How many of the sampled magnitudes lie above the estimated threshold: ``ceil(k n / d)``."""
    return min(n_samples, max(1, int(math.ceil(k * n_samples / d))))


@register
class DGC(Sparsifier):
    """Top-r approximated by a threshold estimated on a random sample (default 1%)."""

    id = "dgc"
    PARAMS = {
        "ratio": RATIO,
        "sample_ratio": Param(float, default=0.01, low=0.0, high=1.0, low_open=True,
                              doc="fraction of the entries sampled to estimate the threshold"),
        "min_samples": Param(int, default=1000, low=1, high=2**62, doc="lower bound on the sample size"),
    }

    array_api = True

    def select(self, flat, ctx):
        d = flat.shape[0]
        k = count_for(self.ratio, d)
        if k >= d:
            return kernels.topk_positions(flat, d)
        a, xp = arrays.adapter(flat), arrays.namespace(flat)
        positions = a.from_numpy(sample_positions(d, self.sample_ratio, self.min_samples, ctx), like=flat)
        sample = xp.abs(a.gather(flat, positions))
        cut = a.kth_largest(sample, sample_count(k, sample.shape[0], d))
        chosen = kernels.threshold_positions(flat, cut, self.threads)
        if chosen.shape[0] > k:
            chosen = a.gather(chosen, kernels.topk_positions(a.gather(flat, chosen), k, self.threads))
        return chosen
