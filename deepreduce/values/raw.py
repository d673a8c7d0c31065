"""Uncompressed float32 values, and IEEE half precision.

Both are written against the array namespace (``deepreduce.backend.arrays``): NumPy values give
``bytes`` sections, torch tensors give uint8 tensors on their own device, with the same bytes.
"""
from __future__ import annotations

import numpy as np

from ..backend import arrays
from ..errors import ContainerError, DeepReduceError
from ..registry import register
from ._base import ValueCodec, ValueEncoding

FP16_MAX = float(np.finfo(np.float16).max)
_F4 = np.dtype("<f4")


def _check_length(codec: str, payload: bytes, count: int, itemsize: int) -> None:
    if len(payload) != count * itemsize:
        raise ContainerError(f"{codec} value section has {len(payload)} bytes, expected {count * itemsize}")


@register
class RawValues(ValueCodec):
    """Values as float32 little-endian (``32 r`` bits)."""

    id = "raw"
    wire_id = 0
    array_api = True

    def encode(self, values, ctx):
        values = arrays.as_float32(values)
        if type(values) is np.ndarray:   # the host path: float32 bytes, little-endian
            return ValueEncoding(b"", values.astype(_F4, copy=False).tobytes(), reconstructed=values)
        return ValueEncoding(b"", arrays.adapter(values).as_bytes(values), reconstructed=values)

    def decode(self, params, payload, count):
        _check_length("raw", payload, count, 4)
        if isinstance(payload, bytes):   # the host path: one copy into a native float32 array
            return np.frombuffer(payload, _F4).astype(np.float32)
        return arrays.adapter(payload).from_section(payload, "<f4")


@register
class Fp16Values(ValueCodec):
    """Values as IEEE float16 (``16 r`` bits).

    A finite value beyond float16's range would arrive as Inf, a wrong gradient; encode refuses
    it with an error instead.
    """

    id = "fp16"
    wire_id = 1
    array_api = True

    def encode(self, values, ctx):
        values = arrays.as_float32(values)
        xp = arrays.namespace(values)
        largest = float(xp.max(xp.abs(values))) if values.shape[0] else 0.0
        if largest > FP16_MAX:
            raise DeepReduceError(
                f"fp16 value codec: tensor {ctx.name!r} has a value of magnitude "
                f"{largest:.4g} beyond float16's {FP16_MAX}; use 'raw' or scale the loss"
            )
        half = xp.astype(values, xp.float16)
        return ValueEncoding(b"", arrays.adapter(values).as_bytes(half), reconstructed=xp.astype(half, xp.float32))

    def decode(self, params, payload, count):
        _check_length("fp16", payload, count, 2)
        half = arrays.adapter(payload).from_section(payload, "<f2")
        xp = arrays.namespace(half)
        return xp.astype(half, xp.float32)
