"""Uncompressed indices: 32-bit little-endian when the tensor has at most 2**32 elements, else 64-bit."""
from __future__ import annotations

import numpy as np

from ..backend import arrays
from ..errors import ContainerError
from ..registry import register
from ._base import IndexCodec, IndexEncoding

_U4, _U8 = np.dtype("<u4"), np.dtype("<u8")


def index_dtype(numel: int) -> np.dtype:
    """The narrowest of uint32/uint64 that addresses ``numel`` elements."""
    return _U4 if numel <= 2**32 else _U8


@register
class RawIndex(IndexCodec):
    """Indices as plain integers (``32 r`` bits): the Top-r reference."""

    id = "raw"
    wire_id = 0
    array_api = True

    def encode(self, indices, values, dense, ctx):
        if type(dense) is np.ndarray:   # the host path: one conversion
            payload = np.asarray(indices).astype(index_dtype(dense.shape[0])).tobytes()
        else:
            payload = arrays.adapter(dense).uint_bytes(indices, index_dtype(dense.shape[0]).itemsize)
        return IndexEncoding(b"", payload, indices, values)

    def decode(self, params, payload, count, numel):
        dtype = index_dtype(numel)
        if params or len(payload) != count * dtype.itemsize:
            raise ContainerError(
                f"raw index section has {len(payload)} bytes, expected {count * dtype.itemsize}"
            )
        if isinstance(payload, bytes):   # the host path: one conversion, no array-API wrapper
            return np.frombuffer(payload, dtype).astype(np.int64)
        decoded = arrays.adapter(payload).from_section(payload, dtype.str)
        xp = arrays.namespace(decoded)
        return xp.astype(decoded, xp.int64)
