"""Fixed-width bit packing, LSB first, shared by every codec that packs integers.

Entry ``i`` occupies stream bits ``[i*w, (i+1)*w)``; bit ``j`` of the entry is stream bit
``i*w + j``; stream bit ``p`` is bit ``p % 8`` of byte ``p // 8``. The final byte is zero padded.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import ContainerError


def width_for(max_value: int) -> int:
    """Bits needed for integers in ``[0, max_value]`` (at least 1)."""
    return max(1, int(max_value).bit_length())


def packed_size(count: int, width: int) -> int:
    """Bytes that ``count`` entries of ``width`` bits occupy."""
    return (count * width + 7) // 8


FAST_WIDTH = 56  # widths up to this take the byte-window paths (every shift stays below 64)


def pack(values: np.ndarray, width: int) -> bytes:
    """Pack non-negative integers below ``2**width`` into bytes."""
    values = np.asarray(values, dtype=np.uint64).ravel()
    if not 1 <= width <= 64:
        raise ValueError(f"bit width must be in [1, 64], got {width}")
    if values.size and width < 64 and int(values.max()) >> width:
        raise ValueError(f"value {int(values.max())} does not fit in {width} bits")
    if values.size == 0:
        return b""
    if width <= FAST_WIDTH:
        return _pack_bytes(values, width)
    shifts = np.arange(width, dtype=np.uint64)
    bits = ((values[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.ravel(), bitorder="little").tobytes()


def _shifted(x: np.ndarray, amount: int) -> np.ndarray:
    """``x`` shifted left by ``amount`` bits (right by ``-amount`` when negative)."""
    return x << np.uint64(amount) if amount >= 0 else x >> np.uint64(-amount)


def _pack_bytes(values: np.ndarray, width: int) -> bytes:
    """Byte ``b`` ORs the at most ``ceil(8 / width) + 1`` entries overlapping it. Bytes ``b`` and
    ``b + width / gcd(width, 8)`` see the same bit offsets, so each such class of bytes is built
    from strided slices with constant shifts (no per-element shift amounts)."""
    nbytes = packed_size(values.size, width)
    g = math.gcd(width, 8)
    byte_period, entry_period = width // g, 8 // g
    terms = (8 + width - 1) // width + 1
    padded = np.zeros(values.size + terms + entry_period + 1, dtype=np.uint64)
    padded[:values.size] = values
    out = np.empty(nbytes, dtype=np.uint64)
    for r in range(min(byte_period, nbytes)):
        count = len(range(r, nbytes, byte_period))
        first = 8 * r // width
        acc = np.zeros(count, dtype=np.uint64)
        for t in range(terms):
            shift = (first + t) * width - 8 * r
            if shift >= 8:
                break
            acc |= _shifted(padded[first + t:first + t + count * entry_period:entry_period], shift)
        out[r::byte_period] = acc & np.uint64(0xFF)
    return out.astype(np.uint8).tobytes()


def _unpack_bytes(data: bytes, width: int, count: int) -> np.ndarray:
    """Entry ``i`` ORs the at most ``ceil(width / 8) + 1`` bytes it overlaps; entries ``i`` and
    ``i + 8 / gcd(width, 8)`` start at the same bit offset, so each class is read with strided
    slices and constant shifts."""
    g = math.gcd(width, 8)
    byte_period, entry_period = width // g, 8 // g
    terms = (width + 7) // 8 + 1
    padded = np.zeros(len(data) + terms + byte_period + 1, dtype=np.uint64)
    padded[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(count, dtype=np.uint64)
    mask = np.uint64((1 << width) - 1)
    for r in range(min(entry_period, count)):
        n = len(range(r, count, entry_period))
        first, offset = (r * width) >> 3, (r * width) & 7
        acc = np.zeros(n, dtype=np.uint64)
        for t in range(terms):
            acc |= _shifted(padded[first + t:first + t + n * byte_period:byte_period], 8 * t - offset)
        out[r::entry_period] = acc & mask
    return out


def unpack(data: bytes, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack`; raises ContainerError if ``data`` has the wrong length."""
    if not 1 <= width <= 64:
        raise ContainerError(f"bit width must be in [1, 64], got {width}")
    if len(data) != packed_size(count, width):
        raise ContainerError(
            f"packed section has {len(data)} bytes, expected {packed_size(count, width)} "
            f"for {count} entries of {width} bits"
        )
    if count == 0:
        return np.zeros(0, dtype=np.uint64)
    if width <= FAST_WIDTH:
        return _unpack_bytes(data, width, count)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little", count=count * width)
    bits = bits.reshape(count, width).astype(np.uint64)
    return (bits << np.arange(width, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)
