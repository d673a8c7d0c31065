"""Running totals of a hook's reductions: buckets, bytes and seconds, kept in a plain dict.

The DDP hook reports them through ``compression_stats()`` and saves them in its checkpoints, so
they are a dict of numbers (pickles, ``torch.save``) with fixed keys (:data:`KEYS`); this module
is what adds to them, so that every place that times a phase or counts a bucket does it alike.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator

KEYS = ("buckets", "dense_bytes", "wire_bytes", "collective_bytes", "encode_seconds", "communication_seconds",
        "decode_seconds")


def new() -> Dict[str, float]:
    """Every total at zero: counts as ints, seconds as floats."""
    return {key: 0.0 if key.endswith("_seconds") else 0 for key in KEYS}


@contextlib.contextmanager
def timed(totals: dict, key: str) -> Iterator[None]:
    """Add the wall time of the ``with`` body to ``totals[key]`` (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        totals[key] += time.perf_counter() - start


@contextlib.contextmanager
def collective(totals: dict, nbytes: int) -> Iterator[None]:
    """A collective moving ``nbytes`` of this rank's (padding included): its wall time goes to
    ``communication_seconds``, its bytes to ``collective_bytes``."""
    with timed(totals, "communication_seconds"):
        yield
    totals["collective_bytes"] += int(nbytes)


def count(totals: dict, dense_bytes: int, wire_bytes: int) -> None:
    """One bucket reduced: its float32 size and the bytes this rank sent for it."""
    totals["buckets"] += 1
    totals["dense_bytes"] += int(dense_bytes)
    totals["wire_bytes"] += int(wire_bytes)


def report(totals: dict, **extra) -> dict:
    """The totals with ``extra`` and ``relative_volume`` (wire bytes over dense bytes, 0 before any)."""
    out = dict(totals, **extra)
    out["relative_volume"] = out["wire_bytes"] / out["dense_bytes"] if out["dense_bytes"] else 0.0
    return out
