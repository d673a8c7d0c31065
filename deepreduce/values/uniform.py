"""Uniform b-bit values over +-kappa sigma (SparseLoCo's 2-bit values: 4 bins over +-3 sigma).

``sigma`` is the root mean square of the ``n`` transmitted values (float64, around zero: the
values of a Top-k are signed and centred); the range ``[-s, s]``, ``s = fl32(kappa sigma)``, is cut
into ``2**b`` bins of width ``w = 2 s / 2**b``; a value takes the bin ``clip(floor((v + s) / w), 0,
2**b - 1)`` (values beyond the range clip to the outer bins) and decodes to the bin's centre
``-s + (q + 1/2) w`` (float64, rounded to float32). Deterministic: no stochastic rounding.

Wire: params ``u8 b``; section ``f32 s | n codes of b bits`` (``bitpack``, LSB first):
``4 + ceil(n b / 8)`` bytes. Order-preserving. ``kappa`` only steers the encoder (``s`` travels).
"""
from __future__ import annotations

import numpy as np

from ..errors import ContainerError
from ..params import Param
from ..registry import register
from ._base import ValueCodec, ValueEncoding
from ._bins import BITS, pack_codes, read_bits, unpack_codes


def centres(scale: float, bits: int, codes: np.ndarray) -> np.ndarray:
    """The float32 values of ``codes`` for range ``+-scale``: the centres of ``2**bits`` bins."""
    width = 2.0 * scale / (1 << bits)
    return (-scale + (codes.astype(np.float64) + 0.5) * width).astype(np.float32)


@register
class UniformValues(ValueCodec):
    """``b``-bit uniform quantisation over ``+-kappa`` RMS, one float32 scale per message."""

    id = "uniform"
    wire_id = 8
    PARAMS = {"bits": BITS,
              "kappa": Param(float, default=3.0, low=0.0, high=1e6, low_open=True,
                             doc="half-range in units of the values' RMS")}

    def encode(self, values, ctx):
        v = np.asarray(values, dtype=np.float32)
        n = v.shape[0]
        rms = float(np.sqrt(np.mean(np.square(v, dtype=np.float64)))) if n else 0.0
        scale = float(np.float32(self.kappa * rms))
        if scale > 0:
            width = 2.0 * scale / (1 << self.bits)
            codes = np.clip(np.floor((v.astype(np.float64) + scale) / width), 0, (1 << self.bits) - 1).astype(np.int64)
        else:
            codes = np.zeros(n, dtype=np.int64)
        payload = np.float32(scale).astype("<f4").tobytes() + pack_codes(codes, self.bits)
        return ValueEncoding(bytes([self.bits]), payload, reconstructed=centres(scale, self.bits, codes))

    def decode(self, params, payload, count):
        bits, payload = read_bits(self.id, params), bytes(payload)
        if len(payload) < 4:
            raise ContainerError(f"uniform value section has {len(payload)} bytes, fewer than its 4-byte scale")
        scale = float(np.frombuffer(payload[:4], "<f4")[0])
        if not np.isfinite(scale) or scale < 0:
            raise ContainerError(f"uniform value scale {scale!r} is not a finite non-negative number")
        return centres(scale, bits, unpack_codes(self.id, payload[4:], bits, count))

    @classmethod
    def describe_params(cls, params):
        return {"bits": params[0]} if len(params) == 1 else super().describe_params(params)
