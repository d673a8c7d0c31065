"""The torch binding runs the core's path: zero-copy encode of CPU gradients, decode into .grad."""
import numpy as np
import pytest
import torch

import deepreduce
from deepreduce.torch import TorchPipeline

CONFIG = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": "raw", "value": "raw", "memory": "residual",
          "min_numel": 0}


def test_float32_cpu_gradient_is_encoded_without_a_copy(monkeypatch):
    pipe = deepreduce.torch.build(CONFIG)
    seen = []
    original = pipe.core.encode

    def spy(grad, **kw):
        seen.append(grad)
        return original(grad, **kw)

    monkeypatch.setattr(pipe.core, "encode", spy)
    g = torch.randn(30, 40)
    payload = pipe.encode(g, name="w", step=0)
    assert np.shares_memory(seen[0], g.numpy())
    assert np.array_equal(payload.numpy(), deepreduce.build(CONFIG).encode(g.numpy(), name="w", step=0))
    pipe.encode(g.double(), name="w", step=1)  # float64 reaches the core as is: it reports values
    assert seen[1].dtype == np.float64         # beyond float32's range as overflow, then converts once
    pipe.encode(g.half(), name="w", step=2)    # other dtypes are converted once
    assert seen[2].dtype == np.float32


def test_decode_sum_writes_into_a_given_tensor():
    pipe = deepreduce.torch.build(CONFIG)
    grads = [torch.randn(30, 40) for _ in range(3)]
    payloads = [pipe.encode(g, name=f"w{i}") for i, g in enumerate(grads)]
    expected = sum(pipe.decode(p) for p in payloads)
    param = torch.nn.Parameter(torch.zeros(30, 40))
    param.grad = torch.full((30, 40), 5.0)
    storage = param.grad.data_ptr()
    got = pipe.decode_sum(payloads, expected_shape=(30, 40), out=param.grad)
    assert got is param.grad and param.grad.data_ptr() == storage
    torch.testing.assert_close(param.grad, expected, rtol=0, atol=0)
    strided = torch.zeros(40, 30).t()  # not contiguous: filled by one copy
    pipe.decode_sum(payloads, out=strided)
    torch.testing.assert_close(strided, expected, rtol=0, atol=0)
    single = torch.empty(30, 40)
    assert pipe.decode(payloads[0], out=single) is single
    torch.testing.assert_close(single, pipe.decode(payloads[0]), rtol=0, atol=0)


def test_decode_sum_out_of_the_wrong_size_is_refused():
    pipe = deepreduce.torch.build(CONFIG)
    payload = pipe.encode(torch.randn(30, 40), name="w")
    with pytest.raises(deepreduce.CommunicationError, match="elements"):
        pipe.decode_sum([payload], out=torch.zeros(10))
    assert isinstance(pipe, TorchPipeline)
