"""The DDP hook's transport: torch.distributed over the hook's private group, where each bucket's
collective carries its header (:mod:`deepreduce.collective.slots`).

* ``allgather_async(payload, name, header=...)``: the bucket's one ``all_gather_into_tensor`` of
  fixed-size slots whose prefix is the header (size, digests of compressor and layout, step);
  ``payload=None`` sends the header alone (a route whose bytes travel otherwise, the sparse
  all-reduce, still checks its bucket). A layout or step disagreement is the same
  CommunicationError on every rank (:func:`deepreduce.collective.failure.everywhere`);
* ``allreduce(tensor, header)``: ``all_reduce`` (a sum) of a tensor whose last element is the
  all-reduce routes' failure flag; for a summable compressor's codes (``header.summed``), the
  slots' steady state: one all-reduce once the ranks agreed on the codes' size, the header first
  on a bucket's first step or when any rank flagged (:class:`deepreduce.collective.slots.Slots`);
* without a header, :class:`TorchDistributedCommunicator`'s collectives (the agreement, the
  sparse all-reduce's rounds, whose bytes this rank sends count as its wire bytes, the auto
  planner).

Calls are blocking and come from the step engine's one worker, in the same order on every rank.
``totals`` (a :mod:`deepreduce.collective.totals` dict) counts buckets, bytes and seconds.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ...errors import CommunicationError
from .. import agreement, failure, slots, totals
from ..ports import Pending
from .torch_distributed import TorchDistributedCommunicator

SPARSE_ROUNDS = "deepreduce.sra"   # the names of the sparse all-reduce's collectives (collective/sparse_allreduce.py)


class SlottedTorchDistributed(TorchDistributedCommunicator):
    """See the module docstring. Not a config component: the DDP hook builds it."""

    id = "torch_distributed_slots"

    def _init_state(self):
        super()._init_state()
        self.slots = slots.Slots()
        self.totals = totals.new()

    def _device(self):
        dist = self._dist()
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")

    def allgather_async(self, payload, name, header: Optional[slots.Header] = None):
        if header is None:
            self._count_sparse(name, [payload])
            return super().allgather_async(payload, name)
        device = _on(header)
        if payload is not None and not isinstance(payload, torch.Tensor):
            payload = torch.from_numpy(np.ascontiguousarray(payload, dtype=np.uint8))
        payload = None if payload is None else payload.to(device or self._device())
        like = torch.empty(0, dtype=torch.uint8, device=device or self._device()) if payload is None else payload
        nbytes = 0 if payload is None else int(payload.numel())
        _, parts = self._exchange(header, nbytes, payload, like)
        totals.count(self.totals, header.dense_bytes, nbytes)
        return Pending(lambda: parts)

    def alltoall(self, payloads, name):
        self._count_sparse(name, payloads)
        return super().alltoall(payloads, name)

    def _count_sparse(self, name: str, payloads) -> None:
        """The sparse all-reduce's rounds (``deepreduce.sra*``): what this rank sends is on the wire."""
        if name.startswith(SPARSE_ROUNDS):
            if name.startswith(SPARSE_ROUNDS + "2"):   # phase two: one payload for every rank (an allgather
                payloads = payloads[:1]                # by alltoall where a batch is fused), counted once
            nbytes = sum(int(np.asarray(p).size) for p in payloads)
            self.totals["wire_bytes"] += nbytes
            self.totals["collective_bytes"] += nbytes

    def _exchange(self, header: slots.Header, nbytes: int, payload, like):
        """:meth:`Slots.exchange` and the step check; their errors are every rank's."""
        def explain() -> str:   # a collective of the communicator: the first difference, named
            return agreement.explain(header.layout, lambda data: self.allgather(data, "deepreduce.collective.agreement"))
        try:
            headers, parts = self.slots.exchange(header.key, slots.prefix(nbytes, header.layout, header.step),
                                                 payload, self._all_gather, like, header.where, explain)
            slots.check_step(headers, header.where, header.summed)
        except CommunicationError as exc:
            raise failure.everywhere(exc) from None
        return headers, parts

    def _all_gather(self, tensor) -> List:
        """Every rank's ``tensor``, as views of one flat output (``all_gather_into_tensor``: one
        output buffer instead of one tensor per rank, and NCCL's native form of the gather)."""
        dist, size = self._dist(), self.size
        gathered = torch.empty(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        with totals.collective(self.totals, tensor.numel() * tensor.element_size()):
            dist.all_gather_into_tensor(gathered, tensor.reshape(-1), group=self.group)
        return list(gathered.view(size, *tensor.shape).unbind(0))

    def _all_reduce(self, tensor) -> None:
        with totals.collective(self.totals, tensor.numel() * tensor.element_size()):
            self._dist().all_reduce(tensor, group=self.group)

    def allreduce(self, tensor, header: slots.Header) -> Pending:
        """The sum of ``tensor`` (data, then the flag) over the ranks, in place (see the module docstring)."""
        _on(header)
        nbytes = (tensor.numel() - 1) * tensor.element_size()
        if header.summed is None:   # dense or fp16: the plan is agreed, no header travels
            self._all_reduce(tensor)
            totals.count(self.totals, header.dense_bytes, nbytes)
            return Pending(lambda: tensor)
        failed = bool(tensor[-1] != 0)
        signature = None if failed else (header.layout.digest, nbytes, str(tensor.dtype))
        agreed = self.slots.agreed(header.key)
        if agreed is not None:   # steady state: one all-reduce, unless a rank flags
            flag = self.slots.flag(header.key, signature, header.step)
            sent = tensor.new_zeros(agreed[1] // tensor.element_size() + 1) if flag else tensor
            kept = None if flag else tensor.clone()   # sent again if a peer flags
            sent[-1] = flag
            self._all_reduce(sent)
            if not sent[-1].item():
                return self._agreed(tensor, header, signature, nbytes)
            if kept is not None:
                tensor.copy_(kept)
        # the header alone: every rank checks every rank's (a rank that failed says so: FAILED)
        self._exchange(header, slots.FAILED if failed else nbytes, None,
                       torch.empty(0, dtype=torch.uint8, device=tensor.device))
        self._all_reduce(tensor)
        return self._agreed(tensor, header, signature, nbytes)

    def _agreed(self, tensor, header: slots.Header, signature, nbytes: int) -> Pending:
        self.slots.agree(header.key, signature, header.step)
        totals.count(self.totals, header.dense_bytes, nbytes)
        return Pending(lambda: tensor)


def _on(header: slots.Header):
    """The bucket's device, made this thread's current CUDA device (NCCL runs there); None: the default."""
    device = None if header.device is None else torch.device(header.device)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    return device
