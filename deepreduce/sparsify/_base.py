"""The sparsifier contract: choose which entries of a flat gradient travel."""
from __future__ import annotations

import math

from ..params import Component
from ..wire.seeding import EncodeContext


def count_for(ratio: float, numel: int) -> int:
    """Number of entries a ratio keeps: ``floor(ratio * d)``, at least 1 for a non-empty tensor."""
    if numel == 0:
        return 0
    return min(numel, max(1, int(math.floor(ratio * numel))))


class Sparsifier(Component):
    """Selects entries of a flat float32 gradient.

    ``select`` returns the chosen positions as ascending int64, in the framework and on the device
    of ``flat``; the pipeline takes the values from the (compensated) gradient itself. The
    built-in sparsifiers are written once on the array namespace (``array_api = True``: NumPy on
    the host, with C++ kernels where built, or torch tensors on their device); a third-party one
    that handles NumPy only leaves ``array_api`` False and the pipeline runs it on a host copy.
    Randomised sparsifiers draw only from ``ctx.rng(...)`` (NumPy generators, the positions
    moved to the tensor's device), so every rank and binding makes the same choice.
    """

    kind = "sparsifier"
    threads = 1  # C++ kernel threads; the pipeline sets its resolved ``threads`` option
    array_api = False

    def select(self, flat, ctx: EncodeContext):
        raise NotImplementedError
