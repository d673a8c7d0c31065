"""Container format v2 (written) and v1 (still read): the one wire format every binding uses.

Layout of v2 (integers little-endian; the byte tables of both versions live in
docs/container-format.md)::

    offset  size       field
    0       4          magic b"DPRD"
    4       1          format version (2)
    5       1          flags: bit0 DENSE, bit1 PERMUTED, bit2 NONFINITE (others must be 0)
    6       1          index codec wire id
    7       1          value codec wire id
    8       1          ndim (0..32)
    9       1          permutation entry width in bits (0 when not PERMUTED)
    10      8          config digest of the sender's wire config (all zero: unknown)
    18      varints    n, Pi, Pv, Li, Lv, Lp, then the ndim dimensions of the shape
    ..      Pi, Pv     index codec parameters, value codec parameters
    ..      Li, Lv, Lp index section, value section, permutation section
    end-4   4          CRC-32 (zlib) of every byte before it

Varints are unsigned LEB128 (:mod:`deepreduce.wire.varint`), so the header shrinks with the numbers it
carries: 18 bytes, one or a few per count and dimension, against v1's 48 + 8 per dimension.
v1 (fixed u16/u64 fields, no digest) is still read, so containers written before v2 decode.

A DENSE container carries the whole tensor as float32 in the value section (small tensors,
and tensors with NaN/Inf when the pipeline propagates them).

Bounds (docs/reliability.md): the CRC only catches line noise, so :func:`unpack` also bounds what
a CRC-valid header may claim before any decoder allocates for it: the receiver's expected shape
when it passes one, else at most ``max_numel`` elements (:data:`MAX_NUMEL` by default).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

from ..backend import _native, arrays
from ..errors import CommunicationError, ContainerError
from . import varint

MAGIC = b"DPRD"
VERSION = 2
READ_VERSIONS = (1, 2)
FLAG_DENSE = 0x01
FLAG_PERMUTED = 0x02
FLAG_NONFINITE = 0x04
_KNOWN_FLAGS = FLAG_DENSE | FLAG_PERMUTED | FLAG_NONFINITE
MAX_NDIM = 32
MAX_PARAMS = 0xFFFF
DIGEST_SIZE = 8
CRC_SIZE = 4
#: Default bound on the element count a container may claim when the receiver passes no expected
#: shape (2**28 elements: 1 GiB of float32); ``Pipeline(max_numel=...)`` / the ``max_numel`` config
#: key change it.
MAX_NUMEL = 1 << 28
#: The most elements any tensor may have, and the highest ``max_numel``: 2**60 float32 are 4 EiB,
#: and NumPy, torch and TensorFlow refuse (or abort on) shapes whose byte size or strides reach 2**63.
#: It also bounds the product of the non-zero dimensions of a 0-element tensor.
MAX_TENSOR_NUMEL = 1 << 60

_V1 = struct.Struct("<4sBBBBBBHHHQQQQ")   # 48 bytes, then 8 per dimension
_V2 = struct.Struct("<4sBBBBBB8s")        # 18 bytes, then varints
_LENGTH_FIELDS = ("index params length", "value params length", "index section length",
                  "value section length", "permutation section length")


def overhead(shape, n: int, index_bytes: int = 0, value_bytes: int = 0, perm_bytes: int = 0,
             index_params: int = 0, value_params: int = 0) -> int:
    """Bytes a v2 container spends outside its three sections (header, params, CRC)."""
    numbers = (n, index_params, value_params, index_bytes, value_bytes, perm_bytes, *shape)
    return _V2.size + sum(varint.size(v) for v in numbers) + index_params + value_params + CRC_SIZE


@dataclass
class Container:
    """The parsed fields of one container (sections as bytes; the index and value sections as
    slices of the payload when :func:`unpack` is given ``sections_like`` on its device).

    ``digest``: the first 8 bytes of the sender's config digest (``Pipeline`` sets it; it names the
    config a container came from in ``deepreduce inspect`` and errors; ranks with different configs
    are caught before the first collective by ``deepreduce.collective.agreement``, which compares the
    same digest); None in a v1 container.
    ``version``: the format version it was read from (``pack`` always writes the current one).
    """

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
    digest: Optional[bytes] = None
    version: int = field(default=VERSION, compare=False)
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


def pack(c: Container, like=None):
    """Serialise a container (format v2) to a 1-D uint8 array.

    With the C++ extension ``deepreduce._container`` built (csrc/container, the code the
    TensorFlow ops pack with) it writes the bytes; otherwise the Python below does, identically.

    Sections are ``bytes`` or 1-D uint8 arrays; when one is a torch tensor (the torch device
    path) the container is assembled on that tensor's device: the header is built on the host
    from the section lengths, the CRC on the host over the compact payload, and the result is a
    uint8 tensor on the device. ``like``: a torch tensor whose device receives the container even
    when every section is ``bytes`` (codecs that ran on the host).
    """
    if len(c.shape) > MAX_NDIM:
        raise ContainerError(f"tensor has {len(c.shape)} dimensions; at most {MAX_NDIM} are supported")
    for name, params in (("index", c.index_params), ("value", c.value_params)):
        if len(params) > MAX_PARAMS:
            raise ContainerError(f"{name} codec parameters take {len(params)} bytes; at most {MAX_PARAMS}")
    digest = bytes(DIGEST_SIZE) if c.digest is None else bytes(c.digest)
    if len(digest) != DIGEST_SIZE:
        raise ContainerError(f"config digest has {len(digest)} bytes; a container carries {DIGEST_SIZE}")
    sections = (c.index_section, c.value_section, c.perm_section)
    device = like if arrays.is_torch(like) else None
    if device is None:
        for s in sections:
            if type(s) is not bytes and arrays.is_torch(s):
                device = s
                break
    native = None if device is not None else _native.load("container")
    if native is not None:   # the C++ packer the TensorFlow ops use (same bytes)
        return native.pack(c.flags, c.index_id, c.value_id, c.perm_width, digest, c.n, tuple(c.shape),
                           c.index_params, c.value_params, c.index_section, c.value_section, c.perm_section)
    numbers = (c.n, len(c.index_params), len(c.value_params), len(c.index_section), len(c.value_section),
               len(c.perm_section), *c.shape)
    head = b"".join((
        _V2.pack(MAGIC, VERSION, c.flags, c.index_id, c.value_id, len(c.shape), c.perm_width, digest),
        b"".join(varint.encode(v) for v in numbers),
        c.index_params, c.value_params,
    ))
    if device is not None:
        return _pack_on_device(head, sections, device)
    body = head + b"".join(sections)
    crc = struct.pack("<I", zlib.crc32(body))
    return np.frombuffer(body + crc, dtype=np.uint8).copy()


def _pack_on_device(head: bytes, sections, like):
    """The container as a uint8 tensor on ``like``'s device (see :func:`pack`)."""
    a = arrays.adapter(like)
    body = arrays.join_sections([head, *sections], like)
    crc = zlib.crc32(a.to_numpy(body))   # only the compact container crosses to the host
    return a.concat_bytes([body, a.from_numpy(np.frombuffer(struct.pack("<I", crc), dtype=np.uint8), like)])


