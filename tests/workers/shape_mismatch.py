"""Worker: ranks that disagree on a tensor's shape get a CommunicationError naming it, not a hang."""
import torch
import horovod.torch as hvd

import deepreduce.torch as drt
from deepreduce import CommunicationError

hvd.init()
width = 10 + hvd.rank()           # rank 1's layer is wider: a programming error on purpose
model = torch.nn.Linear(width, 1, bias=False)
opt = drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression="configs/none_raw.yaml")
model(torch.ones(2, width)).sum().backward()
try:
    opt.step()
except CommunicationError as exc:
    assert "'weight'" in str(exc) and "expected" in str(exc), str(exc)
    print(f"OK {hvd.rank()} {exc}", flush=True)
else:
    raise SystemExit("no error for mismatched shapes")
