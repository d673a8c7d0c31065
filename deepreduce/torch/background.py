"""The encode worker of ``DistributedOptimizer``: encodes gradients off the backward path.

Backward produces gradients one parameter at a time. Encoding one into a DeepReduce container
and starting its collective takes a while (selection, index and value codecs), and doing it
inside the autograd hook would make backward wait for it. The worker takes the job instead: the
hook hands it a task and returns, the worker runs tasks one after another on its own thread while
backward goes on (the C++ kernels and the large NumPy passes release the GIL), and ``step()``
waits for every task before decoding.

One thread, tasks in submission order: the pipeline's per-tensor state (error-feedback
residuals, statistics) is only ever touched by one encode at a time. A task's exception is
kept and re-raised, unchanged (same type, message and traceback), by its future's ``result()``
on the thread that waits for it.

With ``background=False`` a task runs at once on the caller's thread (inside the hook): the
synchronous path, for debugging and for comparison. Errors still surface in ``result()``, so
both modes behave the same for the caller.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional


class EncodeWorker:
    """Runs encode tasks on one background thread (``background=True``) or inline."""

    def __init__(self, background: bool = True) -> None:
        self.background = bool(background)
        self._executor: Optional[ThreadPoolExecutor] = None

    def submit(self, fn: Callable[[], object]) -> Future:
        """Run ``fn``; the returned future holds its value or its exception (``result()`` re-raises it)."""
        if self.background:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepreduce-encode")
            return self._executor.submit(fn)
        future: Future = Future()
        try:
            future.set_result(fn())
        except Exception as exc:  # kept for step(), as on the worker
            future.set_exception(exc)
        return future
