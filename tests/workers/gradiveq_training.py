"""2-rank GradiVeQ training: ranks stay identical, the loss falls, codes really travel.

Usage: gradiveq_training.py horovod|deepreduce  (which DistributedOptimizer wraps SGD).
Prints "OK <json>" on every rank when all checks pass.
"""
import json
import sys

import horovod.torch as hvd
import torch

from deepreduce.torch.gradiveq import GradiVeQ

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
which = sys.argv[1]

model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
    torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 4),
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

# a fixed task: labels from a random teacher; every rank draws its own batches
gen = torch.Generator().manual_seed(123)
teacher = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
for p in teacher.parameters():
    p.data = torch.randn(p.shape, generator=gen)
data_gen = torch.Generator().manual_seed(1000 + hvd.rank())

compressor = GradiVeQ(warmup=5, sample_iters=12, compress_iters=40, min_numel=256)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
if which == "horovod":
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compressor)
else:
    import deepreduce.torch as drt

    opt = drt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compressor)

losses = []
for step in range(5 + 12 + 40):
    x = torch.randn(32, 3, 8, 8, generator=data_gen)
    with torch.no_grad():
        y = teacher(x).argmax(1)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses.append(float(hvd.allreduce(loss.detach(), name="loss")))

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = hvd.allgather(flat.unsqueeze(0))
identical = bool(torch.equal(gathered[0], gathered[1]))
stats = compressor.compression_stats()
first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
compress_start = sum(losses[17:25]) / 8      # the first steps that send PCA codes
result = {"rank": hvd.rank(), "identical": identical, "first": first, "compress_start": compress_start, "last": last,
          "compressed": stats["compressed"], "trainings": stats["trainings"], "ratio": stats["ratio"],
          "dims": stats["dims"]}
ok = identical and last < 0.9 * first and last < compress_start and stats["compressed"] >= 2 * 40 and stats["trainings"] == 2
print(("OK " if ok else "FAIL ") + json.dumps(result), flush=True)
sys.exit(0 if ok else 1)
