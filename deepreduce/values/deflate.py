"""Deflate: lossless zlib (RFC 1950/1951) over the float32 little-endian value bytes (DR §1, §3).

Wire: no params (the level only affects the encoder); payload = the zlib stream of ``4 n``
bytes. Decode inflates at most ``4 n + 1`` bytes, so a corrupted or hostile stream can neither
expand without bound nor hide trailing data.

Value order: zlib finds little to repeat in float32 values in tensor order, but the same values
sorted (signed descending, as the curve fits sort them) share sign, exponent and leading
mantissa bytes with their neighbours and compress about twice as well. The encoder therefore
also compresses the sorted values and sends those, returning the permutation as
``ValueEncoding.order``, when that is smaller *including* what the order costs: nothing when the
pipeline's index codec keeps the value order (``reorder_is_free``: the pipeline permutes the
indices instead), the ``ceil(log2 n)``-bit permutation section otherwise (tried only when the
permutation alone is smaller than the tensor-order stream). The decoder is unchanged: it
inflates the values in whatever order they were sent.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..backend import _native
from ..errors import ContainerError
from ..params import Param
from ..registry import register
from ..wire import bitpack
from ._base import ValueCodec, ValueEncoding
from ._sorting import sort_descending

MAX_RATIO = 1032   # DEFLATE's largest expansion: a 258-byte match costs at least 2 bits


def sorted_order(values: np.ndarray) -> np.ndarray:
    """The signed descending order of float32 ``values`` (the C++ radix sort when built)."""
    native = _native.load("fit")
    if native is not None:
        return native.sort_desc(values)
    return sort_descending(values)


def permutation_bytes(n: int) -> int:
    """Size of the pipeline's permutation section for ``n`` values."""
    return bitpack.packed_size(n, bitpack.width_for(n - 1)) if n else 0


@register
class DeflateValues(ValueCodec):
    """zlib-compressed float32 values (``level`` 0-9; spec default 6), sorted when that is smaller."""

    id = "deflate"
    wire_id = 4
    keeps_order = False
    PARAMS = {"level": Param(int, default=6, low=0, high=9, doc="zlib compression level")}

    def encode(self, values, ctx):
        values = np.ascontiguousarray(values, dtype="<f4")
        plain = zlib.compress(values.tobytes(), self.level)
        order_cost = 0 if self.reorder_is_free else permutation_bytes(values.size)
        if values.size > 1 and order_cost < len(plain):
            order = sorted_order(values)
            ordered = zlib.compress(values[order].tobytes(), self.level)
            if len(ordered) + order_cost < len(plain):
                return ValueEncoding(b"", ordered, order, reconstructed=values)
        return ValueEncoding(b"", plain, reconstructed=values)

    def decode(self, params, payload, count):
        if params:
            raise ContainerError(f"deflate takes no parameters, container has {len(params)} bytes")
        expected = 4 * count
        if expected > MAX_RATIO * len(payload):
            raise ContainerError(f"deflate value section of {len(payload)} bytes cannot inflate to the "
                                 f"{expected} bytes of {count} values (zlib expands at most {MAX_RATIO}:1)")
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
