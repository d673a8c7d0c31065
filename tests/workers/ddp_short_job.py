"""Worker: a short DDP job with deepreduce's hook; checks that ``state.close()`` (what runs at
exit) stops the hook's worker thread before it releases the private process group, and that a
closed state is closed for good (a second close does nothing). Rank and world come from the
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from deepreduce.torch import ddp

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
state = ddp.register(model, "topk_raw")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()

order = []
worker, group = state._worker, state._group
original_join, original_destroy = worker.join, dist.destroy_process_group
worker.join = lambda *a, **k: (order.append("worker stopped"), original_join(*a, **k))[1]
dist.destroy_process_group = lambda g=None: (order.append(("group released", g is group)), original_destroy(g))[1]
state.close()
state.close()
dist.destroy_process_group = original_destroy
assert order == ["worker stopped", ("group released", True)], order
assert not worker.is_alive() and state._worker is None and state._group is None
assert not any(t.name == "deepreduce-ddp" for t in threading.enumerate())
rank = dist.get_rank()
dist.destroy_process_group()
print(f"OK {rank}", flush=True)
