"""The sparsifier contract: choose which entries of a flat gradient travel."""
from __future__ import annotations

import math

import numpy as np

from ..params import Component
from ..wire.seeding import EncodeContext


def count_for(ratio: float, numel: int) -> int:
    """Number of entries a ratio keeps: ``floor(ratio * d)``, at least 1 for a non-empty tensor."""
    if numel == 0:
        return 0
    return min(numel, max(1, int(math.floor(ratio * numel))))


class Sparsifier(Component):
    """Selects entries of a flat float32 gradient.

    ``select`` returns the chosen positions as ascending int64; the pipeline takes the values
    from the (compensated) gradient itself. Randomised sparsifiers draw only from
    ``ctx.rng(...)``, so every rank and binding makes the same choice for the same input.
    """

    kind = "sparsifier"
    threads = 1  # C++ kernel threads; the pipeline sets its resolved ``threads`` option

    def select(self, flat: np.ndarray, ctx: EncodeContext) -> np.ndarray:
        raise NotImplementedError
