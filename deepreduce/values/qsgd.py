"""QSGD: stochastic uniform quantisation with one L2 norm per bucket (spec §1.13, III.15).

For each bucket ``u`` of ``bucket_size`` consecutive values (in transmission order; the last
bucket may be shorter): ``nu = ||u||_2`` rounded *up* to float32 (so ``|u_i| <= nu`` and levels
never exceed ``s``), ``z_i = s |u_i| / nu``, ``level_i = floor(z_i) + Bernoulli(z_i -
floor(z_i))``, ``q_i = sign(u_i) level_i``. Decode: ``u_hat_i = nu q_i / s`` with the same
float32 ``nu`` the encoder used, so ``E[u_hat] = u`` exactly (up to float rounding of the
product), and ``E||u_hat - u||^2 <= min(n/s^2, sqrt(n)/s) ||u||^2`` per bucket of ``n``.
The Bernoulli draws come from ``ctx.rng("qsgd")``: seeded from (config, tensor name, step).

Wire: params ``u16 levels | u32 bucket_size``; payload ``ceil(n / bucket_size)`` float32 norms,
then ``n`` signed integers, int8 when ``levels <= 127`` (spec: ``8 n + 32 ceil(n/512)`` bits)
else int16. Order-preserving: no permutation when combined with a set-only index codec.
"""
from __future__ import annotations

import struct

import numpy as np

from ..errors import ContainerError, DeepReduceError
from ..params import Param
from ..registry import register
from ._base import ValueCodec, ValueEncoding


def level_dtype(levels: int) -> np.dtype:
    return np.dtype("<i1") if levels <= 127 else np.dtype("<i2")


def bucket_norms(values: np.ndarray, bucket_size: int) -> np.ndarray:
    """float32 L2 norm of each bucket, rounded up so that no |value| exceeds its norm."""
    n = values.size
    nb = -(-n // bucket_size)
    padded = np.zeros(nb * bucket_size, dtype=np.float64)
    padded[:n] = values
    exact = np.sqrt(np.einsum("ij,ij->i", padded.reshape(nb, bucket_size), padded.reshape(nb, bucket_size)))
    with np.errstate(over="ignore"):
        norms = exact.astype(np.float32)
    low = norms.astype(np.float64) < exact
    norms[low] = np.nextafter(norms[low], np.float32(np.inf))
    return norms


def dequantise(nu: np.ndarray, q: np.ndarray, levels: int) -> np.ndarray:
    """``nu q / s`` in float64, rounded to float32: the receiver's values (encode and decode)."""
    return (nu * q.astype(np.float64) / levels).astype(np.float32)


@register
class QSGD(ValueCodec):
    """QSGD with ``levels`` magnitude levels (int8 for <= 127) and per-bucket L2 norms."""

    id = "qsgd"
    wire_id = 5
    PARAMS = {
        "levels": Param(int, default=127, low=1, high=32767, doc="quantisation levels s"),
        "bucket_size": Param(int, default=512, low=1, high=2**32 - 1, doc="values per norm"),
    }

    def encode(self, values, ctx):
        values = np.ascontiguousarray(values, dtype=np.float32)
        n, s = values.size, self.levels
        norms = bucket_norms(values, self.bucket_size)
        if not np.isfinite(norms).all():
            raise DeepReduceError(
                f"qsgd: a bucket norm of tensor {ctx.name!r} overflows float32; scale the gradient"
            )
        nu = np.repeat(norms.astype(np.float64), self.bucket_size)[:n]
        mag = np.abs(values.astype(np.float64))
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(nu > 0, s * mag / np.where(nu > 0, nu, 1.0), 0.0)
        floor = np.floor(z)
        level = floor + (ctx.rng("qsgd").random(n) < (z - floor))
        level = np.minimum(level, s)
        q = (np.sign(values) * level).astype(level_dtype(s))
        params = struct.pack("<HI", s, self.bucket_size)
        return ValueEncoding(params, norms.astype("<f4").tobytes() + q.tobytes(),
                             reconstructed=dequantise(nu, q, s))

    @staticmethod
    def _params(params: bytes):
        if len(params) != 6:
            raise ContainerError(f"qsgd parameters have {len(params)} bytes, expected 6")
        levels, bucket = struct.unpack("<HI", params)
        if not 1 <= levels <= 32767 or bucket < 1:
            raise ContainerError(f"qsgd parameters invalid: levels {levels}, bucket size {bucket}")
        return levels, bucket

    def decode(self, params, payload, count):
        s, bucket = self._params(params)
        dtype = level_dtype(s)
        nb = -(-count // bucket)
        expected = 4 * nb + dtype.itemsize * count
        if len(payload) != expected:
            raise ContainerError(f"qsgd value section has {len(payload)} bytes, expected {expected}")
        norms = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float64)
        q = np.frombuffer(payload, dtype=dtype, offset=4 * nb, count=count)
        if not (np.isfinite(norms).all() and (norms >= 0).all()):
            raise ContainerError("qsgd value section holds a negative or non-finite norm")
        if count and (int(q.max()) > s or int(q.min()) < -s):
            raise ContainerError(f"qsgd value section holds a level beyond +-{s}")
        return dequantise(np.repeat(norms, bucket)[:count], q, s)

    @classmethod
    def describe_params(cls, params):
        levels, bucket = cls._params(params)
        return {"levels": levels, "bucket_size": bucket}
