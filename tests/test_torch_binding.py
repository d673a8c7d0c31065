"""The PyTorch binding: same bytes as the NumPy core, torch tensors in and out."""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deepreduce
import deepreduce.torch as drt

CONFIGS = [
    {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": "raw", "value": "raw", "memory": "residual"},
    {"sparsifier": {"id": "randomk", "ratio": 0.05}, "index": "raw", "value": "fp16", "memory": "none"},
    {"sparsifier": "none", "index": "raw", "value": "raw", "memory": "none", "min_numel": 0},
]


@pytest.mark.parametrize("config", CONFIGS)
def test_torch_bytes_equal_numpy_bytes(config):
    core, torch_pipe = deepreduce.build(config), drt.build(config)
    for step in range(3):
        g = np.random.default_rng(step).standard_normal((30, 70)).astype(np.float32)
        g[g < 0] = 0
        a = core.encode(g, name="layer", step=step)
        b = torch_pipe.encode(torch.from_numpy(g), name="layer", step=step)
        assert b.dtype == torch.uint8 and b.dim() == 1
        assert a.tobytes() == b.numpy().tobytes()
        out = torch_pipe.decode(b)
        assert out.dtype == torch.float32 and tuple(out.shape) == g.shape
        np.testing.assert_array_equal(out.numpy(), core.decode(a))


def test_torch_pipeline_accepts_other_float_dtypes_and_non_contiguous():
    pipe = drt.build(CONFIGS[2])
    g = torch.randn(20, 10, dtype=torch.float64).t()
    out = pipe.decode(pipe.encode(g, name="t"))
    torch.testing.assert_close(out, g.float())


def _torch_distributed_worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from deepreduce.collective.comm.torch_distributed import TorchDistributedCommunicator

        comm = TorchDistributedCommunicator()
        pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.01 * (rank + 1)}, "index": "raw",
                                 "value": "raw", "memory": "none", "min_numel": 0})
        parts = comm.allgather(pipe.encode(np.full(500, rank + 1, np.float32), name="x", step=0), "x")
        # the torch device path hands the communicator a uint8 tensor: the same containers arrive
        device_pipe = drt.build(pipe, path="device")
        tensor_parts = comm.allgather(device_pipe.encode(torch.full((500,), rank + 1.0), name="x", step=0), "x")
        same = [bytes(p) for p in parts] == [bytes(p) for p in tensor_parts]
        queue.put((rank, [deepreduce.inspect(p)["n"] for p in parts], float(pipe.decode_sum(parts).sum()), same))
    finally:
        dist.destroy_process_group()


def test_torch_distributed_communicator_with_two_spawned_ranks():
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_torch_distributed_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    results = sorted(queue.get() for _ in range(2))
    for rank, counts, total, same in results:
        assert counts == [5, 10]
        assert total == 1 * 5 + 2 * 10
        assert same
