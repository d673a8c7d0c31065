"""Horovod allgather: the containers of all ranks arrive concatenated and are split by header."""
from __future__ import annotations

import time

import numpy as np

from ...errors import BackendUnavailableError
from ...params import Param
from ...registry import register
from ...wire import container
from ._base import Communicator, Handle


def _import_horovod(framework: str):
    try:
        if framework == "tensorflow":
            import horovod.tensorflow as hvd
        else:
            import horovod.torch as hvd
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the horovod communicator needs horovod.{framework}: {exc}. Run `make setup` to build Horovod."
        ) from exc
    return hvd


#: The polite wait's first and longest sleep between polls (seconds): :func:`settled`.
FIRST_SLEEP_S, LONGEST_SLEEP_S = 20e-6, 200e-6


def settled(hvd, handle):
    """``hvd.synchronize(handle)`` once the collective is done, without spinning meanwhile.

    Horovod's own wait loops on ``sched_yield``: every millisecond a rank waits for its peers
    (the sparse all-reduce's second round waits for the slowest owner) is a millisecond of its
    CPU, taken from the engine's worker, the data loader and, with more ranks than cores, the peers
    being waited for. Polling with sleeps that double from 20 us to 0.2 ms gives the core back at
    the price of at most one sleep of latency (about 0.2 ms, and under 2% of any wait longer than
    10 ms). With more ranks than cores it halves a step's wall time (docs/benchmarks.md, "Waiting
    for Horovod without spinning"); with a core per rank it changes little."""
    delay = FIRST_SLEEP_S
    while not hvd.poll(handle):
        time.sleep(delay)
        delay = min(2 * delay, LONGEST_SLEEP_S)
    return hvd.synchronize(handle)


@register
class HorovodCommunicator(Communicator):
    """``hvd.allgather`` of uint8 containers (asynchronous with the torch backend).

    One collective per tensor: the containers are self-delimiting, so no sizes travel first.
    """

    id = "horovod"
    PARAMS = {"framework": Param(str, default="torch", choices=("torch", "tensorflow"))}

    def _init_state(self):
        self._hvd = None
        self.process_set = None

    @property
    def hvd(self):
        if self._hvd is None:
            self._hvd = _import_horovod(self.framework)
        return self._hvd

    @property
    def rank(self):
        return self.hvd.rank() if self.process_set is None else self.process_set.rank()

    @property
    def size(self):
        return self.hvd.size() if self.process_set is None else self.process_set.size()

    def allgather_async(self, payload, name):
        hvd = self.hvd
        kwargs = {} if self.process_set is None else {"process_set": self.process_set}
        if self.framework == "torch":
            import torch

            local = payload if isinstance(payload, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(payload))
            if local.device.type != "cpu" and not (hvd.cuda_built() or hvd.rocm_built()):
                local = local.cpu()   # a Horovod without GPU support gathers host tensors
            handle = hvd.allgather_async(local, name=name, **kwargs)   # a device tensor stays on its device
            return Handle(lambda: self._check_count(container.split(settled(hvd, handle)), name))
        import tensorflow as tf

        gathered = hvd.allgather(tf.constant(payload), name=name, **kwargs).numpy()
        return Handle(lambda: self._check_count(container.split(gathered), name))

    def alltoall_async(self, payloads, name):
        """Horovod torch's ``alltoall_async`` (the worker starts it while backward goes on);
        TensorFlow's blocking alltoall when waited for."""
        if self.framework != "torch":
            return super().alltoall_async(payloads, name)
        import torch

        from .mpi import _split

        send = self._check_split(payloads, name)
        counts = torch.tensor([int(np.asarray(p).size) for p in payloads], dtype=torch.int32)
        kwargs = {} if self.process_set is None else {"process_set": self.process_set}
        handle = self.hvd.alltoall_async(torch.from_numpy(send), splits=counts, name=name, **kwargs)

        def wait():
            received, incoming = settled(self.hvd, handle)
            return _split(received.numpy(), incoming.numpy().astype(np.int64))
        return Handle(wait)

    def alltoall(self, payloads, name):
        """Horovod's ``alltoall`` with splits (the byte count for every rank)."""
        from .mpi import _split

        send = self._check_split(payloads, name)
        counts = [int(np.asarray(p).size) for p in payloads]
        kwargs = {} if self.process_set is None else {"process_set": self.process_set}
        if self.framework == "torch":
            import torch

            received, incoming = self.hvd.alltoall(torch.from_numpy(send), splits=torch.tensor(counts, dtype=torch.int32),
                                                   name=name, **kwargs)
            return _split(received.numpy(), incoming.numpy().astype(np.int64))
        import tensorflow as tf

        received, incoming = self.hvd.alltoall(tf.constant(send), splits=tf.constant(counts, dtype=tf.int32),
                                               name=name, **kwargs)
        return _split(received.numpy(), incoming.numpy().astype(np.int64))
