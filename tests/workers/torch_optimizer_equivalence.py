"""Worker: a few DistributedOptimizer steps with a lossless config, checked against one process.

Every rank trains on its own batch. Afterwards the ranks compare parameters (they must be
identical) and rank 0 replays the same steps in a single process on the averaged gradient;
the result must match to float tolerance. Prints "OK <rank> <wire bytes>" on success.
"""
import sys

import horovod.torch as hvd
import numpy as np
import torch

import deepreduce.torch as drt

CONFIG = sys.argv[1] if len(sys.argv) > 1 else "configs/none_raw.yaml"
STEPS = 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))


def batch(rank, step):
    rng = np.random.default_rng([rank, step])
    return torch.from_numpy(rng.standard_normal((8, 20)).astype(np.float32)), torch.from_numpy(rng.integers(0, 5, 8))


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def main():
    hvd.init()
    torch.set_num_threads(1)
    model = make_model()
    opt = drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=CONFIG)
    assert isinstance(opt, torch.optim.SGD)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, *batch(hvd.rank(), step)).backward()
        opt.step()
    flat = torch.cat([p.detach().ravel() for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="check_params")
    assert torch.equal(gathered[0], gathered[-1]), "ranks diverged"

    if hvd.rank() == 0:
        ref = make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            grads = []
            for r in range(hvd.size()):
                ref.zero_grad()
                loss_of(ref, *batch(r, step)).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            for i, p in enumerate(ref.parameters()):
                p.grad = sum(g[i] for g in grads) / hvd.size()
            ref_opt.step()
        ref_flat = torch.cat([p.detach().ravel() for p in ref.parameters()])
        assert torch.allclose(flat, ref_flat, rtol=1e-5, atol=1e-6), float((flat - ref_flat).abs().max())
    stats = opt.compression_stats()
    assert stats["steps"] == STEPS and stats["wire_bytes"] > 0
    print(f"OK {hvd.rank()} {stats['wire_bytes']}", flush=True)


if __name__ == "__main__":
    main()
