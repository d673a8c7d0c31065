"""Deterministic seeds derived from (config, tensor name, step).

Random choices in deepreduce (Random-r, QSGD rounding, Bloom P1/P2 draws) must be identical on
every rank and in every binding, and must never touch a framework's global RNG. Each one draws
from its own generator whose seed is a BLAKE2b digest of the pipeline's config digest, the
tensor name, the step and a purpose string, so two components never share a stream.

The derivation is one rule with one C++ definition (csrc/seeding, the one the TensorFlow ops use):
:func:`derive_seed` calls it through ``deepreduce._seeding`` when the extension is built, and
:func:`derive_seed_python` (hashlib) otherwise; tests check that both give the same seeds.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from ..backend import _native


def config_digest(config: Any) -> bytes:
    """A stable 16-byte digest of a JSON-serialisable config (key order does not matter)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def derive_seed(digest: bytes, name: str, step: int, purpose: str = "") -> int:
    """A 64-bit seed for one (config, tensor, step, purpose); the same on every rank."""
    native = _native.load("seeding")
    if native is not None:
        return native.derive_seed(bytes(digest), name, int(step), purpose)
    return derive_seed_python(digest, name, step, purpose)


def derive_seed_python(digest: bytes, name: str, step: int, purpose: str = "") -> int:
    """:func:`derive_seed` without the extension: the little-endian uint64 of BLAKE2b-64 of
    ``digest || name (UTF-8) || 0x00 || step (int64 LE) || purpose (UTF-8)``."""
    h = hashlib.blake2b(digest_size=8)
    h.update(digest)
    h.update(name.encode("utf-8") + b"\x00")
    h.update(int(step).to_bytes(8, "little", signed=True))
    h.update(purpose.encode("utf-8"))
    return int.from_bytes(h.digest(), "little")


class EncodeContext:
    """What a component may know about the tensor it encodes: its name, step and seed.

    ``rng(purpose)`` returns a fresh NumPy generator for one purpose; ``seed_for(purpose)``
    returns the raw 64-bit seed for kernels (C++, torch) that run their own generator.
    """

    __slots__ = ("name", "step", "_digest")

    def __init__(self, digest: bytes, name: str, step: int) -> None:
        self.name = name
        self.step = int(step)
        self._digest = digest

    def seed_for(self, purpose: str) -> int:
        return derive_seed(self._digest, self.name, self.step, purpose)

    def rng(self, purpose: str) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(self.seed_for(purpose)))
