"""What the chunk-local index codecs share: chunking the set, the geometry parameters, the checks.

A codec here sees the (ascending) positions as one subset per chunk
(``deepreduce.wire.chunks``): chunk ``j`` holds ``h_j`` positions, given as offsets in
``[0, L_j)`` (``L_j = C`` but for a shorter tail). The subclass codes the offsets of every
chunk (:meth:`ChunkIndexCodec.pack_chunks` / :meth:`ChunkIndexCodec.unpack_chunks`); the
parameter bytes and, for a set that is not a ``chunk_topk`` selection, the count section are
written and checked here, so decode is self-describing: the receiver needs neither the sender's
config nor its sparsifier. Set-only codecs (``keeps_order = False``): decode yields the set
ascending, and encode hands back the pairs in that order.
"""
from __future__ import annotations

import numpy as np

from ..errors import ContainerError
from ..params import Param
from ..wire import bitpack, chunks, varint
from ._base import IndexCodec, IndexEncoding, sorted_pairs

CHUNK = Param(int, default=4096, low=1, high=chunks.MAX_CHUNK,
              doc="chunk length C (the sparsifier's; another set is coded with explicit counts)")


class ChunkIndexCodec(IndexCodec):
    """Base of the chunk-local index codecs (``chunk`` parameter, geometry in the header)."""

    keeps_order = False
    PARAMS = {"chunk": CHUNK}

    def encode(self, indices, values, dense, ctx):
        indices, values = sorted_pairs(indices, values, dense)
        positions = np.asarray(indices, dtype=np.int64)
        numel, n = int(dense.shape[0]), int(positions.shape[0])
        if n == 0:
            return IndexEncoding(b"", b"", indices, values)
        chunk = min(self.chunk, numel)
        counts = chunks.counts_of(positions, numel, chunk)
        k = chunks.uniform_k(counts, numel, chunk)
        head = b"" if k else bitpack.pack(counts.astype(np.uint64), chunks.count_width(chunk))
        starts = np.repeat(np.arange(counts.shape[0], dtype=np.int64) * chunk, counts)
        body = self.pack_chunks(positions - starts, counts, chunks.chunk_lengths(numel, chunk))
        return IndexEncoding(chunks.write_params(chunk, k), bytes(head) + body, indices, values)

    def decode(self, params, payload, count, numel):
        payload = bytes(payload)
        if count == 0:
            if params or payload:
                raise ContainerError(f"{self.id} section of 0 indices has {len(params)} parameter and "
                                     f"{len(payload)} payload bytes, expected none")
            return np.zeros(0, dtype=np.int64)
        chunk, k = chunks.read_params(self.id, bytes(params), count, numel)
        if chunk > numel:
            raise ContainerError(f"{self.id} chunk {chunk} is longer than the tensor of {numel}")
        if k:
            counts, used = chunks.uniform_counts(numel, chunk, k), 0
        else:
            counts, used = chunks.read_counts(self.id, payload, numel, chunk, count)
        lengths = chunks.chunk_lengths(numel, chunk)
        local = self.unpack_chunks(payload[used:], counts, lengths)
        limits = np.repeat(lengths, counts)
        if bool(np.any(local < 0)) or bool(np.any(local >= limits)):
            raise ContainerError(f"{self.id} section holds an offset beyond its chunk")
        out = local + np.repeat(np.arange(counts.shape[0], dtype=np.int64) * chunk, counts)
        if out.shape[0] > 1 and bool(np.any(out[1:] <= out[:-1])):
            raise ContainerError(f"{self.id} section repeats an index or is not ascending in a chunk")
        return out

    @classmethod
    def describe_params(cls, params: bytes) -> dict:
        if not params:
            return {}
        try:
            chunk, pos = varint.decode(params, 0, "chunk")
            k, _ = varint.decode(params, pos, "k")
        except ContainerError as exc:
            return {"error": str(exc)}
        return {"chunk": chunk, "k": k if k else "counted"}

    def pack_chunks(self, local: np.ndarray, counts: np.ndarray, lengths: np.ndarray) -> bytes:
        """The section (after any counts) for the chunk-local ``local`` offsets, ascending in each
        chunk, ``counts[j]`` of them in chunk ``j`` of ``lengths[j]`` elements."""
        raise NotImplementedError

    def unpack_chunks(self, section: bytes, counts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The int64 chunk-local offsets :meth:`pack_chunks` wrote; ContainerError on a section of
        the wrong length or with bits no encoder writes."""
        raise NotImplementedError
