"""Deflate: lossless zlib (RFC 1950/1951) over the float32 little-endian value bytes (DR §1, §3).

Order-preserving. Wire: no params (the level only affects the encoder); payload = the zlib
stream of ``4 n`` bytes. Decode inflates at most ``4 n + 1`` bytes, so a corrupted or hostile
stream can neither expand without bound nor hide trailing data.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..errors import ContainerError
from ..params import Param
from ..registry import register
from ._base import ValueCodec, ValueEncoding


@register
class DeflateValues(ValueCodec):
    """zlib-compressed float32 values (``level`` 0-9; spec default 6)."""

    id = "deflate"
    wire_id = 4
    PARAMS = {"level": Param(int, default=6, low=0, high=9, doc="zlib compression level")}

    def encode(self, values, ctx):
        values = np.ascontiguousarray(values, dtype=np.float32)
        raw = values.astype("<f4", copy=False).tobytes()
        return ValueEncoding(b"", zlib.compress(raw, self.level), reconstructed=values)

    def decode(self, params, payload, count):
        if params:
            raise ContainerError(f"deflate takes no parameters, container has {len(params)} bytes")
        expected = 4 * count
        inflater = zlib.decompressobj()
        try:
            raw = inflater.decompress(bytes(payload), expected + 1)
        except zlib.error as exc:
            raise ContainerError(f"deflate value section is not a valid zlib stream: {exc}") from exc
        if len(raw) != expected or not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
            raise ContainerError(
                f"deflate value section inflates to {len(raw)}{'+' if not inflater.eof else ''} bytes "
                f"(complete stream: {inflater.eof}), expected exactly {expected}"
            )
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)
