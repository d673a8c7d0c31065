"""SketchML values: quantile buckets, MinMaxSketch, optional Huffman coding (SketchML §3, spec §2.3-2.4, §1.15).

Encode, per *part* (the non-negative and the negative values when ``separate_signs``; all
values otherwise):

1. **Quantile buckets** (§2.3): ``q = min(buckets, count)`` buckets with equal counts; over the
   sorted part ``x`` (magnitudes when signs are separated, so for both signs bucket 0 is the one
   closest to zero), the splits are ``sp_j = x[floor(j (count - 1) / q)]``, ``j = 0..q``;
   bucket ``b(v) = #{j in 1..q-1 : sp_j <= v}``; the bucket value is the midpoint
   ``(sp_b + sp_{b+1}) / 2`` (reading III.3), sent as a float32 table of ``q`` entries.
2. **MinMaxSketch** (§2.4, when ``sketch``): bucket indices are split into ``groups`` groups of
   ``ceil(q / groups)`` consecutive indices; each group has ``rows x t`` cells,
   ``t = max(1, ceil(col_ratio * keys in the group))``, initialised to a sentinel. Insert keeps
   the *minimum* in-group offset per cell, query takes the *maximum* over the rows, so a decoded
   index never exceeds the true one (and with separated signs a value never changes sign and
   only shrinks in magnitude).
   Without ``sketch`` the bucket index of every value is sent directly (the SKCompress reading
   III.16: "MinMaxSketch not used").
3. **Huffman** (codec ``sketchml_huffman``): the bucket-index stream (sketch cells, or the
   per-value indices) is canonical-Huffman coded (``deepreduce.wire.huffman_code``) instead of
   fixed-width packed. This is SKCompress's value half.

Keys. Inside DeepReduce the value codec does not see the tensor indices; the key hashed into
the sketch is the value's position ``j`` in the transmitted sequence, which the receiver knows
because the index codec restores the same order (SketchML's own setting hashes the tensor key;
for a seeded hash the two are equivalent). The sign of each value (one bit per value) and, with
``groups > 1``, its group (``ceil(log2 G)`` bits) travel explicitly, because the key lists per
(sign, group) of SketchML are a single ordered index list here.

Hash (explicit, identical everywhere): ``h_i(j) = mix64(j + (i + 1) * 0x9E3779B97F4A7C15 +
hash_seed * 0xD1B54A32D192ED03) mod t`` for row ``i``, all arithmetic modulo 2^64, where
``mix64`` is the SplitMix64 finaliser ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
z *= 0x94D049BB133111EB; z ^= z >> 31``.

Wire. Params (8 bytes): ``u8 flags (bit0 separate_signs, bit1 sketch) | u8 rows | u16 groups |
u32 hash_seed``. Payload: [sign bitmap, ``bitpack`` width 1, when separated] then per non-empty
part: ``u16 q | q float32 bucket values`` and either the per-value index stream, or [group ids
packed ``width_for(G - 1)`` bits when ``G > 1``] and per non-empty group ``u32 t | cell stream``
(``rows * t`` in-group offsets). A stream is ``bitpack`` at ``width_for(alphabet - 1)`` bits, or
for the Huffman variant ``huffman_code.pack_lengths(...) | u32 byte length | Huffman bits``.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from ..errors import ConfigError, ContainerError, size_text
from ..params import Param
from ..registry import register
from ..wire import bitpack, huffman_code
from ._base import ValueCodec, ValueEncoding

#: The most sketch cells per encoded value (``rows x col_ratio``): the encoder holds ``rows x t``
#: int64 cells per group, ``t = ceil(col_ratio * keys)``, so its memory is ``8 rows col_ratio``
#: bytes per value: at most 128 (32 times the float32 value). SketchML's own settings are below
#: 1 (a sketch is meant to be smaller than the indices it replaces); ``rows = 255`` with
#: ``col_ratio = 1000`` asked for 2 MB per value, 94.6 GiB for a layer's first encode.
MAX_CELLS_PER_VALUE = 16
CELL_BYTES = 8
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SEED_MUL = np.uint64(0xD1B54A32D192ED03)
FLAG_SEPARATE = 0x01
FLAG_SKETCH = 0x02


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sketch_hash(keys: np.ndarray, row: int, seed: int, width: int) -> np.ndarray:
    """Cell column of each key in row ``row`` of a sketch ``width`` columns wide."""
    with np.errstate(over="ignore"):
        base = np.uint64(row + 1) * _GOLDEN + np.uint64(seed) * _SEED_MUL
        z = np.asarray(keys, dtype=np.uint64) + base
        return (mix64(z) % np.uint64(width)).astype(np.int64)


def quantile_buckets(x: np.ndarray, buckets: int):
    """(bucket index of each value, float32 bucket values) for the values ``x`` (non-empty)."""
    count = x.size
    q = min(buckets, count)
    xs = np.sort(x)
    splits = xs[(np.arange(q + 1, dtype=np.int64) * (count - 1)) // q].astype(np.float64)
    index = np.searchsorted(splits[1:q], x, side="right").astype(np.int64)
    means = ((splits[:-1] + splits[1:]) / 2.0).astype(np.float32)
    return index, means


def minmax_insert(keys: np.ndarray, offsets: np.ndarray, rows: int, t: int, seed: int, sentinel: int) -> np.ndarray:
    """Sketch cells after inserting every (key, offset) with the min rule; unwritten cells 0."""
    cells = np.full((rows, t), sentinel, dtype=np.int64)
    for i in range(rows):
        np.minimum.at(cells[i], sketch_hash(keys, i, seed, t), offsets)
    cells[cells == sentinel] = 0
    return cells


def minmax_query(cells: np.ndarray, keys: np.ndarray, seed: int) -> np.ndarray:
    """Max over the rows of the cells each key hashes to."""
    rows, t = cells.shape
    out = np.zeros(keys.size, dtype=np.int64)
    for i in range(rows):
        np.maximum(out, cells[i][sketch_hash(keys, i, seed, t)], out=out)
    return out


class _Reader:
    """Sequential reads from a payload; every overrun is a ContainerError."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, size: int) -> bytes:
        if size < 0 or self.pos + size > len(self.buf):
            raise ContainerError(f"sketchml value section is truncated at byte {self.pos}")
        out = self.buf[self.pos:self.pos + size]
        self.pos += size
        return out

    def u16(self) -> int:
        return struct.unpack("<H", self.take(2))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]


