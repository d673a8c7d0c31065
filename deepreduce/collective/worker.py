"""The step engine's one background thread: calls run one at a time, in submission order.

A plain thread and queue rather than a ``ThreadPoolExecutor`` so that the binding names the
thread (``deepreduce-step`` for the Horovod optimizer, ``deepreduce-ddp`` for the DDP hook) and can
stop it at a moment of its choosing (the DDP hook stops it before it releases its process group:
a thread left to interpreter teardown while its group goes can abort the process)."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, Optional


class Worker:
    """Runs submitted calls on one thread, started on the first :meth:`submit`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.thread: Optional[threading.Thread] = None
        self._calls: "queue.Queue" = queue.Queue()

    def submit(self, call: Callable, *args) -> Future:
        """Run ``call(*args)`` after every call submitted before it; its Future holds the result."""
        future: Future = Future()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        self._calls.put((future, call, args))
        return future

    def _run(self) -> None:
        while True:
            entry = self._calls.get()
            if entry is None:
                return
            future, call, args = entry
            try:
                future.set_result(call(*args))
            except BaseException as exc:   # noqa: BLE001 (the Future carries it to whoever waits)
                future.set_exception(exc)

    def idle(self) -> None:
        """Block until every call submitted so far has run."""
        if self.thread is not None:
            self.submit(lambda: None).result()

    def close(self) -> None:
        """Let the calls already submitted run, then stop the thread (a later submit starts a new one)."""
        thread, self.thread = self.thread, None
        if thread is not None and thread.is_alive():
            self._calls.put(None)
            thread.join()
