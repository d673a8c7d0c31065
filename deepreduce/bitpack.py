"""Fixed-width bit packing, LSB first, shared by every codec that packs integers.

Entry ``i`` occupies stream bits ``[i*w, (i+1)*w)``; bit ``j`` of the entry is stream bit
``i*w + j``; stream bit ``p`` is bit ``p % 8`` of byte ``p // 8``. The final byte is zero padded.
"""
from __future__ import annotations

import numpy as np

from .errors import ContainerError


def width_for(max_value: int) -> int:
    """Bits needed for integers in ``[0, max_value]`` (at least 1)."""
    return max(1, int(max_value).bit_length())


def packed_size(count: int, width: int) -> int:
    """Bytes that ``count`` entries of ``width`` bits occupy."""
    return (count * width + 7) // 8


def pack(values: np.ndarray, width: int) -> bytes:
    """Pack non-negative integers below ``2**width`` into bytes."""
    values = np.asarray(values, dtype=np.uint64).ravel()
    if not 1 <= width <= 64:
        raise ValueError(f"bit width must be in [1, 64], got {width}")
    if values.size and width < 64 and int(values.max()) >> width:
        raise ValueError(f"value {int(values.max())} does not fit in {width} bits")
    if values.size == 0:
        return b""
    shifts = np.arange(width, dtype=np.uint64)
    bits = ((values[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.ravel(), bitorder="little").tobytes()


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
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little", count=count * width)
    bits = bits.reshape(count, width).astype(np.uint64)
    return (bits << np.arange(width, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)
