"""How much of one stage of a reduction others hid, and the ``background`` option's reading.

A data-parallel reduction handles each gradient with a chain: encode it, run the collective
that exchanges the containers, decode what came back. The step engine starts each encode on its
background worker as gradients arrive, so one tensor's encode proceeds while another tensor's
collective or decode is in flight (the C++ kernels, large NumPy passes and blocking collective
calls release the GIL). :func:`covered_seconds` measures that overlap from the times each
stage recorded (``compression_stats()["encode_hidden_seconds"]``); :func:`check_workers` reads a
binding's ``background`` option. Framework-free.
"""
from __future__ import annotations

import bisect
from typing import List, Sequence, Tuple, TypeVar

from ..errors import ConfigError

DEFAULT_WORKERS = 4   # chains in flight at once with ``background=True``

T = TypeVar("T")
R = TypeVar("R")
Span = Tuple[float, float]


def check_workers(background, owner: str) -> int:
    """The thread count a ``background`` option stands for (1: run the chains inline, in order).

    ``True`` -> :data:`DEFAULT_WORKERS`, ``False`` -> 1, a positive int -> that many threads;
    anything else raises :class:`~deepreduce.errors.ConfigError` naming ``owner``.
    """
    if isinstance(background, bool):
        return DEFAULT_WORKERS if background else 1
    if isinstance(background, int) and background >= 1:
        return background
    raise ConfigError(f"{owner}: background must be True, False or a positive number of worker threads, "
                      f"got {background!r}")


def covered_seconds(spans: Sequence[Span], covers: Sequence[Span]) -> float:
    """Total time of ``spans`` that falls inside the union of ``covers`` (all ``(start, end)`` pairs).

    For a pipelined reduction, ``spans`` are the encodes and ``covers`` the intervals in which a
    tensor's collective or decode was in flight: the result is the encode time hidden behind
    other tensors' communication. Overlapping covers count once; an empty or reversed interval
    counts nothing.
    """
    merged: List[List[float]] = []
    for start, end in sorted(c for c in covers if c[1] > c[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    ends = [high for _, high in merged]
    total = 0.0
    for start, end in spans:
        if end <= start:
            continue
        for low, high in merged[bisect.bisect_right(ends, start):]:   # the covers ending after start
            if low >= end:
                break
            total += min(end, high) - max(start, low)
    return total
