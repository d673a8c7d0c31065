"""Per-tensor chains of work on a few threads, and how much of one stage the others hid.

A data-parallel reduction handles each gradient with a chain: encode it, run the collective
that exchanges the containers, decode what came back. Run one chain after another, each
encode waits for the previous tensor's collective round trip. :func:`run_in_order` runs the
chains on a few threads instead, so one tensor's encode proceeds while another tensor's
collective or decode is in flight (the C++ kernels, large NumPy passes and blocking collective
calls release the GIL). :func:`covered_seconds` measures that overlap from the times each
chain recorded; :func:`run_chains` does both for chains of an encode and what follows it.
Framework-free: the TensorFlow binding's eager reduction (:mod:`deepreduce.tensorflow.routes`) uses it.

Why a blocking collective inside a task cannot deadlock the ranks: every rank submits the same
tasks in the same order, and a thread pool starts tasks in submission order. Take the first task
(in that order) not yet finished on some rank: every earlier task has finished everywhere, so on
every rank that task is already running (a free or freed thread took it before any later one),
its collective is submitted on every rank, and it completes. Runtimes that match collectives by
name (Horovod) need nothing more; the order in which tasks *reach* their collectives may differ
between ranks.
"""
from __future__ import annotations

import bisect
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterable, List, Sequence, Tuple, TypeVar

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


def run_in_order(task: Callable[[T], R], items: Iterable[T], workers: int) -> List[R]:
    """``[task(item) for item in items]``, the tasks run on ``workers`` threads (inline for 1).

    Tasks start in the items' order (see the module docstring for why that matters). Every task
    runs to its end even when another one fails, so a rank still takes part in every collective
    its peers expect; then the first failure in item order is re-raised as it was raised (same
    exception object: type, message, traceback). The threads exist for this call only.
    """
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [task(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="deepreduce-chain") as pool:
        futures = [pool.submit(task, item) for item in items]
        wait(futures)
    return [future.result() for future in futures]


def run_chains(encode: Callable[[T], object], rest: Callable[[T, object], R], items: Iterable[T],
               workers: int) -> Tuple[List[R], float, float]:
    """``[rest(item, encode(item)) for item in items]`` by :func:`run_in_order`, timed: returns
    (the results, the encodes' total seconds, the part of them that ran while another chain's
    ``rest`` -- its collective and decode -- was in flight, :func:`covered_seconds`)."""
    def chain(item):
        start = time.perf_counter()
        encoded = encode(item)
        middle = time.perf_counter()
        return rest(item, encoded), (start, middle), (middle, time.perf_counter())

    done = run_in_order(chain, items, workers)
    encodes = [d[1] for d in done]
    return [d[0] for d in done], sum(end - start for start, end in encodes), \
        covered_seconds(encodes, [d[2] for d in done])


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
