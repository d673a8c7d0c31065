"""Helpers of the hostile-input tests: valid containers per config, and CRC-valid rewrites of them.

A rewrite changes parsed fields (header numbers, params, sections) and packs again, so the CRC is
recomputed and every check behind it runs; :func:`pack_v1` writes the legacy layout for the
same purpose on format-1 containers.
"""
import dataclasses
import glob
import os
import struct
import zlib

import numpy as np

import deepreduce
from deepreduce.wire import container

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
GOLDEN_V1 = sorted(glob.glob(os.path.join(ROOT, "tests", "golden", "v1", "*.npz")))
NUMEL = 3000


def config_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def gradient(numel: int = NUMEL, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(numel) * rng.exponential(1.0, numel)).astype(np.float32)


def valid_container(path: str, numel: int = NUMEL):
    """(pipeline, one sparse container of a ``numel`` gradient) for a config file."""
    pipe = deepreduce.build(path)
    pipe.min_numel = min(pipe.min_numel, numel)
    return pipe, pipe.encode(gradient(numel), name="layer.weight", step=3)


def rewrite(payload, **fields) -> np.ndarray:
    """The container with some parsed fields replaced, packed again (v2, CRC recomputed)."""
    c = container.unpack(payload, max_numel=1 << 128)
    return container.pack(dataclasses.replace(c, **fields))


_V1 = struct.Struct("<4sBBBBBBHHHQQQQ")


def pack_v1(c: container.Container) -> bytes:
    """A format-1 container of ``c`` (fixed u16/u64 fields, no digest), CRC included."""
    body = _V1.pack(b"DPRD", 1, c.flags, c.index_id, c.value_id, len(c.shape), c.perm_width,
                    len(c.index_params), len(c.value_params), 0, c.n, len(c.index_section),
                    len(c.value_section), len(c.perm_section))
    body += struct.pack(f"<{len(c.shape)}Q", *c.shape)
    body += c.index_params + c.value_params + c.index_section + c.value_section + c.perm_section
    return body + struct.pack("<I", zlib.crc32(body))
