"""The elementary sparsifiers: keep the non-zeros, Top-r by magnitude, Random-r."""
from __future__ import annotations

import numpy as np

from ..params import Param
from ..registry import register
from ._base import Sparsifier, count_for

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

    def select(self, flat, ctx):
        r = count_for(self.ratio, flat.size)
        if r >= flat.size:
            return np.arange(flat.size, dtype=np.int64)
        chosen = np.argpartition(np.abs(flat), flat.size - r)[flat.size - r:]
        chosen.sort()
        return chosen.astype(np.int64, copy=False)


@register
class RandomK(Sparsifier):
    """Random-r: ``floor(ratio * d)`` positions drawn uniformly without replacement.

    The draw is seeded from (config, tensor name, step), never from a global RNG.
    """

    id = "randomk"
    PARAMS = {"ratio": RATIO}

    def select(self, flat, ctx):
        r = count_for(self.ratio, flat.size)
        chosen = ctx.rng("randomk").choice(flat.size, size=r, replace=False)
        chosen.sort()
        return chosen.astype(np.int64, copy=False)