def _as_bytes(payload) -> bytes:
    if type(payload) is np.ndarray and payload.dtype == np.uint8 and payload.ndim == 1:   # every host receive
        return payload.tobytes()
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    arr = arrays.adapter(payload).to_numpy(payload)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ContainerError(f"a container is a 1-D uint8 array, got dtype {arr.dtype} and shape {arr.shape}")
    return arr.tobytes()


def _in_place(payload):
    """A host payload (a 1-D contiguous uint8 array: every host receive and its :func:`split`
    segments, or a CPU uint8 tensor as the torch bindings hold it) as a memoryview of itself, so
    that :func:`unpack` reads the header and checksum where the bytes lie and copies each section
    once; any other payload (a device tensor: one copy to the host) as bytes."""
    if arrays.is_torch(payload) and payload.is_cpu and payload.dtype == arrays.namespace(payload).uint8 \
            and payload.ndim == 1 and payload.is_contiguous():
        payload = payload.numpy()
    if type(payload) is np.ndarray and payload.dtype == np.uint8 and payload.ndim == 1 \
            and payload.flags.c_contiguous:
        return memoryview(payload)
    return _as_bytes(payload)


class _Header(NamedTuple):
    version: int
    flags: int
    index_id: int
    value_id: int
    perm_width: int
    digest: Optional[bytes]
    reserved: int
    n: int
    lengths: Tuple[int, int, int, int, int]   # Pi, Pv, Li, Lv, Lp
    shape: Tuple[int, ...]
    size: int                                 # header bytes before the index params

    @property
    def total(self) -> int:
        return self.size + sum(self.lengths) + CRC_SIZE


