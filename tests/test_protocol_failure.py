"""``deepreduce.collective.failure.failed_rank`` finds the rank whose encode raised among every rank's
payloads: NumPy arrays (the host path) and torch tensors (the DDP hook's gathered slots). A torch
payload is read through one copy to the host, never element by element: each element of a CUDA
tensor read on its own is a device synchronisation. ``agreement.first_nonfinite`` likewise reads
the flags byte of all gathered containers in one copy."""
import numpy as np
import torch

import deepreduce
from deepreduce.collective import agreement, failure
from deepreduce.errors import NonFiniteGradientError

FOUND = (2, "nonfinite", "NonFiniteGradientError: overflowed")


def payloads():
    """A small ordinary container, a large payload (never parsed) and a failure payload."""
    return [agreement.wrap_bytes(b"a small ordinary container"), np.zeros(4096, dtype=np.uint8),
            failure.payload(NonFiniteGradientError("overflowed"))]


def test_numpy_payloads_name_the_rank_that_failed():
    assert failure.failed_rank(payloads()) == FOUND
    assert failure.failed_rank(payloads()[:2]) is None


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
    assert failure.failed_rank(tensors) == FOUND
    # each small payload copied once, whole; the large one not read at all
    assert copies == [len(tensors[0]), len(tensors[2])]


def test_the_nonfinite_flags_of_torch_payloads_are_read_in_one_host_copy(monkeypatch):
    """agreement.first_nonfinite reads the flags byte of every gathered container in one
    transfer (one device synchronisation for the whole gather) and copies only a flagged one."""
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.1}, "index": {"id": "raw"},
                             "value": {"id": "raw"}, "memory": {"id": "none"}, "nonfinite": "raise"})
    pipe.collective_steps()
    g = np.ones(200, np.float32)
    ok = torch.from_numpy(pipe.encode(g, name="w", step=0).copy())
    g[[3, 5]], g[7] = np.nan, np.inf
    bad = torch.from_numpy(pipe.encode(g, name="w", step=1).copy())
    copies, cpu = [], torch.Tensor.cpu

    def counted_cpu(self, *args, **kwargs):
        copies.append(self.numel())
        return cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
    assert agreement.first_nonfinite([ok, ok, ok]) is None
    assert copies == [3]                                 # one byte of each of the three, one copy
    copies.clear()
    assert agreement.first_nonfinite([ok, bad, bad]) == (1, 2, 1)
    assert copies == [3, len(bad)]                       # then the flagged container, whole
