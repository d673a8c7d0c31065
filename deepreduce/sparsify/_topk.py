"""Top-r with a deterministic tie rule, shared by Top-r, DGC and the SIDCo fallback.

``argpartition`` (and ``torch.topk``) pick arbitrary members of a group of equal magnitudes at
the cut, so two bindings could select different positions for the same gradient. Here the cut
value is the r-th largest magnitude; every larger entry is taken, and the remaining places go to
the entries equal to the cut value in ascending position order. The torch binding implements
the same rule (``deepreduce.torch.sparsify``), so both select identical positions.
"""
from __future__ import annotations

import numpy as np


def topk_positions(magnitudes: np.ndarray, r: int) -> np.ndarray:
    """Ascending int64 positions of the ``r`` largest entries of ``magnitudes`` (ties: lowest first)."""
    d = magnitudes.size
    if r <= 0:
        return np.zeros(0, dtype=np.int64)
    if r >= d:
        return np.arange(d, dtype=np.int64)
    cut = np.partition(magnitudes, d - r)[d - r]
    above = np.flatnonzero(magnitudes > cut)
    at = np.flatnonzero(magnitudes == cut)[: r - above.size]
    chosen = np.concatenate([above, at])
    chosen.sort()
    return chosen.astype(np.int64, copy=False)
