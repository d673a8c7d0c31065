"""The elementary sparsifiers: keep the non-zeros, Top-r by magnitude, Random-r."""
from __future__ import annotations

import numpy as np

from ..params import Param
from ..registry import register
from ._base import Sparsifier, count_for
from ._topk import topk_positions

RATIO = Param(float, default=0.01, low=0.0, high=1.0, low_open=True, doc="fraction of entries kept")


@register
class NoSparsifier(Sparsifier):
    """Keeps exactly the non-zero entries: the path for inherently sparse gradients (embeddings)."""

    id = "none"

    def select(self, flat, ctx):
        return np.flatnonzero(flat).astype(np.int64)


@register
class TopK(Sparsifier):
    """Top-r: the ``floor(ratio * d)`` entries of largest magnitude."""

    id = "topk"
    PARAMS = {"ratio": RATIO}
    uses_histogram = True  # the pipeline may hand over the magnitude histogram of its scan

    def select(self, flat, ctx, histogram=None):
        # ties at the cut go to the lowest positions, so every binding selects the same entries
        return topk_positions(flat, count_for(self.ratio, flat.size), self.threads, histogram)


@register
class RandomK(Sparsifier):
    """Random-r: ``floor(ratio * d)`` positions drawn uniformly without replacement.

    The draw is seeded from (config, tensor name, step), never from a global RNG.
    """

    id = "randomk"
    PARAMS = {"ratio": RATIO}

    def select(self, flat, ctx):
        return self.positions(flat.size, ctx)

    def positions(self, numel: int, ctx) -> np.ndarray:
        """The ascending positions drawn for a tensor of ``numel`` entries (used by every binding)."""
        r = count_for(self.ratio, numel)
        chosen = ctx.rng("randomk").choice(numel, size=r, replace=False)
        chosen.sort()
        return chosen.astype(np.int64, copy=False)
