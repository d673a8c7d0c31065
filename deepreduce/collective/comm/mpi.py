"""mpi4py Allgatherv: sizes first (allgather of one integer), then the bytes."""
from __future__ import annotations

import numpy as np

from ...errors import BackendUnavailableError
from ...registry import register
from ._base import Communicator, Handle


@register
class MPICommunicator(Communicator):
    """``MPI.COMM_WORLD.Allgatherv`` of uint8 containers (blocking)."""

    id = "mpi"

    def _init_state(self):
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise BackendUnavailableError(f"the mpi communicator needs mpi4py: {exc}") from exc
        self._comm = MPI.COMM_WORLD

    @property
    def rank(self):
        return self._comm.Get_rank()

    @property
    def size(self):
        return self._comm.Get_size()

    def allgather_async(self, payload, name):
        payload = np.ascontiguousarray(payload, dtype=np.uint8)
        counts = np.asarray(self._comm.allgather(int(payload.size)), dtype=np.int64)
        received = np.empty(int(counts.sum()), dtype=np.uint8)
        self._comm.Allgatherv(payload, [received, counts])
        bounds = np.concatenate([[0], np.cumsum(counts)])
        parts = [received[bounds[i]:bounds[i + 1]] for i in range(len(counts))]
        return Handle(lambda: self._check_count(parts, name))

    def alltoall(self, payloads, name):
        """``Alltoall`` of the byte counts, then one ``Alltoallv`` of the bytes."""
        send = self._check_split(payloads, name)
        counts = np.asarray([np.asarray(p).size for p in payloads], dtype=np.int64)
        incoming = np.empty_like(counts)
        self._comm.Alltoall(counts, incoming)
        received = np.empty(int(incoming.sum()), dtype=np.uint8)
        self._comm.Alltoallv([send, (counts, _starts(counts))], [received, (incoming, _starts(incoming))])
        return _split(received, incoming)


def _starts(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _split(buffer: np.ndarray, counts) -> list:
    """``buffer`` cut into consecutive parts of ``counts`` bytes."""
    ends = np.cumsum(counts)
    return [buffer[end - count:end] for end, count in zip(ends, counts)]
