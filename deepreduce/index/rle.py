"""Bit-level run-length index codec (DeepReduce's RLE baseline).

The index set is read as a bitmap of ``d`` bits; its runs alternate zeros and ones and start
with a run of zeros (0 long when index 0 is selected); the last run ends at ``d``. Payload:
``num_runs`` u32 | ``b`` u8 | the run lengths packed ``b = bit_length(max run)`` bits each with
deepreduce.wire.bitpack (LSB first). Wire size ``40 + num_runs * b`` bits, rounded up to a byte.
Lossless; decodes to the ascending set.

Written against the array namespace (``deepreduce.backend.arrays``): the runs, the bit packing and the
positions are computed on a torch tensor's own device with the NumPy bytes.
"""
from __future__ import annotations

import struct

import numpy as np

from ..backend import arrays
from ..errors import ContainerError
from ..registry import register
from ..wire import bitpack
from ._base import IndexCodec, IndexEncoding, sorted_pairs

_HEAD = struct.Struct("<IB")


def runs_of(indices, d: int):
    """Alternating run lengths ``[z0, o0, z1, o1, ...]`` of the bitmap of a sorted unique set."""
    if not arrays.is_torch(indices):
        indices = np.asarray(indices, dtype=np.int64)
    xp = arrays.namespace(indices)
    idx = xp.astype(indices, xp.int64)
    device = idx.device

    def const(*values):
        return xp.asarray(values, dtype=xp.int64, device=device)

    if idx.shape[0] == 0:
        return const(d)
    brk = xp.nonzero(xp.diff(idx) != 1)[0] + 1
    starts = idx[xp.concat((const(0), brk))]
    ends = idx[xp.concat((brk - 1, const(idx.shape[0] - 1)))] + 1
    edges = xp.zeros(2 * starts.shape[0] + 2, dtype=xp.int64, device=device)
    edges[-1] = d
    edges[1:-1:2], edges[2:-1:2] = starts, ends
    runs = xp.diff(edges)
    return runs[:-1] if int(runs[-1]) == 0 else runs


def indices_of(runs):
    """The positions of the ones described by alternating runs starting with zeros."""
    xp = arrays.namespace(runs)
    runs = xp.astype(runs, xp.int64)
    zero = xp.zeros(1, dtype=xp.int64, device=runs.device)
    edges = xp.concat((zero, xp.cumulative_sum(runs)))
    lengths = runs[1::2]
    starts = edges[1::2][: lengths.shape[0]]
    total = int(xp.sum(lengths))
    if total == 0:
        return xp.zeros(0, dtype=xp.int64, device=runs.device)
    before = xp.concat((zero, xp.cumulative_sum(lengths)[:-1]))
    offsets = xp.repeat(starts - before, lengths)
    return xp.arange(total, dtype=xp.int64, device=runs.device) + offsets


@register
class RunLengthIndex(IndexCodec):
    """Bit-level run-length coding of the index bitmap (DeepReduce ``DR_RLE``)."""

    id = "rle"
    wire_id = 2
    keeps_order = False
    array_api = True

    def encode(self, indices, values, dense, ctx):
        xp = arrays.namespace(dense)
        indices, values = sorted_pairs(indices, values, dense)
        runs = runs_of(indices, int(dense.shape[0]))
        width = bitpack.width_for(int(xp.max(runs)))
        payload = arrays.join_sections([_HEAD.pack(runs.shape[0], width), bitpack.pack(runs, width)], dense)
        return IndexEncoding(b"", payload, indices, values)

    def decode(self, params, payload, count, numel):
        if params or len(payload) < _HEAD.size:
            raise ContainerError(f"RLE index section of {len(payload)} bytes is too short or has params")
        nruns, width = _HEAD.unpack_from(arrays.head_bytes(payload, _HEAD.size))
        if not 1 <= width <= 64 or nruns == 0 or nruns > 2 * count + 2:
            raise ContainerError(f"RLE header invalid: {nruns} runs of {width} bits for {count} indices")
        runs = bitpack.unpack(payload[_HEAD.size:], width, nruns)
        xp = arrays.namespace(runs)
        if bool(xp.any(runs > numel)):   # widths on the device are at most 56 bits: no sign to mind
            raise ContainerError("RLE run longer than the tensor")
        runs = xp.astype(runs, xp.int64)
        covered, ones = int(xp.sum(runs)), int(xp.sum(runs[1::2]))
        if covered != numel or ones != count:
            raise ContainerError(f"RLE runs cover {covered} positions with {ones} ones; "
                                 f"expected {numel} and {count}")
        return indices_of(runs)


def wire_bits(indices, d: int) -> int:
    """Spec §1.8 size ``40 + |R| b`` in bits (before byte padding)."""
    runs = runs_of(np.sort(np.asarray(indices, dtype=np.int64)), d)
    return 40 + runs.shape[0] * bitpack.width_for(int(runs.max()))
