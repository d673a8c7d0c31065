"""Worker: one rank's encode error, caught by the user, leaves no rank out of phase.

At step 1 rank 1's float64 gradient holds finite values beyond float32's range, so its encode
raises NonFiniteGradientError. The rank still takes part in the step's collectives (it sends a
failure payload), every rank raises the same error type from ``step()``, the loop of the README's
skip-the-step pattern goes on, and the next steps work and keep the ranks identical."""
import horovod.torch as hvd
import torch

import deepreduce.torch as drt
from deepreduce.errors import NonFiniteGradientError

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Tanh(), torch.nn.Linear(300, 2)).double()
opt = drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                               compression={"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw",
                                            "value": "raw", "memory": "residual", "min_numel": 0})
skipped = []
for step in range(4):
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 10 + hvd.rank()))
    loss = model(x).square().sum()
    if step == 1 and hvd.rank() == 1:
        loss = loss * 1e300
    try:
        loss.backward()
        opt.step()
    except NonFiniteGradientError as exc:
        assert "float32" in str(exc), str(exc)
        skipped.append(step)
    opt.zero_grad()
assert skipped == [1], skipped
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = hvd.allgather(flat[None, :])
assert torch.equal(everyone[0], everyone[1])
print(f"OK caught_error {hvd.rank()}", flush=True)
