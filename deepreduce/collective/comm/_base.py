"""The communicator contract: every rank contributes one container and receives all of them."""
from __future__ import annotations

from typing import Callable, List

import numpy as np

from ...errors import CommunicationError
from ...params import Component


class Handle:
    """A pending allgather; ``wait()`` returns one uint8 array per rank, in rank order."""

    __slots__ = ("_wait", "_result")

    def __init__(self, wait: Callable[[], List[np.ndarray]]) -> None:
        self._wait = wait
        self._result = None

    def wait(self) -> List[np.ndarray]:
        if self._result is None:
            self._result = self._wait()
        return self._result


class Communicator(Component):
    """Gathers variable-size byte payloads from every rank.

    Subclasses implement ``rank``, ``size`` and ``allgather_async``; the result always has
    exactly ``size`` payloads, or CommunicationError says what went wrong.
    """

    kind = "communicator"

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def size(self) -> int:
        raise NotImplementedError

    def allgather_async(self, payload: np.ndarray, name: str) -> Handle:
        raise NotImplementedError

    def allgather(self, payload: np.ndarray, name: str) -> List[np.ndarray]:
        return self.allgather_async(payload, name).wait()

    def alltoall(self, payloads: List[np.ndarray], name: str) -> List[np.ndarray]:
        """Send ``payloads[j]`` (uint8, any length, empty too) to rank ``j``; returns what every
        rank sent to this one, in rank order (the sparse all-reduce's first phase)."""
        raise CommunicationError(f"communicator {self.id!r} has no alltoall; the sparse all-reduce needs "
                                 "one (horovod, mpi and torch_distributed have it)")

    def alltoall_async(self, payloads: List[np.ndarray], name: str) -> Handle:
        """:meth:`alltoall` started now where the transport can (Horovod torch), else when
        ``wait()`` is called (callers wait in one order on every rank, so a blocking collective
        issued then stays matched)."""
        return Handle(lambda: self.alltoall(payloads, name))

    def _check_split(self, payloads: List[np.ndarray], name: str) -> np.ndarray:
        """The payloads of an alltoall as one uint8 array, after checking there is one per rank."""
        if len(payloads) != self.size:
            raise CommunicationError(f"alltoall of {name!r} got {len(payloads)} payloads for {self.size} ranks")
        return np.concatenate([np.ascontiguousarray(p, dtype=np.uint8).reshape(-1) for p in payloads])

    def _check_count(self, parts: List[np.ndarray], name: str) -> List[np.ndarray]:
        if len(parts) != self.size:
            raise CommunicationError(f"allgather of {name!r} returned {len(parts)} containers for {self.size} ranks")
        return parts
