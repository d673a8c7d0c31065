"""The elementary sparsifiers: keep the non-zeros, Top-r by magnitude, Random-r."""
from __future__ import annotations

import warnings

import numpy as np

from ..backend import arrays, kernels
from ..params import Param
from ..registry import register
from ._base import Sparsifier, count_for

RATIO = Param(float, default=0.01, low=0.0, high=1.0, low_open=True, doc="fraction of entries kept")


DENSE_WARNING_DENSITY = 0.5


class DenseGradientWarning(RuntimeWarning):
    """A config without a sparsifier was fed a dense gradient: it sends most of the dense bytes."""


@register
class NoSparsifier(Sparsifier):
    """Keeps exactly the non-zero entries: the path for inherently sparse gradients (embeddings).

    Fed a dense gradient (more than ``DENSE_WARNING_DENSITY`` = 50% non-zeros) it still sends
    every non-zero, i.e. more bytes than the dense tensor once indices are added; it then
    issues one :class:`DenseGradientWarning` per tensor name (per instance, i.e. per pipeline)
    with the measured density, so the mistake of running an embedding config on dense layers
    is seen instead of silently costing bandwidth.
    """

    id = "none"
    array_api = True

    def _init_state(self) -> None:
        self._dense_warned: set = set()

    def select(self, flat, ctx):
        chosen = kernels.nonzero(flat, self.threads)
        self.check_density(int(chosen.shape[0]), flat.shape[0], ctx.name)
        return chosen

    def check_density(self, nonzero: int, numel: int, name: str) -> None:
        """Warn once per tensor name when ``nonzero / numel`` exceeds ``DENSE_WARNING_DENSITY``."""
        if numel == 0 or nonzero <= DENSE_WARNING_DENSITY * numel:
            return
        if name in self._dense_warned:
            return
        self._dense_warned.add(name)
        warnings.warn(
            f"sparsifier 'none' was given a dense gradient {name!r}: {nonzero} of {numel} entries "
            f"({100.0 * nonzero / numel:.1f}%) are non-zero, above the {100 * DENSE_WARNING_DENSITY:.0f}% "
            "this config is meant for (inherently sparse gradients); every non-zero is sent. "
            "Use a sparsifier (e.g. topk) for dense layers.",
            DenseGradientWarning, stacklevel=2)


@register
class TopK(Sparsifier):
    """Top-r: the ``floor(ratio * d)`` entries of largest magnitude."""

    id = "topk"
    PARAMS = {"ratio": RATIO}
    array_api = True

    def select(self, flat, ctx):
        # ties at the cut go to the lowest positions, so every binding selects the same entries
        return kernels.topk_positions(flat, count_for(self.ratio, flat.shape[0]), self.threads)

    def fused_count(self, numel: int) -> int:
        """The Top-r count the pipeline's compensation pass selects for this sparsifier
        (``deepreduce.backend.kernels.scan``: the same positions as :meth:`select`, in the same pass);
        0 for a subclass with its own ``select``."""
        return count_for(self.ratio, numel) if type(self).select is TopK.select else 0


@register
class RandomK(Sparsifier):
    """Random-r: ``floor(ratio * d)`` positions drawn uniformly without replacement.

    The draw is seeded from (config, tensor name, step), never from a global RNG.
    """

    id = "randomk"
    PARAMS = {"ratio": RATIO}
    array_api = True

    def select(self, flat, ctx):
        return arrays.adapter(flat).from_numpy(self.positions(flat.shape[0], ctx), like=flat)

    def positions(self, numel: int, ctx) -> np.ndarray:
        """The ascending positions drawn for a tensor of ``numel`` entries (used by every binding)."""
        r = count_for(self.ratio, numel)
        chosen = ctx.rng("randomk").choice(numel, size=r, replace=False)
        chosen.sort()
        return chosen.astype(np.int64, copy=False)
