"""Bit-level run-length index codec (spec doc §1.8).

The index set is read as a bitmap of ``d`` bits; its runs alternate zeros and ones and start
with a run of zeros (0 long when index 0 is selected); the last run ends at ``d``. Payload:
``num_runs`` u32 | ``b`` u8 | the run lengths packed ``b = bit_length(max run)`` bits each with
deepreduce.bitpack (LSB first). Wire size ``40 + num_runs * b`` bits, rounded up to a byte.
Lossless; decodes to the ascending set.
"""
from __future__ import annotations

import struct

import numpy as np

from .. import bitpack
from ..errors import ContainerError
from ..registry import register
from ._base import IndexCodec, IndexEncoding

_HEAD = struct.Struct("<IB")


def runs_of(indices: np.ndarray, d: int) -> np.ndarray:
    """Alternating run lengths ``[z0, o0, z1, o1, ...]`` of the bitmap of a sorted unique set."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return np.array([d], dtype=np.int64)
    brk = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = idx[np.concatenate(([0], brk))]
    ends = idx[np.concatenate((brk - 1, [idx.size - 1]))] + 1
    edges = np.empty(2 * starts.size + 2, dtype=np.int64)
    edges[0], edges[1:-1:2], edges[2:-1:2], edges[-1] = 0, starts, ends, d
    runs = np.diff(edges)
    return runs[:-1] if runs[-1] == 0 else runs


def indices_of(runs: np.ndarray) -> np.ndarray:
    """The positions of the ones described by alternating runs starting with zeros."""
    runs = np.asarray(runs, dtype=np.int64)
    edges = np.concatenate(([0], np.cumsum(runs)))
    starts, lengths = edges[1::2][: runs[1::2].size], runs[1::2]
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return np.arange(total, dtype=np.int64) + offsets


@register
class RunLengthIndex(IndexCodec):
    """Bit-level run-length coding of the index bitmap (DeepReduce ``DR_RLE``)."""

    id = "rle"
    wire_id = 2
    keeps_order = False

    def encode(self, indices, values, dense, ctx):
        order = np.argsort(indices, kind="stable")
        indices, values = np.asarray(indices, dtype=np.int64)[order], np.asarray(values)[order]
        runs = runs_of(indices, int(dense.size))
        width = bitpack.width_for(int(runs.max()))
        payload = _HEAD.pack(runs.size, width) + bitpack.pack(runs, width)
        return IndexEncoding(b"", payload, indices, values)

    def decode(self, params, payload, count, numel):
        if params or len(payload) < _HEAD.size:
            raise ContainerError(f"RLE index section of {len(payload)} bytes is too short or has params")
        nruns, width = _HEAD.unpack_from(payload)
        if not 1 <= width <= 64 or nruns == 0 or nruns > 2 * count + 2:
            raise ContainerError(f"RLE header invalid: {nruns} runs of {width} bits for {count} indices")
        runs = bitpack.unpack(payload[_HEAD.size:], width, nruns)
        if (runs > np.uint64(numel)).any():
            raise ContainerError("RLE run longer than the tensor")
        runs = runs.astype(np.int64)
        if int(runs.sum()) != numel or int(runs[1::2].sum()) != count:
            raise ContainerError(f"RLE runs cover {int(runs.sum())} positions with {int(runs[1::2].sum())} ones; "
                                 f"expected {numel} and {count}")
        return indices_of(runs)


def wire_bits(indices, d: int) -> int:
    """Spec §1.8 size ``40 + |R| b`` in bits (before byte padding)."""
    runs = runs_of(np.sort(np.asarray(indices, dtype=np.int64)), d)
    return 40 + runs.size * bitpack.width_for(int(runs.max()))
