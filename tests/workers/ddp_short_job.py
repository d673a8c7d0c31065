"""Worker: a short DDP job with deepreduce's hook that ends the way a training script does (no
explicit clean-up), so the interpreter's exit tears down the hook's worker and process group.
Rank and world come from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from deepreduce.torch import ddp

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
ddp.register(model, "topk_raw")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
print(f"OK {dist.get_rank()}", flush=True)
