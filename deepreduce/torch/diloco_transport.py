"""The outer loop's transport (:mod:`deepreduce.torch.diloco`): the step engine's ports over the
group of workers, on ``torch.distributed`` or Horovod.

* :class:`Counted`: the communicator the engine and its routes use (allgather, alltoall), counting
  the bytes this rank sends and receives in the outer steps (the agreement's records excluded);
* :func:`open_transport`: (counted communicator, all-reduce port, broadcast) for ``backend``
  ``"torch"`` (a ``torch.distributed`` process group, None: the default group) or ``"horovod"``
  (a Horovod process set, None: every rank). The all-reduce port sums (the engine's routes divide).
"""
from __future__ import annotations

from typing import Callable, Tuple

import numpy as np
import torch

from ..collective import ports
from ..errors import CommunicationError, ConfigError

BACKENDS = ("torch", "horovod")
UNCOUNTED = ("deepreduce.collective.agreement",)   # collectives that are not the outer step's bytes


def _nbytes(payload) -> int:
    if isinstance(payload, torch.Tensor):
        return int(payload.numel() * payload.element_size())
    return int(np.asarray(payload).nbytes)


class Counted:
    """``inner`` (a deepreduce communicator) with its outer-step bytes counted: ``sent`` (this
    rank's payloads: its container of an allgather, its parts for the other ranks of an alltoall)
    and ``received`` (what the other ranks' payloads bring this rank)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.sent = self.received = 0

    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)

    def _counted(self, name: str) -> bool:
        return not name.startswith(UNCOUNTED)

    def allgather_async(self, payload, name: str):
        started = ports.start_allgather(self.inner, payload, name)
        if not self._counted(name):
            return started

        def wait():
            parts = started.wait()
            self.sent += _nbytes(payload)
            self.received += sum(_nbytes(part) for rank, part in enumerate(parts) if rank != self.rank)
            return parts
        return ports.Pending(wait)

    def allgather(self, payload, name: str):
        return self.allgather_async(payload, name).wait()

    def alltoall_async(self, payloads, name: str):
        started = ports.start_alltoall(self.inner, payloads, name)

        def wait():
            received = started.wait()
            if self._counted(name):
                me = self.rank
                self.sent += sum(_nbytes(p) for rank, p in enumerate(payloads) if rank != me)
                self.received += sum(_nbytes(p) for rank, p in enumerate(received) if rank != me)
            return received
        return ports.Pending(wait)

    def alltoall(self, payloads, name: str):
        return self.alltoall_async(payloads, name).wait()

    def count_allreduce(self, tensor) -> None:
        """A dense all-reduce of ``tensor``: counted as its bytes sent and received once."""
        nbytes = _nbytes(tensor)
        self.sent += nbytes
        self.received += nbytes

    def get_config(self):
        return self.inner.get_config()


def open_transport(backend: str, group, owner: str = "DiLoCo") -> Tuple[Counted, Callable, Callable, Callable]:
    """(communicator, ``allreduce(tensor, item, average) -> Pending`` (a sum, in place),
    ``broadcast(tensor, name)`` from the group's first rank, in place, ``release()`` of what it
    opened) over ``group``. Over torch.distributed with ``group=None`` the collectives run in a
    private copy of the default group (collective over every rank)."""
    if backend == "torch":
        return _torch(group, owner)
    if backend == "horovod":
        return _horovod(group, owner)
    raise ConfigError(f"{owner}: backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


def _torch(group, owner: str):
    import torch.distributed as dist

    from ..collective.comm.torch_distributed import TorchDistributedCommunicator

    if not dist.is_available() or not dist.is_initialized():
        raise CommunicationError(f"{owner}: backend 'torch' needs torch.distributed.init_process_group first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ConfigError(f"{owner}: group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ConfigError(f"{owner}: this process (global rank {dist.get_rank()}) is not in the group; "
                          "build DiLoCo only on the group's ranks")
    # the default group is the training thread's too (a loss all-reduce may run while the engine's
    # worker runs a reduction): the outer loop gets a private copy (every rank builds it, as every
    # rank builds DiLoCo then). A group passed in is DiLoCo's own (docs/semisync.md); a private copy
    # of a subgroup cannot be made safely (torch names a group built by its ranks alone after the
    # ranks, so a second copy would reuse the first one's store keys)
    ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
    private = group is None
    if private:
        group = dist.new_group(ranks=ranks, backend=dist.get_backend())
    inner = TorchDistributedCommunicator()
    inner.group = group
    counted = Counted(inner)
    root = ranks[0]

    def allreduce(tensor, item, average):
        counted.count_allreduce(tensor)
        dist.all_reduce(tensor, group=group)
        return ports.Pending(lambda: tensor)

    def broadcast(tensor, name):
        dist.broadcast(tensor, src=root, group=group)

    def release():
        if private and dist.is_initialized():
            dist.destroy_process_group(group)
    return counted, allreduce, broadcast, release


def _horovod(group, owner: str):
    from ..collective.comm.horovod import HorovodCommunicator, settled

    inner = HorovodCommunicator(framework="torch")
    hvd = inner.hvd
    if not hvd.is_initialized():
        raise CommunicationError(f"{owner}: backend 'horovod' needs hvd.init() first")
    inner.process_set = group
    kwargs = {} if group is None else {"process_set": group}
    counted = Counted(inner)

    def allreduce(tensor, item, average):
        counted.count_allreduce(tensor)
        handle = hvd.allreduce_async_(tensor, op=hvd.Sum, name=f"deepreduce.diloco.{item.name}", **kwargs)
        return ports.Pending(lambda: settled(hvd, handle))

    def broadcast(tensor, name):
        hvd.broadcast_(tensor, root_rank=0, name=f"deepreduce.diloco.broadcast.{name}", **kwargs)
    return counted, allreduce, broadcast, lambda: None
