"""Uncompressed float32 values, and IEEE half precision."""
from __future__ import annotations

import numpy as np

from ..errors import ContainerError, DeepReduceError
from ..registry import register
from ._base import ValueCodec, ValueEncoding

FP16_MAX = float(np.finfo(np.float16).max)


def _check_length(codec: str, payload: bytes, count: int, itemsize: int) -> None:
    if len(payload) != count * itemsize:
        raise ContainerError(f"{codec} value section has {len(payload)} bytes, expected {count * itemsize}")


@register
class RawValues(ValueCodec):
    """Values as float32 little-endian (``32 r`` bits)."""

    id = "raw"
    wire_id = 0

    def encode(self, values, ctx):
        values = np.asarray(values, dtype=np.float32)
        return ValueEncoding(b"", values.astype("<f4", copy=False).tobytes(), reconstructed=values)

    def decode(self, params, payload, count):
        _check_length("raw", payload, count, 4)
        return np.frombuffer(payload, dtype="<f4").astype(np.float32)


@register
class Fp16Values(ValueCodec):
    """Values as IEEE float16 (``16 r`` bits).

    A finite value beyond float16's range would arrive as Inf, a wrong gradient; encode refuses
    it with an error instead.
    """

    id = "fp16"
    wire_id = 1

    def encode(self, values, ctx):
        values = np.asarray(values, dtype=np.float32)
        if values.size and float(np.max(np.abs(values))) > FP16_MAX:
            raise DeepReduceError(
                f"fp16 value codec: tensor {ctx.name!r} has a value of magnitude "
                f"{float(np.max(np.abs(values))):.4g} beyond float16's {FP16_MAX}; use 'raw' or scale the loss"
            )
        half = values.astype("<f2")
        return ValueEncoding(b"", half.tobytes(), reconstructed=half.astype(np.float32))

    def decode(self, params, payload, count):
        _check_length("fp16", payload, count, 2)
        return np.frombuffer(payload, dtype="<f2").astype(np.float32)
