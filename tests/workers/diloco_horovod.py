"""Worker (horovodrun -np 2): deepreduce.torch.DiLoCo with backend="horovod".

H = 1 with a lossless config and outer SGD at lr 1 equals SGD on the ranks' averaged gradient
(computed here from every rank's batch) within float32 rounding; Top-r with streaming fragments,
a delay and Nesterov outer steps (allgather and the sparse all-reduce) leaves every rank with
identical global parameters after each outer step; ``sync_every="auto"`` probes over Horovod and
every rank adopts the same H. Prints OK."""
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import watchdog  # noqa: E402
from diloco import LOSSLESS, TOPK, TOPK_SPARSE_ALLREDUCE, Net, flat, loss_of  # noqa: E402

from deepreduce.torch import DiLoCo  # noqa: E402

hvd.init()
watchdog.arm(240)
rank, size = hvd.rank(), hvd.size()


def make(compression, sync_every, **kwargs):
    torch.manual_seed(0)
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    momentum = kwargs.pop("momentum", 0.0)
    outer = torch.optim.SGD(model.parameters(), lr=kwargs.pop("lr", 1.0), momentum=momentum, nesterov=momentum > 0)
    return model, inner, DiLoCo(model, inner, outer, sync_every=sync_every, compression=compression,
                                backend="horovod", **kwargs)


# H = 1, lossless: SGD on the averaged gradient
model, inner, diloco = make(LOSSLESS, 1)
torch.manual_seed(0)
reference = Net()
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
with diloco:
    for step in range(5):
        ref_opt.zero_grad()
        sum(loss_of(reference, r, step) for r in range(size)).div(size).backward()
        ref_opt.step()
        inner.zero_grad()
        loss_of(model, rank, step).backward()
        inner.step()
        diff = np.abs(flat(model.parameters()) - flat(reference.parameters())).max()
        assert diff < 1e-6, (step, diff)
diloco.close()

# lossy, streaming, delayed: identical globals on every rank after each outer step
for config in (TOPK, TOPK_SPARSE_ALLREDUCE):
    model, inner, diloco = make(config, 4, fragments=2, delay=1, lr=0.7, momentum=0.9)
    checked = 0
    with diloco:
        for step in range(16):
            applied = diloco.outer_steps
            inner.zero_grad()
            loss_of(model, rank, step).backward()
            inner.step()
            if diloco.outer_steps > applied:
                mine = torch.from_numpy(flat(diloco.globals))
                every = hvd.allgather(mine.unsqueeze(0), name=f"check.{config.get('aggregation')}.{step}")
                assert all(torch.equal(every[0], every[r]) for r in range(size)), step
                checked += 1
    stats = diloco.stats()
    diloco.close()
    assert checked >= 6 and stats["outer_steps"] == checked and stats["received_bytes"] > 0, (checked, stats)

# sync_every="auto" over Horovod: the probe's collectives go through the Horovod transport, every
# rank adopts the same H, and after each outer step every rank holds the same global parameters
model, inner, diloco = make(TOPK, "auto", auto_probe_steps=3, auto_candidates=(2, 4, 8))
outer_at = []
with diloco:
    for step in range(3 + 2 * 8):
        applied = diloco.outer_steps
        inner.zero_grad()
        loss_of(model, rank, step).backward()
        inner.step()
        if diloco.outer_steps > applied:
            outer_at.append(step)
            mine = torch.from_numpy(flat(diloco.globals))
            every = hvd.allgather(mine.unsqueeze(0), name=f"check.auto.{step}")
            assert all(torch.equal(every[0], every[r]) for r in range(size)), step
stats = diloco.stats()
diloco.close()
h = stats["sync_every"]
assert h in (2, 4, 8), stats
every_h = hvd.allgather(torch.tensor([h]), name="check.auto.h")
assert all(int(v) == h for v in every_h), every_h
# the first outer step at the first multiple of H after the 3 probe steps
assert [t + 1 for t in outer_at] == [t for t in range(4, 3 + 2 * 8 + 1) if t % h == 0], (h, outer_at)
decision = stats["sync_period"]
assert decision["link"]["bandwidth"] > 0 and len(decision["compute_s_per_rank"]) == size, decision

watchdog.disarm()
print(f"OK {rank} auto H={h} outer steps at {outer_at}", flush=True)
