"""Unsigned LEB128 varints: the integer encoding of container format v2 and of its Bloom params.

Seven bits per byte, least significant group first, the high bit set on every byte but the last.
Values up to 2**64 - 1 take at most 10 bytes; the reader accepts only the shortest encoding of a
value (no redundant trailing zero groups), so every value has exactly one byte form.
"""
from __future__ import annotations

from typing import Tuple

from ..errors import ContainerError

MAX_BYTES = 10
LIMIT = 1 << 64


def size(value: int) -> int:
    """Bytes the varint of ``value`` takes."""
    return max(1, (int(value).bit_length() + 6) // 7)


def encode(value: int) -> bytes:
    """The varint bytes of ``0 <= value < 2**64``."""
    value = int(value)
    if not 0 <= value < LIMIT:
        raise ValueError(f"varint value {value} is outside [0, 2**64)")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode(buf, pos: int, field: str) -> Tuple[int, int]:
    """``(value, next position)`` of the varint at ``buf[pos]``; ContainerError names ``field``."""
    value, shift, start = 0, 0, pos
    while True:
        if pos >= len(buf):
            raise ContainerError(f"truncated container: field {field} runs past the end at byte {pos}")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if pos - start >= MAX_BYTES:
            raise ContainerError(f"container field {field} at byte {start} is longer than {MAX_BYTES} bytes")
    if value >= LIMIT:
        raise ContainerError(f"container field {field} at byte {start} exceeds 2**64 - 1")
    if byte == 0 and pos - start > 1:
        raise ContainerError(f"container field {field} at byte {start} is not in its shortest form")
    return value, pos