@register
class SketchML(ValueCodec):
    """SketchML value compression: quantile buckets + MinMaxSketch (order-preserving, lossy)."""

    id = "sketchml"
    wire_id = 6
    huffman = False
    PARAMS = {
        "buckets": Param(int, default=128, low=1, high=65535, doc="quantile buckets q per part"),
        "separate_signs": Param(bool, default=True, doc="separate positive and negative values"),
        "sketch": Param(bool, default=True, doc="use MinMaxSketch (else one bucket index per value)"),
        "rows": Param(int, default=2, low=1, high=255, doc="MinMaxSketch rows s"),
        "col_ratio": Param(float, default=0.2, low=0.0, high=1000.0, low_open=True,
                           doc="columns t = ceil(col_ratio * keys) per group"),
        "groups": Param(int, default=1, low=1, high=65535, doc="MinMaxSketch groups r"),
        "hash_seed": Param(int, default=0, low=0, high=2**32 - 1, doc="MinMaxSketch hash seed"),
    }

    def _validate(self) -> None:
        cells = self.rows * self.col_ratio
        if self.sketch and cells > MAX_CELLS_PER_VALUE:
            per_value = CELL_BYTES * cells
            raise ConfigError(
                f"value codec {self.id!r}: rows={self.rows} x col_ratio={self.col_ratio:g} = {cells:g} sketch cells "
                f"per value would need {size_text(per_value)} per encoded value ({size_text(per_value * 2**20)} "
                f"for a tensor of 2**20 values); at most rows x col_ratio = {MAX_CELLS_PER_VALUE} "
                f"({size_text(CELL_BYTES * MAX_CELLS_PER_VALUE)} per value)")

    # ------------------------------------------------------------------ streams
    def _put_stream(self, symbols: np.ndarray, alphabet: int) -> bytes:
        if self.huffman:
            lengths = huffman_code.code_lengths(np.bincount(symbols, minlength=alphabet))
            bits = huffman_code.encode(symbols, lengths)
            return huffman_code.pack_lengths(lengths) + struct.pack("<I", len(bits)) + bits
        return bitpack.pack(symbols, bitpack.width_for(alphabet - 1))

    def _get_stream(self, r: _Reader, count: int, alphabet: int) -> np.ndarray:
        if self.huffman:
            lengths, r.pos = huffman_code.unpack_lengths(r.buf, r.pos, max_alphabet=alphabet)
            if lengths.size != alphabet:
                raise ContainerError(f"sketchml Huffman table has {lengths.size} symbols, expected {alphabet}")
            out = huffman_code.decode(r.take(r.u32()), lengths, count)
        else:
            width = bitpack.width_for(alphabet - 1)
            out = bitpack.unpack(r.take(bitpack.packed_size(count, width)), width, count).astype(np.int64)
        if count and out.max() >= alphabet:
            raise ContainerError(f"sketchml bucket stream holds a symbol beyond {alphabet - 1}")
        return out

    # ------------------------------------------------------------------ encode
    def encode(self, values, ctx):
        values = np.ascontiguousarray(values, dtype=np.float32)
        n = values.size
        flags = (FLAG_SEPARATE if self.separate_signs else 0) | (FLAG_SKETCH if self.sketch else 0)
        params = struct.pack("<BBHI", flags, self.rows, self.groups, self.hash_seed)
        out = []
        received = np.zeros(n, dtype=np.float32)
        if self.separate_signs:
            negative = np.signbit(values) & (values != 0)
            out.append(bitpack.pack(negative.astype(np.uint8), 1))
            parts = [(np.flatnonzero(~negative), 1.0), (np.flatnonzero(negative), -1.0)]
            data = np.abs(values)
        else:
            parts, data = [(np.arange(n), 1.0)], values
        for keys, sign in parts:
            if keys.size:
                section, bucket_values = self._encode_part(data[keys], keys)
                out.append(section)
                received[keys] = sign * bucket_values
        return ValueEncoding(params, b"".join(out), reconstructed=received)

    def _encode_part(self, x: np.ndarray, keys: np.ndarray):
        """(bytes of one part, the bucket value the receiver decodes for each of its values)."""
        index, means = quantile_buckets(x, self.buckets)
        q = means.size
        out = [struct.pack("<H", q), means.astype("<f4").tobytes()]
        if not self.sketch:
            out.append(self._put_stream(index, q))
            return b"".join(out), means[index]
        gsize = -(-q // self.groups)
        ngroups = -(-q // gsize)
        group = index // gsize
        if ngroups > 1:
            out.append(bitpack.pack(group, bitpack.width_for(ngroups - 1)))
        decoded = np.zeros(keys.size, dtype=np.int64)
        for g in range(ngroups):
            members = np.flatnonzero(group == g)
            if members.size == 0:
                continue
            t = max(1, math.ceil(self.col_ratio * members.size))
            cells = minmax_insert(keys[members], index[members] - g * gsize, self.rows, t, self.hash_seed, gsize)
            out.append(struct.pack("<I", t))
            out.append(self._put_stream(cells.ravel(), gsize))
            decoded[members] = g * gsize + minmax_query(cells, keys[members], self.hash_seed)
        return b"".join(out), means[decoded]

    # ------------------------------------------------------------------ decode
    @staticmethod
    def _params(params: bytes):
        if len(params) != 8:
            raise ContainerError(f"sketchml parameters have {len(params)} bytes, expected 8")
        flags, rows, groups, seed = struct.unpack("<BBHI", params)
        if flags & ~(FLAG_SEPARATE | FLAG_SKETCH) or rows < 1 or groups < 1:
            raise ContainerError(f"sketchml parameters invalid: flags {flags:#x}, rows {rows}, groups {groups}")
        return bool(flags & FLAG_SEPARATE), bool(flags & FLAG_SKETCH), rows, groups, seed

    def decode(self, params, payload, count):
        separate, sketch, rows, groups, seed = self._params(params)
        # at least: the sign bits, one part's bucket count and value, one bit per value without sketch
        least = (bitpack.packed_size(count, 1) if separate else 0) + (0 if sketch else bitpack.packed_size(count, 1))
        if count and len(payload) < least + 6:
            raise ContainerError(f"sketchml value section of {len(payload)} bytes cannot hold {count} values")
        r = _Reader(bytes(payload))
        if separate:
            negative = bitpack.unpack(r.take(bitpack.packed_size(count, 1)), 1, count).astype(bool)
            parts = [(np.flatnonzero(~negative), 1.0), (np.flatnonzero(negative), -1.0)]
        else:
            parts = [(np.arange(count), 1.0)]
        out = np.zeros(count, dtype=np.float32)
        for keys, sign in parts:
            if keys.size:
                out[keys] = sign * self._decode_part(r, keys, sketch, rows, groups, seed)
        if r.pos != len(r.buf):
            raise ContainerError(f"sketchml value section has {len(r.buf) - r.pos} trailing bytes")
        return out

    def _decode_part(self, r: _Reader, keys: np.ndarray, sketch: bool, rows: int, groups: int, seed: int):
        q = r.u16()
        if not 1 <= q <= keys.size:
            raise ContainerError(f"sketchml part of {keys.size} values claims {q} buckets")
        means = np.frombuffer(r.take(4 * q), dtype="<f4").astype(np.float32)
        if not np.isfinite(means).all():
            raise ContainerError("sketchml bucket table holds a non-finite value")
        if not sketch:
            return means[self._get_stream(r, keys.size, q)]
        gsize = -(-q // groups)
        ngroups = -(-q // gsize)
        if ngroups > 1:
            width = bitpack.width_for(ngroups - 1)
            group = bitpack.unpack(r.take(bitpack.packed_size(keys.size, width)), width, keys.size).astype(np.int64)
            if group.max() >= ngroups:
                raise ContainerError("sketchml group id out of range")
        else:
            group = np.zeros(keys.size, dtype=np.int64)
        index = np.zeros(keys.size, dtype=np.int64)
        for g in range(ngroups):
            members = np.flatnonzero(group == g)
            if members.size == 0:
                continue
            t = r.u32()
            if not 1 <= t or rows * (t - 1) > MAX_CELLS_PER_VALUE * members.size:   # t <= ceil(col_ratio keys)
                raise ContainerError(f"sketchml sketch of {rows} x {t} cells is implausible for {members.size} keys "
                                     f"(an encoder writes at most {MAX_CELLS_PER_VALUE} cells per key)")
            cells = self._get_stream(r, rows * t, gsize).reshape(rows, t)
            index[members] = g * gsize + minmax_query(cells, keys[members], seed)
        if index.max() >= q:
            raise ContainerError("sketchml decoded bucket index out of range")
        return means[index]

    @classmethod
    def describe_params(cls, params):
        separate, sketch, rows, groups, seed = cls._params(params)
        return {"separate_signs": separate, "sketch": sketch, "rows": rows, "groups": groups, "hash_seed": seed}


@register
class SketchMLHuffman(SketchML):
    """SketchML with canonical-Huffman-coded bucket indices: SKCompress's value codec."""

    id = "sketchml_huffman"
    wire_id = 7
    huffman = True
