"""Bin-mean values: ``2**b`` bins fitted to each message, each decoded as its bin's mean.

Start: the ``n`` values are ranked (stable sort: equal values keep their input order) and the
value of rank ``r`` falls in bin ``floor(r 2**b / n)``: equal-count (quantile) bins, as
SketchML's buckets. Then ``iterations`` Lloyd steps (1-D k-means): each bin's mean is its
float64 mean, the cuts are the midpoints between the means of adjacent non-empty bins, and every
value moves to the bin its cut interval names (``searchsorted``, a value on a cut goes up).
Heavy-tailed values (real gradients) need them: the equal-count start puts the few large values
in a bin with many middling ones (docs/values.md: at 2 bits on a ResNet-20 chunked Top-k the
relative error falls from 0.72 to 0.41 with 8 steps; uniform +-3 sigma has 0.61). A bin decodes
to the float32 mean of its values (0 for an empty bin), so the reconstruction keeps each bin's
sum, and the message's, to float32 rounding: no bias for error feedback to carry.

Wire: params ``u8 b``; section ``2**b f32 means | n codes of b bits`` (``bitpack``, LSB first):
``4 * 2**b + ceil(n b / 8)`` bytes. Order-preserving.

The NumPy code below is the definition. At 1-4 bits a NumPy message of finite values is encoded
by the C++ kernel ``deepreduce._select.binmean_codes`` when it is built: the equal-count start
with ``nth_element`` and the ties' input order, then each Lloyd step as one pass that moves the
values and sums the bins in input order (numpy's ``bincount`` order), so the same codes and means
(tests/test_values_bins.py), in about 40% of the NumPy code's CPU at 1-2 bits, 70% at 4
(docs/chunked.md).
"""
from __future__ import annotations

import numpy as np

from ..backend import kernels
from ..errors import ContainerError
from ..params import Param
from ..registry import register
from ._base import ValueCodec, ValueEncoding
from ._bins import BITS, pack_codes, read_bits, unpack_codes


def _quantile_start(v: np.ndarray, bins: int) -> np.ndarray:
    """The equal-count start: the value of rank ``r`` in a stable sort gets code ``floor(r bins /
    n)``. With up to 16 bins and finite values, without the sort: code = how many bin starts
    ``s_b = ceil(b n / bins)`` the value's rank reaches, and the rank reaches ``s_b`` where the
    value is above the ``s_b``-th smallest ``t`` (``np.partition``), or equal to it and not among
    the first ``s_b - #(v < t)`` of its ties in input order (the stable order); about 10x faster
    than the sort at 1-2 bits, the same codes (tests/test_values_bins.py)."""
    n = v.shape[0]
    if bins > 16 or not np.isfinite(v).all():
        order = np.argsort(v, kind="stable")
        codes = np.empty(n, dtype=np.int64)
        codes[order] = (np.arange(n, dtype=np.int64) * bins) // max(n, 1)
        return codes
    starts = [s for s in (-(-b * n // bins) for b in range(1, bins)) if s < n]
    counts = np.zeros(n, dtype=np.uint8)
    if starts:
        smallest = np.partition(v, starts)
        for s in starts:
            t = smallest[s]
            counts += v > t
            ties = np.flatnonzero(v == t)
            counts[ties[s - int(np.count_nonzero(v < t)):]] += 1
    return counts.astype(np.int64)


def _bins_at(cuts: np.ndarray, wide: np.ndarray) -> np.ndarray:
    """``searchsorted(cuts, wide, side="right")``: how many of the ascending ``cuts`` each value
    is at or above. Up to 15 cuts (4-bit codes) as one comparison pass per cut into uint8 counts,
    about 20x faster than the binary search on a message of 262,144 values, the same counts."""
    if cuts.shape[0] > 15:
        return np.searchsorted(cuts, wide, side="right")
    counts = np.zeros(wide.shape[0], dtype=np.uint8)
    for cut in cuts:
        counts += wide >= cut
    return counts


def fit_bins(v: np.ndarray, bits: int, iterations: int):
    """``(float32 means, int64 codes)`` of ``2**bits`` bins fitted to the float32 values ``v``: the
    equal-count start, then ``iterations`` Lloyd steps (the definition; see the module docstring)."""
    bins = 1 << bits
    codes = _quantile_start(v, bins)
    wide = v.astype(np.float64)
    for step in range(iterations + 1):
        sizes = np.bincount(codes, minlength=bins)
        means = np.bincount(codes, weights=wide, minlength=bins) / np.maximum(sizes, 1)
        if step == iterations:
            break
        held = np.flatnonzero(sizes)
        cuts = (means[held][1:] + means[held][:-1]) / 2
        codes = held[_bins_at(cuts, wide)]
    return means.astype(np.float32), codes


def _native_codes(v: np.ndarray, bits: int, iterations: int):
    """:func:`fit_bins` by the C++ kernel (1-4 bits, finite values), or None: then the NumPy code."""
    module = kernels.native() if bits <= 4 else None
    return None if module is None else module.binmean_codes(v, bits, iterations)


@register
class BinMeanValues(ValueCodec):
    """``b``-bit codes into a per-message table of ``2**b`` bin means (equal-count bins)."""

    id = "binmean"
    wire_id = 9
    PARAMS = {"bits": BITS,
              "iterations": Param(int, default=8, low=0, high=64, doc="Lloyd steps after the quantile start")}

    def encode(self, values, ctx):
        v = np.asarray(values, dtype=np.float32)
        found = _native_codes(v, self.bits, self.iterations)
        means, codes = found if found is not None else fit_bins(v, self.bits, self.iterations)
        payload = means.astype("<f4").tobytes() + pack_codes(codes, self.bits)
        return ValueEncoding(bytes([self.bits]), payload, reconstructed=means[codes])

    def decode(self, params, payload, count):
        bits, payload = read_bits(self.id, params), bytes(payload)
        table = 4 << bits
        if len(payload) < table:
            raise ContainerError(f"binmean value section has {len(payload)} bytes, fewer than its "
                                 f"{table}-byte table of {1 << bits} means")
        means = np.frombuffer(payload[:table], "<f4").astype(np.float32)
        if not np.all(np.isfinite(means)):
            raise ContainerError("binmean value table holds NaN or Inf")
        return means[unpack_codes(self.id, payload[table:], bits, count)]

    @classmethod
    def describe_params(cls, params):
        return {"bits": params[0]} if len(params) == 1 else super().describe_params(params)
