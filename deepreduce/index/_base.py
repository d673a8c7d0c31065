"""The index codec contract: compress the positions of the transmitted values."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..backend import arrays
from ..params import Component
from ..wire.seeding import EncodeContext


class IndexEncoding(NamedTuple):
    """What an index codec produced.

    ``indices`` and ``values`` are what the receiver will reconstruct, in the order the
    decoder yields the indices. A lossless codec returns its input; a Bloom policy returns
    its chosen set (ascending) with values taken from the dense gradient.
    """

    params: bytes
    payload: bytes
    indices: np.ndarray
    values: np.ndarray


def sorted_pairs(indices, values, like):
    """(indices as int64, values) reordered by ascending index (stable), in ``like``'s framework
    and device: what the set-only codecs (Bloom, RLE, Elias-Fano, delta) encode. Pairs already in
    ascending order (what every sparsifier's selection hands over) are returned as they are."""
    xp = arrays.namespace(like)
    if xp is arrays.NUMPY_NAMESPACE:   # NumPy itself: its array-API wrappers cost more than this work
        indices, values = np.asarray(indices, dtype=np.int64), np.asarray(values)
    else:
        indices, values = xp.astype(xp.asarray(indices), xp.int64, copy=False), xp.asarray(values)
    if indices.shape[0] < 2 or bool((indices[1:] >= indices[:-1]).all()):
        return indices, values
    order = xp.argsort(indices, stable=True)
    return indices[order], values[order]


class IndexCodec(Component):
    """Encodes a set of int64 positions in ``[0, numel)``.

    ``keeps_order``: decode returns the indices in the order encode received them, so the
    pipeline may hand them in any order (and needs no permutation for a reordering value codec).
    Codecs that only reproduce a set (ascending) set it to False.
    ``backend`` names the implementation that ran ("numpy" or "c++").
    ``threads``: how many threads the codec's C++ kernels may use (the pipeline's ``threads``
    option sets it); threads never change a byte of the output.
    """

    kind = "index"
    threads = 1  # C++ kernel threads; the pipeline sets its resolved ``threads`` option
    wire_id: int = -1
    keeps_order = True
    backend = "numpy"
    #: Written against the array namespace (``deepreduce.backend.arrays``): torch tensors are encoded
    #: and decoded on their own device. Others run on the host for device tensors (a one-time
    #: warning names them).
    array_api = False

    def encode(self, indices: np.ndarray, values: np.ndarray, dense: np.ndarray,
               ctx: EncodeContext) -> IndexEncoding:
        raise NotImplementedError

    def decode(self, params: bytes, payload: bytes, count: int, numel: int) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def describe_params(cls, params: bytes) -> dict:
        """The wire parameters as a dict, for ``deepreduce.inspect``."""
        return {"bytes": params.hex()} if params else {}
