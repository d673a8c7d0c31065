"""Figures for ``deepreduce bench --selection`` and ``--decode-sum``: the hot passes alone.

``--selection`` times Top-r selection of a synthetic gradient at each size: the C++ radix select
(``deepreduce._select``) on 1 thread and on the ``auto`` thread count, the NumPy path (the same
positions), ``torch.topk`` of the magnitudes (values and indices only, no tie rule, as a
reference) on 1 and on torch's default threads, and the pipeline's fused pass (finiteness check
+ compensation into a residual + Top-r) without and with a residual.
``--decode-sum`` times ``decode_sum`` of one container per simulated rank into one buffer.
Selection rows print wall and process CPU milliseconds (medians).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import numpy as np


def median_ms(fn, repeat: int):
    """(median wall milliseconds, median process CPU milliseconds) of ``repeat`` calls.

    CPU time sums every thread of the process; for a single thread it is the figure least
    disturbed by other jobs on a shared machine.
    """
    wall, cpu = [], []
    for _ in range(max(1, repeat)):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


@contextlib.contextmanager
def numpy_backend(active: bool = True):
    """Run the codecs inside on their NumPy definitions (``DEEPREDUCE_BACKEND=numpy``, read at
    each call) when ``active``, the setting restored afterwards; else as installed."""
    previous = os.environ.get("DEEPREDUCE_BACKEND")
    if active:
        os.environ["DEEPREDUCE_BACKEND"] = "numpy"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("DEEPREDUCE_BACKEND", None)
        else:
            os.environ["DEEPREDUCE_BACKEND"] = previous


def _numpy_backend(fn):
    with numpy_backend():
        return fn()


def selection_rows(grads, ratio: float, repeat: int) -> list:
    """One row per (size, implementation, threads): median milliseconds of a Top-r selection."""
    from deepreduce.backend import kernels, parallel
    from deepreduce.backend.kernels import topk_positions
    from deepreduce.sparsify import count_for

    auto = parallel.resolve_threads(parallel.AUTO)
    rows = []
    for g in grads:
        d, r = g.size, count_for(ratio, g.size)

        def add(name, threads, fn, reps=repeat):
            wall, cpu = median_ms(fn, reps)
            rows.append({"size": d, "r": r, "impl": name, "threads": threads, "ms": wall, "cpu_ms": cpu})

        if kernels.native() is not None:
            for threads in sorted({1, auto}):
                add("c++ topk", threads, lambda t=threads: topk_positions(g, r, t))
                add("fused scan+topk", threads, lambda t=threads: kernels.scan(g, None, r, t))
                residual = np.zeros_like(g)
                add("fused scan+topk, residual", threads, lambda t=threads: kernels.scan(g, residual, r, t))
        add("numpy topk", 1, lambda: _numpy_backend(lambda: topk_positions(g, r)), max(1, min(repeat, 3)))
        try:
            import torch
        except ImportError:
            continue
        t = torch.from_numpy(g)
        default = torch.get_num_threads()
        for threads in sorted({1, default}):
            torch.set_num_threads(threads)
            add("torch.topk(|g|)", threads, lambda: torch.topk(t.abs(), r, sorted=False))
        torch.set_num_threads(default)
    return rows


def print_selection(rows) -> None:
    header = f"{'Top-r selection':<28} {'size':>10} {'r':>9} {'threads':>7} {'ms':>9} {'cpu_ms':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['impl']:<28} {row['size']:>10} {row['r']:>9} {row['threads']:>7} {row['ms']:>9.2f} "
              f"{row['cpu_ms']:>9.2f}", flush=True)


def peer_payloads(peer, tensors, step: int) -> list:
    """The containers another rank sends at ``step`` for ``tensors`` (``(name, tensor)`` pairs).

    ``peer`` is a second pipeline of the same config standing for that rank; it encodes each
    gradient negated: the same positions, sizes and codec work, other bytes. A receiver
    recognises its own container and adds what it kept at encode, so benchmarks that copied
    this rank's container for every rank would time only that shortcut; the peer's containers
    are decoded in full, as a real receiver decodes every other rank's.
    """
    return [peer.encode(-tensor, name=name, step=step) for name, tensor in tensors]


def decode_sum_ms(pipe, grads, repeat: int) -> float:
    """Median milliseconds of ``decode_sum`` of one container per gradient, into one buffer."""
    core = getattr(pipe, "core", pipe)
    payloads = [core.encode(g, name="bench", step=0) for g in grads]
    out = np.empty(grads[0].size, dtype=np.float32)
    return median_ms(lambda: core.decode_sum(payloads, out=out), repeat)[0]
