"""``ReductionProtocol.failed_rank`` finds the rank whose encode raised among every rank's
payloads: NumPy arrays (the host path) and torch tensors (the DDP hook's gathered slots). A torch
payload is read through one copy to the host, never element by element: each element of a CUDA
tensor read on its own is a device synchronisation."""
import numpy as np
import torch

from deepreduce.dist import agreement
from deepreduce.dist.protocol import ReductionProtocol
from deepreduce.errors import NonFiniteGradientError

FOUND = (2, "nonfinite", "NonFiniteGradientError: overflowed")


def payloads():
    """A small ordinary container, a large payload (never parsed) and a failure payload."""
    return [agreement.wrap_bytes(b"a small ordinary container"), np.zeros(4096, dtype=np.uint8),
            ReductionProtocol.failure_payload(NonFiniteGradientError("overflowed"))]


def test_numpy_payloads_name_the_rank_that_failed():
    assert ReductionProtocol.failed_rank(payloads()) == FOUND
    assert ReductionProtocol.failed_rank(payloads()[:2]) is None


def test_a_torch_payload_is_read_through_one_host_copy(monkeypatch):
    tensors = [torch.from_numpy(p.copy()) for p in payloads()]
    copies, cpu = [], torch.Tensor.cpu

    def counted_cpu(self, *args, **kwargs):
        copies.append(self.numel())
        return cpu(self, *args, **kwargs)

    def no_iteration(self):
        raise AssertionError("a payload was read element by element")

    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
    monkeypatch.setattr(torch.Tensor, "__iter__", no_iteration)
    assert ReductionProtocol.failed_rank(tensors) == FOUND
    # each small payload copied once, whole; the large one not read at all
    assert copies == [len(tensors[0]), len(tensors[2])]