def _read_header(buf: bytes, offset: int) -> _Header:
    """The header of the container starting at ``offset`` (either version)."""
    if len(buf) - offset < 5 + CRC_SIZE:
        raise ContainerError(f"truncated container at byte {offset}: {len(buf) - offset} bytes")
    magic, version = bytes(buf[offset:offset + 4]), buf[offset + 4]
    if magic != MAGIC:
        raise ContainerError(f"not a deepreduce container at byte {offset}: magic {magic!r}, expected {MAGIC!r}")
    if version not in READ_VERSIONS:
        raise ContainerError(f"container format version {version} is not supported "
                             f"(this build reads versions {' and '.join(map(str, READ_VERSIONS))})")
    fixed = _V1 if version == 1 else _V2
    if len(buf) - offset < fixed.size + CRC_SIZE:
        raise ContainerError(
            f"truncated container at byte {offset}: {len(buf) - offset} bytes, "
            f"the version {version} header alone needs {fixed.size + CRC_SIZE}"
        )
    if version == 1:
        (_, _, flags, iid, vid, ndim, width, pi, pv, reserved, n, li, lv, lp) = _V1.unpack_from(buf, offset)
        digest, lengths, pos = None, (pi, pv, li, lv, lp), offset + _V1.size
        if ndim > MAX_NDIM:
            raise ContainerError(f"container claims {ndim} dimensions; at most {MAX_NDIM}")
        if len(buf) - pos < 8 * ndim:
            raise ContainerError(f"truncated container at byte {offset}: the shape runs past the end")
        shape = struct.unpack_from(f"<{ndim}Q", buf, pos)
        pos += 8 * ndim
    else:
        (_, _, flags, iid, vid, ndim, width, digest) = _V2.unpack_from(buf, offset)
        if ndim > MAX_NDIM:
            raise ContainerError(f"container claims {ndim} dimensions; at most {MAX_NDIM}")
        pos, reserved = offset + _V2.size, 0
        n, pos = varint.decode(buf, pos, "n")
        numbers = []
        for name in _LENGTH_FIELDS:
            value, pos = varint.decode(buf, pos, name)
            numbers.append(value)
        lengths = tuple(numbers)
        dims = []
        for axis in range(ndim):
            value, pos = varint.decode(buf, pos, f"shape[{axis}]")
            dims.append(value)
        shape = tuple(dims)
        for name, length in zip(_LENGTH_FIELDS[:2], lengths[:2]):
            if length > MAX_PARAMS:
                raise ContainerError(f"container {name} is {length}; at most {MAX_PARAMS}")
    return _Header(version, flags, iid, vid, width, digest, reserved, n, lengths,
                   tuple(int(s) for s in shape), pos - offset)


