"""Fixed-width bit packing, LSB first, shared by every codec that packs integers.

Entry ``i`` occupies stream bits ``[i*w, (i+1)*w)``; bit ``j`` of the entry is stream bit
``i*w + j``; stream bit ``p`` is bit ``p % 8`` of byte ``p // 8``. The final byte is zero padded.

On the host (NumPy input, ``bytes`` sections) the C++ kernel of ``deepreduce._container``
(csrc/container/bitpack.cpp, a 64-bit word at a time; the TF ops use it too) does the work when
it is built. Otherwise, and for torch tensors, widths up to ``FAST_WIDTH`` are written against
the array namespace (``deepreduce.backend.arrays``): torch integer tensors pack to a uint8 tensor on
their device, and a uint8 tensor section unpacks to int64 on its device, with the same bytes.
Wider entries (never needed for indices of real tensors) are packed on the host.
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import _native, arrays
from ..errors import ContainerError


def width_for(max_value: int) -> int:
    """Bits needed for integers in ``[0, max_value]`` (at least 1)."""
    return max(1, int(max_value).bit_length())


def packed_size(count: int, width: int) -> int:
    """Bytes that ``count`` entries of ``width`` bits occupy."""
    return (count * width + 7) // 8


FAST_WIDTH = 56  # widths up to this take the byte-window paths (every shift stays below 64)


def pack(values, width: int):
    """Pack non-negative integers below ``2**width`` into bytes (a uint8 tensor for torch input)."""
    a = arrays.adapter(values)
    if a.name != "numpy" and width <= FAST_WIDTH:
        values = a.words(values).reshape(-1)
    else:
        values = np.asarray(a.to_numpy(values), dtype=np.uint64).ravel()
    if not 1 <= width <= 64:
        raise ValueError(f"bit width must be in [1, 64], got {width}")
    count = values.shape[0]
    if count and width < 64 and int(values.max()) >> width:
        raise ValueError(f"value {int(values.max())} does not fit in {width} bits")
    if count == 0:
        return b""
    native = _native.load("container") if a.name == "numpy" else None
    if native is not None:
        return native.bit_pack(np.ascontiguousarray(values, dtype=np.uint64), width)
    if width <= FAST_WIDTH:
        return _pack_bytes(values, width)
    shifts = np.arange(width, dtype=np.uint64)
    bits = ((values[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.ravel(), bitorder="little").tobytes()


def _shifted(x, amount: int):
    """Words ``x`` shifted left by ``amount`` bits (logically right by ``-amount`` when negative)."""
    a = arrays.adapter(x)
    return a.shl(x, amount) if amount >= 0 else a.shr(x, -amount)


def _words(a, xp, count: int, like):
    return xp.zeros(count, dtype=a.word_dtype, device=like.device)


def _pack_bytes(values, width: int):
    """Byte ``b`` ORs the at most ``ceil(8 / width) + 1`` entries overlapping it. Bytes ``b`` and
    ``b + width / gcd(width, 8)`` see the same bit offsets, so each such class of bytes is built
    from strided slices with constant shifts (no per-element shift amounts)."""
    a, xp = arrays.adapter(values), arrays.namespace(values)
    size = values.shape[0]
    nbytes = packed_size(size, width)
    g = math.gcd(width, 8)
    byte_period, entry_period = width // g, 8 // g
    terms = (8 + width - 1) // width + 1
    padded = _words(a, xp, size + terms + entry_period + 1, values)
    padded[:size] = values
    out = _words(a, xp, nbytes, values)
    for r in range(min(byte_period, nbytes)):
        count = len(range(r, nbytes, byte_period))
        first = 8 * r // width
        acc = _words(a, xp, count, values)
        for t in range(terms):
            shift = (first + t) * width - 8 * r
            if shift >= 8:
                break
            acc |= _shifted(padded[first + t:first + t + count * entry_period:entry_period], shift)
        out[r::byte_period] = acc & a.const(0xFF)
    return a.uint_bytes(out, 1)


def _unpack_bytes(data, width: int, count: int):
    """Entry ``i`` ORs the at most ``ceil(width / 8) + 1`` bytes it overlaps; entries ``i`` and
    ``i + 8 / gcd(width, 8)`` start at the same bit offset, so each class is read with strided
    slices and constant shifts."""
    g = math.gcd(width, 8)
    byte_period, entry_period = width // g, 8 // g
    terms = (width + 7) // 8 + 1
    raw = arrays.adapter(data).from_section(data, "<u1")
    a, xp = arrays.adapter(raw), arrays.namespace(raw)
    padded = _words(a, xp, len(data) + terms + byte_period + 1, raw)
    padded[:len(data)] = a.words(raw)
    out = _words(a, xp, count, raw)
    mask = a.const((1 << width) - 1)
    for r in range(min(entry_period, count)):
        n = len(range(r, count, entry_period))
        first, offset = (r * width) >> 3, (r * width) & 7
        acc = _words(a, xp, n, raw)
        for t in range(terms):
            acc |= _shifted(padded[first + t:first + t + n * byte_period:byte_period], 8 * t - offset)
        out[r::entry_period] = acc & mask
    return out


def unpack(data, width: int, count: int):
    """Inverse of :func:`pack`; raises ContainerError if ``data`` has the wrong length.

    ``bytes`` give uint64 NumPy; a uint8 tensor gives int64 on its device (widths up to
    ``FAST_WIDTH``; wider ones are unpacked on the host and moved there)."""
    if not 1 <= width <= 64:
        raise ContainerError(f"bit width must be in [1, 64], got {width}")
    if len(data) != packed_size(count, width):
        raise ContainerError(
            f"packed section has {len(data)} bytes, expected {packed_size(count, width)} "
            f"for {count} entries of {width} bits"
        )
    a = arrays.adapter(data)
    if count == 0:
        return np.zeros(0, dtype=np.uint64) if a.name == "numpy" else a.from_numpy(np.zeros(0, np.int64), data)
    native = _native.load("container") if a.name == "numpy" else None
    if native is not None:   # the checks above passed: it cannot refuse
        return native.bit_unpack(data, width, count)
    if width <= FAST_WIDTH:
        return _unpack_bytes(data, width, count)
    if a.name != "numpy":
        return a.from_numpy(unpack(bytes(a.to_numpy(data)), width, count).view(np.int64), data)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little", count=count * width)
    bits = bits.reshape(count, width).astype(np.uint64)
    return (bits << np.arange(width, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)
