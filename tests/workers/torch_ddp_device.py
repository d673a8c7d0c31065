"""Ranks training a DDP model whose parameters live on ``device`` (cpu, or cuda:0 shared by the
ranks), the deepreduce hook on the torch device path (``path="device"``): codecs on the gradients'
device; over gloo the containers go to the host for the collective, over NCCL (one rank per GPU,
so one rank on a one-GPU machine) they stay on the GPU.

``run(rank, world, port, queue, device, backend)`` puts ``(rank, results)`` on the queue;
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

from deepreduce.torch import DiLoCo, ddp  # noqa: E402

TOPK_BLOOM = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "bloom", "policy": "p0"},
              "value": "raw", "memory": "residual", "min_numel": 0}   # every parameter compressed


def make(device, compression=None, seed=0, per_parameter=True, bucket_cap_mb=0.02):
    """(DDP model on ``device``, SGD, hook state or None): the same seed gives the same start."""
    torch.manual_seed(seed)
    net = Net().to(device)
    model = DDP(net, bucket_cap_mb=bucket_cap_mb, device_ids=[device.index] if device.type == "cuda" else None)
    state = None if compression is None else ddp.register(model, compression, path="device",
                                                           per_parameter=per_parameter)
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


def diloco_on(device, rank):
    """DiLoCo over the same group, the model on ``device``: semisync_1bit pseudo-gradients every 2
    inner steps, streamed in 2 fragments applied 1 step late (the collective in the background);
    θ_global after 6 inner steps, where the globals live, and each step's loss."""
    torch.manual_seed(1)
    net = Net().to(device)
    inner = torch.optim.AdamW(net.parameters(), lr=1e-3)
    outer = torch.optim.SGD(net.parameters(), lr=1.0)
    diloco = DiLoCo(net, inner, outer, sync_every=2, compression="semisync_1bit", fragments=2, delay=1)
    losses = []
    with diloco:
        for step in range(6):
            x, y = batch(rank, step)
            loss = nn.functional.cross_entropy(net(x.to(device)), y.to(device))
            loss.backward()
            inner.step()
            inner.zero_grad()
            losses.append(float(loss))
    diloco.close()
    devices = sorted({g.device.type for g in diloco.globals})
    return (torch.cat([g.reshape(-1) for g in diloco.globals]).cpu().numpy().copy(), devices, losses,
            diloco.stats()["outer_steps"])


def flat(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy().copy()


# the sparse all-reduce without re-selection: the exact union of every rank's entries (alltoall)
EXACT_SRA = dict(LOSSLESS, sparsifier={"id": "topk", "ratio": 1.0}, min_numel=0,
                 aggregation={"id": "sparse_allreduce", "reselect": "none"})


def run(rank, world, port, queue, device_name, backend="gloo"):
    watchdog.arm(200)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    results = {}
    try:
        reference, ref_opt, _ = make(device)
        train(reference, ref_opt, rank, device)
        lossless, opt, _ = make(device, LOSSLESS)
        train(lossless, opt, rank, device)
        exact, exact_opt, _ = make(device, EXACT_SRA)
        train(exact, exact_opt, rank, device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sparse, sparse_opt, state = make(device, TOPK_BLOOM)
            losses = train(sparse, sparse_opt, rank, device, steps=6)
            # a container per bucket, DDP's default 25 MB buckets: the whole model in one
            bucketed, bucketed_opt, _ = make(device, TOPK_BLOOM, per_parameter=False, bucket_cap_mb=25)
            bucketed_losses = train(bucketed, bucketed_opt, rank, device, steps=6)
        diloco_globals, diloco_devices, diloco_losses, outer_steps = diloco_on(device, rank)
        results = {"diloco_globals": diloco_globals, "diloco_devices": diloco_devices, "diloco_losses": diloco_losses,
                   "diloco_outer_steps": outer_steps,
                   "lossless_max_diff": float(np.abs(flat(lossless) - flat(reference)).max()),
                   "sparse_allreduce_max_diff": float(np.abs(flat(exact) - flat(reference)).max()),
                   "sparse_params": flat(sparse), "sparse_losses": losses,
                   "bucketed_params": flat(bucketed), "bucketed_losses": bucketed_losses,
                   "param_devices": sorted({p.device.type for p in sparse.parameters()}),
                   "pipeline_path": state.pipeline.path,
                   "host_fallback_warnings": [str(w.message) for w in caught if "host" in str(w.message)]}
    finally:
        queue.put((rank, results))
        watchdog.disarm()
        dist.destroy_process_group()
