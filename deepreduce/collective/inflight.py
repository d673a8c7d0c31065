"""One step's tensors in flight: encoded off the backward path, waited for in one order.

A binding whose hooks hand over gradients during backward (the torch Horovod optimizer) starts
each tensor's encode and collective as soon as its gradient is final, and waits for all of them
when the optimizer steps. This module holds the parts of that which know no framework:

* :func:`route_of`: how one tensor travels this step;
* :class:`InFlight`: the step's encode-and-start tasks, run on one background thread (or inline,
  ``background=False``: same bytes, simpler to debug), each task's error labelled with its
  tensor; at the step's end every task waited for and every collective finished (the sparse
  all-reduce last, in name order on every rank) before any error is raised, so the ranks stay in
  phase; and where the time went (``compression_stats()``'s encode, hidden, wait, decode seconds);
* :func:`end_step`: commit or undo the step through the protocol and raise its first error.

Why one worker thread: the pipeline's per-tensor state (error-feedback residuals, statistics) is
touched by one encode at a time, and tasks run in submission order. The C++ kernels and large
NumPy passes release the GIL, so the encodes proceed while backward goes on. A task's exception
is kept and re-raised unchanged (type, message, traceback) by its future's ``result()``.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence

from . import overlap, totals


def route_of(protocol, name: str, sparse: bool = False, summed_dense: bool = False) -> str:
    """How the tensor ``name`` travels this step.

    ``summable`` (no protocol: a Horovod-style summable compressor's codes, all-reduced);
    ``entries`` (a sparse gradient's touched entries in a container, allgathered); ``dense`` for
    a tensor the pipeline lets the framework's all-reduce sum (``summed_dense``, see
    :meth:`deepreduce.pipeline.Pipeline.summed_dense`); else the protocol's route: the ``auto``
    plan's ``dense`` or ``fp16`` all-reduce, the ``allgather`` of containers or the
    ``sparse_allreduce``.
    """
    if protocol is None:
        return "summable"
    if sparse:
        return "entries"
    return "dense" if summed_dense else protocol.route(name)


def end_step(protocol, step: int, errors: Sequence[BaseException], order: Optional[Sequence[str]] = None) -> None:
    """After the step's last collective: the protocol commits or undoes the step and raises its
    first error (:meth:`~deepreduce.collective.protocol.ReductionProtocol.end_step`); without one (a
    summable compressor keeps no residuals) the first of ``errors`` is raised."""
    if protocol is not None:
        protocol.end_step(step, errors, order)
    elif errors:
        raise errors[0]


class InFlight:
    """The pending tasks of one step and the seconds spent per phase (see the module docstring).

    A task encodes one tensor (or bucket) and starts its collective; it returns
    ``(handle, route, data)``, which :meth:`finish` hands to the binding's ``finish``, or
    ``(handle, "failed", error)`` when the encode raised and the protocol's failure payload was
    sent instead (:meth:`~deepreduce.collective.protocol.ReductionProtocol.start_encoded`).
    ``seconds``: ``encode`` (the tasks' run time), ``encode_hidden`` (the part of it before the
    step began to wait, i.e. behind backward: 0 inline; where ranks have fewer cores than busy
    threads, it still shared the CPU with backward), ``encode_wait`` (waiting for the tasks),
    ``communication_wait`` (then for the collectives) and ``decode`` (the binding times these two
    with :meth:`timed`); ``steps``: steps completed.
    """

    def __init__(self, background: bool) -> None:
        self.background = bool(background)
        self._executor: Optional[ThreadPoolExecutor] = None   # created by the first background task
        self.pending: Dict[object, Future] = {}
        self.seconds = dict.fromkeys(("encode", "encode_hidden", "encode_wait", "communication_wait", "decode"), 0.0)
        self.steps = 0

    def start(self, key, task: Callable[[], tuple], label: str, step: int) -> None:
        """Queue ``task`` as ``key``'s (inline: run it now); an error it raises gets a note naming
        ``label`` and ``step`` and is kept for :meth:`finish`."""
        def run():
            began = time.perf_counter()
            try:
                started = task()
            except Exception as exc:
                exc.add_note(f"deepreduce: raised while encoding {label} at step {step}")
                raise
            return started, (began, time.perf_counter())

        if self.background:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepreduce-encode")
            self.pending[key] = self._executor.submit(run)
            return
        self.pending[key] = future = Future()
        try:
            future.set_result(run())
        except Exception as exc:  # kept for finish(), as on the worker
            future.set_exception(exc)

    def timed(self, phase: str):
        """A ``with`` block whose seconds go to ``seconds[phase]`` (:func:`deepreduce.collective.totals.timed`)."""
        return totals.timed(self.seconds, phase)

    def finish(self, finish: Callable[[object, object, str, object], None], since: float) -> List[BaseException]:
        """Wait for every task (``since``: when the step began to wait), then ``finish(key, handle,
        route, data)`` every collective they started, the sparse all-reduce's last, by name, so
        that every rank runs them in one order. Returns every error, the tasks' first; none is
        raised before every collective is finished. The next step starts with no task pending."""
        errors: List[BaseException] = []
        started, spans = [], []
        pending, self.pending = self.pending, {}
        for key, future in pending.items():
            try:
                (handle, route, data), span = future.result()
            except Exception as exc:
                errors.append(exc)
                continue
            started.append((key, handle, route, data))
            spans.append(span)
            self.seconds["encode"] += span[1] - span[0]
        if self.background:
            self.seconds["encode_hidden"] += overlap.covered_seconds(spans, [(-math.inf, since)])
        self.seconds["encode_wait"] += time.perf_counter() - since
        started.sort(key=lambda s: (s[2] == "sparse_allreduce", s[1][0] if s[2] == "sparse_allreduce" else ""))
        for key, handle, route, data in started:
            try:
                if route == "failed":   # its failure payload went out instead: the peers raise too
                    handle.wait()
                    raise data
                finish(key, handle, route, data)
            except Exception as exc:  # keep draining the other collectives first
                errors.append(exc)
        return errors

    def stats(self) -> dict:
        """The timing part of ``compression_stats()`` (``decode_seconds`` is the binding's to add:
        a pipeline reports its own)."""
        seconds = self.seconds
        return dict(encode_seconds=seconds["encode"], steps=self.steps, background=self.background,
                    encode_hidden_seconds=seconds["encode_hidden"], encode_wait_seconds=seconds["encode_wait"],
                    communication_wait_seconds=seconds["communication_wait"])
