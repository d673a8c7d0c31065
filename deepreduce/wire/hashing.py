"""SplitMix64 mixing on 64-bit words, and the counter-based uniform generator built on it.

Written against the array namespace (``deepreduce.backend.arrays``): the same functions run on NumPy
uint64 arrays, on torch int64 "word" tensors on any device, and (``mix64_int``) on Python ints,
bit for bit like the C++ kernels. The Bloom filter hashes with them (``deepreduce.index.bloom``),
and QSGD draws its rounding noise from :func:`counter_uniform`, so NumPy and torch compute the
same noise without any framework RNG.
"""
from __future__ import annotations

from ..backend import arrays

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
UNIFORM_BITS = 24   # float32's significand: every draw is exact in float32 and float64


def mix64_int(z: int) -> int:
    """SplitMix64's finaliser on a Python int (mod 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def mix64(z):
    """SplitMix64's finaliser, element-wise on 64-bit words (wrapping arithmetic, like C++)."""
    a = arrays.adapter(z)
    z = (z ^ a.shr(z, 30)) * a.const(_M1)
    z = (z ^ a.shr(z, 27)) * a.const(_M2)
    return z ^ a.shr(z, 31)


def counter_uniform(seed: int, n: int, like):
    """``n`` uniform float64 draws in [0, 1) from a counter: draw ``i`` is the top 24 bits of
    ``mix64(seed + (i+1) * GAMMA)`` times 2**-24 (SplitMix64's stream for ``seed``).

    The draws depend only on ``(seed, i)``: NumPy, torch on any device and C++ give the same
    numbers. ``like``: an array whose framework and device receive the result.
    """
    a, xp = arrays.adapter(like), arrays.namespace(like)
    counter = a.words(xp.arange(1, n + 1, device=like.device))
    top = a.shr(mix64(counter * a.const(GAMMA) + a.const(seed)), 64 - UNIFORM_BITS)
    return xp.astype(top, xp.float64) * (2.0 ** -UNIFORM_BITS)