def _native_header(native, buf: bytes, expected_shape=None, max_numel: int = MAX_NUMEL) -> _Header:
    """:func:`_checked_header` by the C++ twin (csrc/container: same checks in the same order, same
    messages): one call instead of a Python loop over varints, paid by every tensor of every
    step. The twin raises CommunicationError itself for a header of another shape than the
    expected one; an expected shape it cannot take (not integers in ``[0, 2**64)``) is left to
    :func:`check_size`."""
    expected = _native_shape(expected_shape)
    try:
        version, flags, iid, vid, width, digest, n, lengths, shape = native.unpack_header(
            buf, expected, min(int(max_numel), MAX_TENSOR_NUMEL))
    except ValueError as exc:
        raise ContainerError(str(exc)) from None
    if expected is None:   # the receiver's bounds, reported as by Python
        check_size(shape, n, expected_shape, max_numel)
    size = len(buf) - sum(lengths) - CRC_SIZE
    return _Header(version, flags, iid, vid, width, digest, 0, n, lengths, shape, size)


def _native_shape(expected_shape) -> Optional[Tuple[int, ...]]:
    """The receiver's expected shape as the C++ twin takes it (a tuple of integers in
    ``[0, 2**64)``), or None: no shape, or one no header can have (check_size names it)."""
    if expected_shape is None:
        return None
    try:
        expected = tuple(map(int, expected_shape))
    except (TypeError, ValueError):
        return None
    if expected and not 0 <= min(expected) <= max(expected) < 1 << 64:
        return None
    return expected


def check_size(shape: Tuple[int, ...], n: int, expected_shape=None, max_numel: int = MAX_NUMEL) -> None:
    """Refuse a header whose tensor is not the one the receiver expects, or (without an expected
    shape) claims more than ``max_numel`` elements (capped at :data:`MAX_TENSOR_NUMEL`; for a
    0-element tensor: non-zero dimensions multiplying to more), before anything is allocated for it."""
    max_numel = min(max_numel, MAX_TENSOR_NUMEL)
    numel = extent = 1   # extent: the product of the non-zero dimensions (numel unless one is 0)
    for s in shape:
        numel *= s
        extent *= s or 1
    if expected_shape is not None:
        try:
            expected = tuple(int(s) for s in expected_shape)
        except (TypeError, ValueError) as exc:
            raise CommunicationError(f"expected_shape must be a sequence of integers, got {expected_shape!r}") from exc
        if expected != shape:
            raise CommunicationError(
                f"container holds a tensor of shape {shape}, expected {expected}: "
                "ranks disagree about this tensor"
            )
    elif numel > max_numel:
        raise ContainerError(
            f"container claims a tensor of shape {shape} ({numel} elements), above max_numel = {max_numel}; "
            "pass the expected shape or raise max_numel"
        )
    elif extent > max_numel:
        raise ContainerError(
            f"container claims a 0-element tensor of shape {shape} whose non-zero dimensions multiply to "
            f"{extent}, above max_numel = {max_numel}; no framework holds such a shape"
        )
    if n > numel:
        raise ContainerError(f"container claims {n} values for a tensor of {numel} elements")


def unpack(payload, expected_shape=None, max_numel: int = MAX_NUMEL, sections_like=None) -> Container:
    """Parse and check one container (v1 or v2); raise ContainerError on any inconsistency.

    ``expected_shape``: the shape the receiver expects (CommunicationError if the header names
    another); without one, a header claiming more than ``max_numel`` elements is refused.
    ``sections_like`` (a torch tensor): when the payload is a tensor on that tensor's device
    (a collective's result on the device path), the header and checksum are read on one host
    copy and the index and value sections are returned as slices of the payload there, so a
    decode on the device never uploads them again.
    """
    buf = _in_place(payload)
    native = _native.load("container")
    if native is None:
        h = _checked_header(buf, expected_shape, max_numel)
    else:   # the twin checks the receiver's bounds where the Python path does
        h = _native_header(native, buf, expected_shape, max_numel)
    pi, pv, li, lv, lp = h.lengths
    a = h.size
    b = a + pi
    c = b + pv
    d = c + li
    e = d + lv
    on_device = sections_like is not None and arrays.is_torch(payload) and not payload.is_cpu \
        and payload.device == sections_like.device
    sections = payload if on_device else buf
    return Container(h.shape, h.n, h.index_id, h.value_id, h.flags, h.perm_width, bytes(buf[a:b]), bytes(buf[b:c]),
                     _section(sections, c, d), _section(sections, d, e), bytes(buf[e:e + lp]), h.digest, h.version,
                     len(buf))


