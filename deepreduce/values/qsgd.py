"""QSGD: stochastic uniform quantisation with one L2 norm per bucket (spec §1.13, III.15).

For each bucket ``u`` of ``bucket_size`` consecutive values (in transmission order; the last
bucket may be shorter): ``nu = ||u||_2`` rounded *up* to float32 (so ``|u_i| <= nu`` and levels
never exceed ``s``), ``z_i = s |u_i| / nu``, ``level_i = floor(z_i) + Bernoulli(z_i -
floor(z_i))``, ``q_i = sign(u_i) level_i``. Decode: ``u_hat_i = nu q_i / s`` with the same
float32 ``nu`` the encoder used, so ``E[u_hat] = u`` exactly (up to float rounding of the
product), and ``E||u_hat - u||^2 <= min(n/s^2, sqrt(n)/s) ||u||^2`` per bucket of ``n``.
The Bernoulli draws come from a counter-based generator (``deepreduce.wire.hashing.counter_uniform``:
draw ``i`` is a hash of ``(ctx.seed_for("qsgd"), i)``, the seed itself a hash of config, tensor
name and step), never a framework RNG, so NumPy and torch on any device draw the same noise.
The codec is written against the array namespace (``deepreduce.backend.arrays``): torch tensors are
encoded and decoded on their device with the same bytes. NumPy values are encoded by the C++
kernel ``deepreduce._select.qsgd_encode`` when it is built (per bucket the norm, then its
levels while the bucket is in cache; GIL released, ``threads`` threads; the same float64
arithmetic in the same order, so the same bytes: tests compare it with the array-namespace code
below). Bucket norms sum the
squares in a fixed pairwise order (:func:`bucket_norms`) so every framework rounds them alike.

Wire: params ``u16 levels | u32 bucket_size``; payload ``ceil(n / bucket_size)`` float32 norms,
then ``n`` signed integers, int8 when ``levels <= 127`` (spec: ``8 n + 32 ceil(n/512)`` bits)
else int16. Order-preserving: no permutation when combined with a set-only index codec.
"""
from __future__ import annotations

import struct

import numpy as np

from ..backend import arrays, kernels
from ..errors import ContainerError, DeepReduceError
from ..params import Param
from ..registry import register
from ..wire.hashing import counter_uniform
from ._base import ValueCodec, ValueEncoding


def level_dtype(levels: int) -> np.dtype:
    return np.dtype("<i1") if levels <= 127 else np.dtype("<i2")


def _pairwise_sum_rows(x):
    """Row sums of a 2-D float64 array, adding neighbouring columns level by level (a fixed
    order, so NumPy and torch round identically)."""
    xp = arrays.namespace(x)
    while x.shape[1] > 1:
        if x.shape[1] % 2:
            x = xp.concat([x, xp.zeros((x.shape[0], 1), dtype=x.dtype, device=x.device)], axis=1)
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]


def bucket_norms(values, bucket_size: int):
    """float32 L2 norm of each bucket, rounded up so that no |value| exceeds its norm.

    A bucket longer than the values is summed as one of ``n`` (the same pairwise sums: the
    padding only adds zeros), so memory is O(n) whatever ``bucket_size`` says."""
    xp = arrays.namespace(values)
    n = values.shape[0]
    bucket_size = min(bucket_size, max(n, 1))
    nb = -(-n // bucket_size)
    padded = xp.zeros(nb * bucket_size, dtype=xp.float64, device=values.device)
    padded[:n] = xp.astype(values, xp.float64)
    rows = xp.reshape(padded, (nb, bucket_size))
    exact = xp.sqrt(_pairwise_sum_rows(rows * rows))   # squares of float32 values are exact
    with np.errstate(over="ignore"):
        norms = xp.astype(exact, xp.float32)
    low = xp.astype(norms, xp.float64) < exact
    return xp.where(low, xp.nextafter(norms, xp.full_like(norms, float("inf"))), norms)


def dequantise(nu, q, levels: int):
    """``nu q / s`` in float64, rounded to float32: the receiver's values (encode and decode)."""
    xp = arrays.namespace(q)
    return xp.astype(nu * xp.astype(q, xp.float64) / levels, xp.float32)


def _per_value(norms, bucket_size: int, n: int):
    """Each value's bucket norm as float64 (O(n): a bucket longer than the values repeats its
    norm n times, never bucket_size times)."""
    xp = arrays.namespace(norms)
    return xp.repeat(xp.astype(norms, xp.float64), min(bucket_size, n))[:n]


@register
class QSGD(ValueCodec):
    """QSGD with ``levels`` magnitude levels (int8 for <= 127) and per-bucket L2 norms."""

    id = "qsgd"
    wire_id = 5
    array_api = True
    PARAMS = {
        "levels": Param(int, default=127, low=1, high=32767, doc="quantisation levels s"),
        "bucket_size": Param(int, default=512, low=1, high=2**32 - 1, doc="values per norm"),
    }

    def encode(self, values, ctx):
        values = arrays.as_float32(values)
        params = struct.pack("<HI", self.levels, self.bucket_size)
        native = None if arrays.is_torch(values) else kernels.native()
        if native is not None:
            encoded = native.qsgd_encode(values, self.levels, self.bucket_size, ctx.seed_for("qsgd"), self.threads)
            if encoded is None:
                raise self._overflow(ctx)
            norms, q, reconstructed = encoded
            return ValueEncoding(params, norms.tobytes() + q.tobytes(), reconstructed=reconstructed)
        a, xp = arrays.adapter(values), arrays.namespace(values)
        n, s = values.shape[0], self.levels
        norms = bucket_norms(values, self.bucket_size)
        if not bool(xp.all(xp.isfinite(norms))):
            raise self._overflow(ctx)
        nu = _per_value(norms, self.bucket_size, n)
        mag = xp.abs(xp.astype(values, xp.float64))
        positive = nu > 0
        z = xp.where(positive, s * mag / xp.where(positive, nu, xp.ones_like(nu)), xp.zeros_like(nu))
        floor = xp.floor(z)
        noise = counter_uniform(ctx.seed_for("qsgd"), n, values)
        level = xp.minimum(floor + xp.astype(noise < (z - floor), xp.float64), xp.full_like(floor, float(s)))
        q = xp.astype(xp.astype(xp.sign(values), xp.float64) * level, xp.int8 if s <= 127 else xp.int16)
        payload = a.concat_bytes([a.as_bytes(norms), a.as_bytes(q)])
        return ValueEncoding(params, payload, reconstructed=dequantise(nu, q, s))

    @staticmethod
    def _overflow(ctx) -> DeepReduceError:
        return DeepReduceError(f"qsgd: a bucket norm of tensor {ctx.name!r} overflows float32; scale the gradient")

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
        a = arrays.adapter(payload)
        norms = a.from_section(payload[:4 * nb], "<f4")
        q = a.from_section(payload[4 * nb:], dtype.str)
        xp = arrays.namespace(norms)
        if not (bool(xp.all(xp.isfinite(norms))) and bool(xp.all(norms >= 0))):
            raise ContainerError("qsgd value section holds a negative or non-finite norm")
        if count and (int(xp.max(q)) > s or int(xp.min(q)) < -s):
            raise ContainerError(f"qsgd value section holds a level beyond +-{s}")
        return dequantise(_per_value(norms, bucket, count), q, s)

    @classmethod
    def describe_params(cls, params):
        levels, bucket = cls._params(params)
        return {"levels": levels, "bucket_size": bucket}
