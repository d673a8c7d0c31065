"""bf16 models outside FSDP: the DDP comm hook over gloo ranks (``run_ddp``, torch.multiprocessing
spawn; tests/test_torch_bf16.py) and the Horovod optimizer (``python torch_bf16.py`` under
horovodrun, prints ``OK <check> <rank>`` per passed check).

The model is in bfloat16, so its gradients (DDP's buckets, ``p.grad``) are bf16. deepreduce
sums in float32 and writes bf16: with a lossless config every rank's gradient equals the
ranks' bf16 gradients summed in float32, divided by the number of ranks in float32 and rounded
once to bf16, bit for bit (with 2 ranks the float32 sum of two bf16 values is exact unless
their exponents lie more than 16 apart, and equal either way); a lossy config trains, and the
ranks keep identical parameters. Run on 3 ranks: with 2, a bf16 sum divided by 2 equals the
float32 average rounded once, so the check could not tell float32 accumulation from bf16.
"""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LOSSLESS = {"sparsifier": {"id": "none"}, "index": {"id": "raw"}, "value": {"id": "raw"}, "memory": {"id": "none"}}
LOSSY = {"sparsifier": {"id": "topk", "ratio": 0.1}, "index": {"id": "raw"}, "value": {"id": "raw"},
         "memory": {"id": "residual"}}
SPARSE_ALLREDUCE = dict(LOSSLESS, sparsifier={"id": "topk", "ratio": 1.0},
                        aggregation={"id": "sparse_allreduce", "reselect": "none"})
STEPS = 3


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)).to(torch.bfloat16)


def batch(rank, step):
    rng = np.random.default_rng([rank, step % 2])   # two batches per rank, in turn: a lossy run learns them
    x = torch.from_numpy(rng.standard_normal((8, 20)).astype(np.float32)).to(torch.bfloat16)
    return x, torch.from_numpy(rng.integers(0, 5, 8))


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def local_grads(model, rank, step):
    """This rank's own bf16 gradients of ``model`` at ``step`` (a copy: no communication)."""
    import copy
    twin = copy.deepcopy(model)
    twin.zero_grad()
    loss_of(twin, *batch(rank, step)).backward()
    return [p.grad.detach().clone() for p in twin.parameters()]


def expected_average(grads_of_ranks):
    """Each parameter's bf16 gradients of every rank summed in float32 in rank order, divided by
    the number of ranks in float32, rounded once to bf16."""
    n = len(grads_of_ranks)
    out = []
    for parts in zip(*grads_of_ranks):
        total = torch.zeros_like(parts[0], dtype=torch.float32)
        for g in parts:
            total += g.float()
        out.append((total / np.float32(n)).to(torch.bfloat16))
    return out


