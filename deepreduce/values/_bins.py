"""What the b-bit bin codecs (``uniform``, ``binmean``) share: the ``u8 bits`` parameter and the
packed codes."""
from __future__ import annotations

import numpy as np

from ..errors import ContainerError
from ..params import Param
from ..wire import bitpack

BITS = Param(int, default=2, low=1, high=8, doc="bits b per value (2**b bins)")


def read_bits(codec: str, params: bytes) -> int:
    """The ``u8 bits`` parameter, checked."""
    if len(params) != 1 or not 1 <= params[0] <= 8:
        raise ContainerError(f"{codec} parameters must be one byte of bits in [1, 8], got {bytes(params).hex()!r}")
    return params[0]


def pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """``n`` codes below ``2**bits`` packed LSB first (``ceil(n b / 8)`` bytes)."""
    return bytes(bitpack.pack(codes.astype(np.uint64), bits)) if codes.shape[0] else b""


def unpack_codes(codec: str, section: bytes, bits: int, count: int) -> np.ndarray:
    """The int64 codes of a section holding exactly ``count`` of them (zero padding checked)."""
    if len(section) != bitpack.packed_size(count, bits):
        raise ContainerError(f"{codec} code section has {len(section)} bytes, expected "
                             f"{bitpack.packed_size(count, bits)} for {count} values of {bits} bits")
    if (count * bits) % 8 and section and section[-1] >> ((count * bits) % 8):
        raise ContainerError(f"{codec} value section has non-zero padding")
    return np.asarray(bitpack.unpack(section, bits, count)).astype(np.int64)
