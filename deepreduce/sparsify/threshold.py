"""Fixed-threshold sparsification: keep every entry whose magnitude reaches a constant."""
from __future__ import annotations

import numpy as np

from ..backend import kernels
from ..params import Param
from ..registry import register
from ._base import Sparsifier

FLOAT32_MAX = float(np.finfo(np.float32).max)


@register
class ThresholdSparsifier(Sparsifier):
    """Keeps the entries with ``|g_j| >= threshold``; the count follows the gradient's scale.

    With error feedback, entries below the threshold accumulate in the residual until they
    reach it. An empty selection is valid (nothing travels this step).
    """

    id = "threshold"
    PARAMS = {"threshold": Param(float, default=1e-3, low=0.0, high=FLOAT32_MAX, low_open=True,
                                 doc="magnitude an entry must reach to be sent (no float32 exceeds "
                                     "3.4028235e38)")}
    array_api = True

    def select(self, flat, ctx):
        return kernels.threshold_positions(flat, self.threshold, self.threads)