# ------------------------------------------------------------------ DDP (gloo, spawn)
def ddp_train(config, rank, steps=STEPS, per_parameter=True, lr=0.05):
    """DDP with the deepreduce hook (``config``; None: DDP's own all-reduce): per step the
    gradients DDP left (bf16) and what the lossless average should be; the losses."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from deepreduce.torch import ddp

    model = DDP(make_model(), bucket_cap_mb=0.01)
    state = None if config is None else ddp.register(model, config, per_parameter=per_parameter)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads, expected, losses = [], [], []
    world = dist.get_world_size()
    for step in range(steps):
        mine = local_grads(model.module, rank, step)
        gathered = []
        for g in mine:
            parts = [torch.empty_like(g, dtype=torch.float32) for _ in range(world)]
            dist.all_gather(parts, g.float())
            gathered.append([p.to(torch.bfloat16) for p in parts])
        expected.append(expected_average([list(x) for x in zip(*gathered)]))
        opt.zero_grad()
        loss = loss_of(model, *batch(rank, step))
        loss.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        losses.append(float(loss.detach()))
        opt.step()
    params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).numpy()
    if state is not None:
        state.close()
    return grads, expected, losses, params


def scenario_ddp_bf16(rank):
    out = {}
    for label, config, per_parameter in (("lossless", LOSSLESS, True), ("lossless_merged", LOSSLESS, False),
                                         ("sparse_allreduce", SPARSE_ALLREDUCE, True)):
        grads, expected, _, _ = ddp_train(config, rank, per_parameter=per_parameter)
        out[label] = {"dtypes": sorted({str(g.dtype) for step in grads for g in step}),
                      "equal": all(torch.equal(a, b) for s, e in zip(grads, expected) for a, b in zip(s, e)),
                      "largest": max(float((a.float() - b.float()).abs().max())
                                     for s, e in zip(grads, expected) for a, b in zip(s, e))}
    own, _, _, _ = ddp_train(None, rank)   # DDP's own all-reduce of the bf16 bucket (summed in bf16)
    ours, _, _, _ = ddp_train(LOSSLESS, rank)
    pairs = [(a.float(), b.float()) for s, e in zip(ours, own) for a, b in zip(s, e)]
    out["own"] = {"close": all(torch.allclose(a, b, rtol=2 ** -7, atol=1e-6) for a, b in pairs),
                  "equal": all(torch.equal(a, b) for a, b in pairs)}
    _, _, losses, params = ddp_train(LOSSY, rank, steps=30, lr=0.5)
    gathered = [np.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, params)
    out["lossy"] = {"losses": losses, "replicas_equal": all(np.array_equal(gathered[0], g) for g in gathered)}
    return out


def run_ddp(rank, world, port, queue):
    import warnings

    from torch_ddp_hook import run_scenarios

    from deepreduce.sparsify.basic import DenseGradientWarning

    warnings.filterwarnings("ignore", category=DenseGradientWarning)   # the lossless configs send dense layers
    run_scenarios(rank, world, port, queue, [scenario_ddp_bf16], 150)


# ------------------------------------------------------------------ Horovod (horovodrun)
def horovod_train(hvd, label, config, steps=STEPS, lr=0.05):
    """The DistributedOptimizer on the bf16 model: per step the gradients it left and the
    lossless average they should be; the losses; the ranks' parameters (gathered)."""
    import deepreduce.torch as drt

    model = make_model()
    opt = drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), compression=config)
    grads, expected, losses = [], [], []
    for step in range(steps):
        mine = local_grads(model, hvd.rank(), step)
        gathered = [hvd.allgather(g.float().unsqueeze(0), name=f"check.{label}.{step}.{i}") for i, g in enumerate(mine)]
        expected.append(expected_average([[g[r].to(torch.bfloat16) for g in gathered] for r in range(hvd.size())]))
        opt.zero_grad()
        loss = loss_of(model, *batch(hvd.rank(), step))
        loss.backward()
        opt.step()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        losses.append(float(loss.detach()))
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    replicas = hvd.allgather(flat.unsqueeze(0), name=f"check.params.{label}")
    return grads, expected, losses, replicas


def main():
    import warnings

    import horovod.torch as hvd

    from deepreduce.sparsify.basic import DenseGradientWarning

    warnings.filterwarnings("ignore", category=DenseGradientWarning)   # the lossless configs send dense layers
    import watchdog

    watchdog.arm(200)
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    for label, config in (("lossless", LOSSLESS), ("sparse_allreduce", SPARSE_ALLREDUCE)):
        grads, expected, _, replicas = horovod_train(hvd, label, config)
        assert all(g.dtype == torch.bfloat16 for step in grads for g in step), "gradients left bf16"
        for step, (got, want) in enumerate(zip(grads, expected)):
            for i, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), (label, step, i, float((a.float() - b.float()).abs().max()))
        assert all(torch.equal(replicas[0], r) for r in replicas)
        print(f"OK {label} {rank}", flush=True)
    _, _, losses, replicas = horovod_train(hvd, "lossy", LOSSY, steps=30, lr=0.5)
    assert all(np.isfinite(losses)) and sum(losses[-4:]) < 0.9 * sum(losses[:4]), losses
    assert all(torch.equal(replicas[0], r) for r in replicas)
    print(f"OK lossy {rank}", flush=True)
    watchdog.disarm()


if __name__ == "__main__":
    main()
