"""Top-r with a deterministic tie rule (Top-r, DGC, the SIDCo fallback) and threshold selection.

``argpartition`` (and ``torch.topk``) pick arbitrary members of a group of equal magnitudes at
the cut, so two bindings could select different positions for the same gradient. Here the cut
value is the r-th largest magnitude; every larger entry is taken, and the remaining places go to
the entries equal to the cut value in ascending position order. The torch binding implements
the same rule on non-CPU devices (``deepreduce.torch.sparsify``), so all select identical positions.

The C++ kernel (``csrc/select``) is a radix select on the magnitudes' float32 bit patterns (sign
bit cleared; for non-NaN floats their order is the order of the magnitudes): a histogram of the
top bits finds the bucket holding the cut, one pass gathers the entries of that bucket and
above, and the cut and its ties are resolved among those. (In a pipeline, the compensation pass
``deepreduce.backend.kernels.scan`` usually gathers the candidates itself, from a sampled bound.) The
NumPy path below gives the same positions. Inputs are finite (the pipeline sends non-finite
gradients dense).
"""
from __future__ import annotations

import numpy as np

from ..backend import kernels


def topk_positions(values: np.ndarray, r: int, threads: int = 1) -> np.ndarray:
    """Ascending int64 positions of the ``r`` entries of largest magnitude (ties: lowest first).

    ``values`` may be signed (magnitudes are taken) or magnitudes already.
    """
    d = values.size
    if r <= 0:
        return np.zeros(0, dtype=np.int64)
    if r >= d:
        return np.arange(d, dtype=np.int64)
    module = kernels.native()
    if module is not None:
        return module.topk(np.ascontiguousarray(values, dtype=np.float32), int(r), threads)
    magnitudes = np.abs(values)
    cut = np.partition(magnitudes, d - r)[d - r]
    above = np.flatnonzero(magnitudes > cut)
    at = np.flatnonzero(magnitudes == cut)[: r - above.size]
    chosen = np.concatenate([above, at])
    chosen.sort()
    return chosen.astype(np.int64, copy=False)


def threshold_positions(values: np.ndarray, threshold: float, threads: int = 1) -> np.ndarray:
    """Ascending int64 positions with ``|value| >= threshold`` (compared in float32)."""
    module = kernels.native()
    cut = np.float32(threshold)
    if module is not None:
        return module.threshold(np.ascontiguousarray(values, dtype=np.float32), float(cut), threads)
    return np.flatnonzero(np.abs(values) >= cut).astype(np.int64, copy=False)
