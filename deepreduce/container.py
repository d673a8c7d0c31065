"""Container format v1: the one wire format every binding writes and reads.

Layout (all integers little-endian; the byte table lives in docs/container-format.md)::

    offset  size       field
    0       4          magic b"DPRD"
    4       1          format version (1)
    5       1          flags: bit0 DENSE, bit1 PERMUTED, bit2 NONFINITE (others must be 0)
    6       1          index codec wire id
    7       1          value codec wire id
    8       1          ndim (0..32)
    9       1          permutation entry width in bits (0 when not PERMUTED)
    10      2          index codec parameter length  Pi
    12      2          value codec parameter length  Pv
    14      2          reserved (0)
    16      8          n, the number of transmitted values
    24      8          index section length  Li
    32      8          value section length  Lv
    40      8          permutation section length  Lp
    48      8*ndim     shape
    ..      Pi, Pv     index codec parameters, value codec parameters
    ..      Li, Lv, Lp index section, value section, permutation section
    end-4   4          CRC-32 (zlib) of every byte before it

A DENSE container carries the whole tensor as float32 in the value section (small tensors,
and tensors with NaN/Inf when the pipeline propagates them).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np

from .errors import ContainerError

MAGIC = b"DPRD"
VERSION = 1
FLAG_DENSE = 0x01
FLAG_PERMUTED = 0x02
FLAG_NONFINITE = 0x04
_KNOWN_FLAGS = FLAG_DENSE | FLAG_PERMUTED | FLAG_NONFINITE
MAX_NDIM = 32

_FIXED = struct.Struct("<4sBBBBBBHHHQQQQ")
FIXED_SIZE = _FIXED.size  # 48
CRC_SIZE = 4


def overhead(ndim: int, index_params: int = 0, value_params: int = 0) -> int:
    """Bytes a container spends outside its three sections."""
    return FIXED_SIZE + 8 * ndim + index_params + value_params + CRC_SIZE


@dataclass
class Container:
    """The parsed fields of one container (sections as bytes)."""

    shape: Tuple[int, ...]
    n: int
    index_id: int
    value_id: int
    flags: int = 0
    perm_width: int = 0
    index_params: bytes = b""
    value_params: bytes = b""
    index_section: bytes = b""
    value_section: bytes = b""
    perm_section: bytes = b""
    nbytes: int = field(default=0, compare=False)

    @property
    def numel(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out

    @property
    def dense(self) -> bool:
        return bool(self.flags & FLAG_DENSE)

    @property
    def permuted(self) -> bool:
        return bool(self.flags & FLAG_PERMUTED)

    @property
    def nonfinite(self) -> bool:
        return bool(self.flags & FLAG_NONFINITE)


def pack(c: Container) -> np.ndarray:
    """Serialise a container to a 1-D uint8 array."""
    if len(c.shape) > MAX_NDIM:
        raise ContainerError(f"tensor has {len(c.shape)} dimensions; at most {MAX_NDIM} are supported")
    for name, params in (("index", c.index_params), ("value", c.value_params)):
        if len(params) > 0xFFFF:
            raise ContainerError(f"{name} codec parameters take {len(params)} bytes; at most 65535")
    head = _FIXED.pack(
        MAGIC, VERSION, c.flags, c.index_id, c.value_id, len(c.shape), c.perm_width,
        len(c.index_params), len(c.value_params), 0,
        c.n, len(c.index_section), len(c.value_section), len(c.perm_section),
    )
    body = b"".join((
        head,
        struct.pack(f"<{len(c.shape)}Q", *c.shape),
        c.index_params, c.value_params, c.index_section, c.value_section, c.perm_section,
    ))
    crc = struct.pack("<I", zlib.crc32(body))
    return np.frombuffer(body + crc, dtype=np.uint8).copy()


def _as_bytes(payload) -> bytes:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    arr = np.asarray(payload)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ContainerError(f"a container is a 1-D uint8 array, got dtype {arr.dtype} and shape {arr.shape}")
    return arr.tobytes()


def _total_length(buf: bytes, offset: int) -> int:
    """Length of the container starting at ``offset``, from its fixed header alone."""
    if len(buf) - offset < FIXED_SIZE + CRC_SIZE:
        raise ContainerError(
            f"truncated container at byte {offset}: {len(buf) - offset} bytes, "
            f"the header alone needs {FIXED_SIZE + CRC_SIZE}"
        )
    (magic, version, flags, _, _, ndim, _, pi, pv, _, _, li, lv, lp) = _FIXED.unpack_from(buf, offset)
    if magic != MAGIC:
        raise ContainerError(f"not a deepreduce container at byte {offset}: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ContainerError(f"container format version {version} is not supported (this build reads {VERSION})")
    if ndim > MAX_NDIM:
        raise ContainerError(f"container claims {ndim} dimensions; at most {MAX_NDIM}")
    return FIXED_SIZE + 8 * ndim + pi + pv + li + lv + lp + CRC_SIZE


def unpack(payload) -> Container:
    """Parse and check one container; raise ContainerError on any inconsistency."""
    buf = _as_bytes(payload)
    total = _total_length(buf, 0)
    if total != len(buf):
        raise ContainerError(f"container length mismatch: header describes {total} bytes, buffer has {len(buf)}")
    body, (crc,) = buf[:-CRC_SIZE], struct.unpack_from("<I", buf, len(buf) - CRC_SIZE)
    if zlib.crc32(body) != crc:
        raise ContainerError("container checksum mismatch: the buffer is corrupted")
    (_, _, flags, index_id, value_id, ndim, perm_width, pi, pv, reserved, n, li, lv, lp) = _FIXED.unpack_from(buf)
    if flags & ~_KNOWN_FLAGS or reserved:
        raise ContainerError(f"container has unknown flags 0x{flags:02x} or non-zero reserved bits")
    pos = FIXED_SIZE
    shape = struct.unpack_from(f"<{ndim}Q", buf, pos)
    pos += 8 * ndim
    sections = []
    for length in (pi, pv, li, lv, lp):
        sections.append(buf[pos:pos + length])
        pos += length
    c = Container(
        shape=tuple(int(s) for s in shape), n=n, index_id=index_id, value_id=value_id, flags=flags,
        perm_width=perm_width, index_params=sections[0], value_params=sections[1],
        index_section=sections[2], value_section=sections[3], perm_section=sections[4], nbytes=len(buf),
    )
    if c.n > c.numel:
        raise ContainerError(f"container claims {c.n} values for a tensor of {c.numel} elements")
    if c.permuted != (perm_width > 0) or (not c.permuted and lp):
        raise ContainerError("container permutation flag, width and section disagree")
    if c.dense and (c.n != c.numel or lv != 4 * c.numel or li or lp):
        raise ContainerError("dense container sections do not match its shape")
    return c


def split(buffer) -> List[np.ndarray]:
    """Split the concatenation of several containers (an allgather result) into each one."""
    buf = _as_bytes(buffer)
    out, offset = [], 0
    while offset < len(buf):
        length = _total_length(buf, offset)
        if offset + length > len(buf):
            raise ContainerError(
                f"truncated container at byte {offset}: needs {length} bytes, {len(buf) - offset} remain"
            )
        out.append(np.frombuffer(buf, dtype=np.uint8, count=length, offset=offset))
        offset += length
    return out


def inspect(payload) -> dict:
    """The header of a container as a dict, with codec ids resolved to names."""
    from . import registry

    c = unpack(payload)
    info = {
        "format_version": VERSION,
        "nbytes": c.nbytes,
        "shape": c.shape,
        "numel": c.numel,
        "n": c.n,
        "dense": c.dense,
        "nonfinite": c.nonfinite,
        "permuted": c.permuted,
        "perm_width": c.perm_width,
        "index_bytes": len(c.index_section),
        "value_bytes": len(c.value_section),
        "perm_bytes": len(c.perm_section),
        "header_bytes": c.nbytes - len(c.index_section) - len(c.value_section) - len(c.perm_section),
    }
    if not c.dense:
        index_cls = registry.by_wire_id("index", c.index_id)
        value_cls = registry.by_wire_id("value", c.value_id)
        info["index_codec"] = index_cls.id
        info["value_codec"] = value_cls.id
        info["index_params"] = index_cls.describe_params(c.index_params)
        info["value_params"] = value_cls.describe_params(c.value_params)
    return info