def _section(buf, start: int, end: int):
    """Bytes ``start:end`` of a host buffer as ``bytes``, of a device tensor as a slice of it."""
    return buf[start:end] if arrays.is_torch(buf) else bytes(buf[start:end])


def _checked_header(buf: bytes, expected_shape, max_numel: int) -> _Header:
    """The header of the one container ``buf`` holds, after every check of :func:`unpack`, in the
    order the C++ twin makes them (so both name the same first problem)."""
    h = _read_header(buf, 0)
    if h.total != len(buf):
        raise ContainerError(f"container length mismatch: header describes {h.total} bytes, buffer has {len(buf)}")
    (crc,) = struct.unpack_from("<I", buf, len(buf) - CRC_SIZE)
    if zlib.crc32(memoryview(buf)[:-CRC_SIZE]) != crc:
        raise ContainerError("container checksum mismatch: the buffer is corrupted")
    if h.flags & ~_KNOWN_FLAGS or h.reserved:
        raise ContainerError(f"container has unknown flags 0x{h.flags:02x} or non-zero reserved bits")
    check_size(h.shape, h.n, expected_shape, max_numel)
    permuted, dense = bool(h.flags & FLAG_PERMUTED), bool(h.flags & FLAG_DENSE)
    li, lv, lp = h.lengths[2:]
    if permuted != (h.perm_width > 0) or (not permuted and lp):
        raise ContainerError("container permutation flag, width and section disagree")
    numel = 1
    for s in h.shape:
        numel *= s
    if dense and (h.n != numel or lv != 4 * numel or li or lp):
        raise ContainerError("dense container sections do not match its shape")
    return h


def split(buffer) -> List[np.ndarray]:
    """Split the concatenation of several containers (an allgather result, any mix of v1 and v2).

    A host uint8 array is split into segments of itself (no copy; only the headers are read). A
    torch tensor on an accelerator (a collective's result on the device path) is split into
    slices of itself on its device; the headers are read on a host copy of the compact bytes.
    """
    if arrays.is_torch(buffer) and buffer.device.type != "cpu":
        parts = split(buffer.cpu().numpy())
        offsets = np.cumsum([0] + [p.size for p in parts])
        return [buffer[int(o):int(o) + p.size] for o, p in zip(offsets, parts)]
    if type(buffer) is np.ndarray and buffer.dtype == np.uint8 and buffer.ndim == 1:
        whole = np.ascontiguousarray(buffer)   # a host receive: segments of it, no copy
    else:
        whole = np.frombuffer(_as_bytes(buffer), dtype=np.uint8)
    buf = memoryview(whole)   # headers are read in place
    out, offset = [], 0
    while offset < len(buf):
        length = _read_header(buf, offset).total
        if offset + length > len(buf):
            raise ContainerError(
                f"truncated container at byte {offset}: needs {length} bytes, {len(buf) - offset} remain"
            )
        out.append(whole[offset:offset + length])
        offset += length
    return out


def inspect(payload, expected_shape=None, max_numel: int = MAX_NUMEL) -> dict:
    """The header of a container as a dict, with codec ids resolved to names (bounds as
    :func:`unpack`)."""
    from .. import registry

    c = unpack(payload, expected_shape, max_numel)
    info = {
        "format_version": c.version,
        "config_digest": None if c.digest is None else c.digest.hex(),
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
