"""Chunk-local indices at a fixed width: SparseLoCo's 12-bit indices (for chunks of 4,096).

Every index travels as its offset within its chunk (``deepreduce.wire.chunks``), packed at
``w = width_for(C - 1)`` bits (12 for ``C = 4096``; ``deepreduce.wire.bitpack``, LSB first),
chunk after chunk, ascending within a chunk. With the geometry of a ``chunk_topk`` selection in
the parameters (``varint C | varint k``) the section is exactly ``ceil(n w / 8)`` bytes; any
other set first sends every chunk's count at ``width_for(C)`` bits (``k = 0`` in the parameters):
``ceil(ceil(d / C) width_for(C) / 8) + ceil(n w / 8)`` bytes. ``C`` is the smaller of the config's
``chunk`` and the tensor's size.
"""
from __future__ import annotations

import numpy as np

from ..errors import ContainerError
from ..registry import register
from ..wire import bitpack, chunks
from ._chunked import ChunkIndexCodec


def offset_width(lengths: np.ndarray) -> int:
    """Bits per offset: ``width_for(C - 1)``, C the longest chunk."""
    return bitpack.width_for(int(lengths.max()) - 1) if lengths.shape[0] else 1


@register
class ChunkFixedIndex(ChunkIndexCodec):
    """Chunk-local offsets at ``ceil(log2 C)`` bits each (the SparseLoCo baseline)."""

    id = "chunk_fixed"
    wire_id = 7

    def pack_chunks(self, local, counts, lengths):
        return bytes(bitpack.pack(local.astype(np.uint64), offset_width(lengths)))

    def unpack_chunks(self, section, counts, lengths):
        n, width = int(counts.sum()), offset_width(lengths)
        if len(section) != bitpack.packed_size(n, width):
            raise ContainerError(f"chunk_fixed section has {len(section)} bytes, expected "
                                 f"{bitpack.packed_size(n, width)} for {n} offsets of {width} bits")
        chunks.check_padding(self.id, section, n * width)
        return np.asarray(bitpack.unpack(section, width, n)).astype(np.int64)
