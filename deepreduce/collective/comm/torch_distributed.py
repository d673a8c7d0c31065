"""torch.distributed all_gather: sizes first, then payloads padded to the largest."""
from __future__ import annotations

import numpy as np

from ...errors import BackendUnavailableError, CommunicationError
from ...registry import register
from ._base import Communicator, Handle


@register
class TorchDistributedCommunicator(Communicator):
    """``torch.distributed.all_gather`` over the default process group (gloo or nccl), or over
    ``group`` when set (the DDP hook's state sets its private group)."""

    id = "torch_distributed"

    def _init_state(self):
        self.group = None

    def _dist(self):
        try:
            import torch.distributed as dist
        except ImportError as exc:
            raise BackendUnavailableError(f"the torch_distributed communicator needs torch: {exc}") from exc
        if not dist.is_available() or not dist.is_initialized():
            raise CommunicationError("torch_distributed communicator: call torch.distributed.init_process_group first")
        return dist

    @property
    def rank(self):
        return self._dist().get_rank(self.group)

    @property
    def size(self):
        return self._dist().get_world_size(self.group)

    def allgather_async(self, payload, name):
        import torch

        dist = self._dist()
        nccl = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        if not isinstance(payload, torch.Tensor):
            payload = torch.from_numpy(np.ascontiguousarray(payload, dtype=np.uint8))
        local = payload.to(device)   # a uint8 device tensor (the torch device path) is gathered where it is
        size = torch.tensor([local.numel()], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(sizes, size, group=self.group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: local.numel()] = local
        gathered = [torch.empty_like(padded) for _ in sizes]
        work = dist.all_gather(gathered, padded, group=self.group, async_op=True)

        def wait():
            work.wait()
            return self._check_count(
                [g[: int(s.item())] if device.type != "cpu" else g[: int(s.item())].numpy()
                 for g, s in zip(gathered, sizes)], name
            )

        return Handle(wait)

    def alltoall(self, payloads, name):
        """``all_to_all_single`` of the byte counts, then of the bytes with uneven splits (host
        tensors; on an NCCL group, tensors on this rank's GPU)."""
        import torch

        from .mpi import _split

        dist = self._dist()
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        send = torch.from_numpy(self._check_split(payloads, name)).to(device)
        counts = torch.tensor([int(np.asarray(p).size) for p in payloads], dtype=torch.int64, device=device)
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)
        received = torch.empty(int(incoming.sum()), dtype=torch.uint8, device=device)
        dist.all_to_all_single(received, send, output_split_sizes=incoming.tolist(),
                               input_split_sizes=counts.tolist(), group=self.group)
        return _split(received.cpu().numpy(), incoming.cpu().numpy())
