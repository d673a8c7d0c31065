"""Two gloo ranks training a DDP model whose parameters live on ``device`` (cpu, or cuda:0 shared by
both ranks), the deepreduce hook on the torch device path (``path="device"``): codecs on the
gradients' device, containers moved to the host only for gloo's collective.

``run(rank, world, port, queue, device)`` puts ``(rank, results)`` on the queue;
tests/test_torch_ddp_device.py checks them.
"""
import os
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import watchdog  # noqa: E402
from torch_ddp_hook import LOSSLESS, Net, batch  # noqa: E402

from deepreduce.torch import ddp  # noqa: E402

TOPK_BLOOM = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "bloom", "policy": "p0"},
              "value": "raw", "memory": "residual"}


def make(device, compression=None, seed=0):
    """(DDP model on ``device``, SGD, hook state or None): the same seed gives the same start."""
    torch.manual_seed(seed)
    net = Net().to(device)
    model = DDP(net, bucket_cap_mb=0.02, device_ids=[device.index] if device.type == "cuda" else None)
    state = None if compression is None else ddp.register(model, compression, path="device")
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state


def train(model, opt, rank, device, steps=4):
    losses = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def flat(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy().copy()


def run(rank, world, port, queue, device_name):
    watchdog.arm(200)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        reference, ref_opt, _ = make(device)
        train(reference, ref_opt, rank, device)
        lossless, opt, _ = make(device, LOSSLESS)
        train(lossless, opt, rank, device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sparse, sparse_opt, state = make(device, TOPK_BLOOM)
            losses = train(sparse, sparse_opt, rank, device, steps=6)
        results = {"lossless_max_diff": float(np.abs(flat(lossless) - flat(reference)).max()),
                   "sparse_params": flat(sparse), "sparse_losses": losses,
                   "param_devices": sorted({p.device.type for p in sparse.parameters()}),
                   "pipeline_path": state.pipeline.path,
                   "host_fallback_warnings": [str(w.message) for w in caught if "host" in str(w.message)]}
    finally:
        queue.put((rank, results))
        watchdog.disarm()
        dist.destroy_process_group()
