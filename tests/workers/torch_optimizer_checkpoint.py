"""One Horovod rank: DistributedOptimizer.state_dict() saved at step 3, resumed, sends the same bytes at step 4.

Prints one JSON line: whether the resumed optimizer's containers equal the uninterrupted one's,
and whether a resume without the deepreduce part differs (so the state is what made them equal).
"""
import io
import json
import os
import sys

import horovod.torch as hvd
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp_hook import STATEFUL, Net, batch, record_containers  # noqa: E402

import deepreduce.torch as drt  # noqa: E402


def build(seed=0):
    torch.manual_seed(seed)
    model = Net()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, drt.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=STATEFUL)


def step(model, opt, i):
    x, y = batch(hvd.rank(), i)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def resumed_bytes(checkpoint, keep_deepreduce):
    model, opt = build(seed=1)
    model.load_state_dict(checkpoint["model"])
    state = dict(checkpoint["optimizer"])
    if not keep_deepreduce:
        state.pop("deepreduce")
    opt.load_state_dict(state)
    sent = record_containers(opt._reduction.pipeline)
    step(model, opt, 3)
    return sent


def main():
    hvd.init()
    torch.set_num_threads(1)
    model, opt = build()
    for i in range(3):
        step(model, opt, i)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    original = record_containers(opt._reduction.pipeline)
    step(model, opt, 3)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    print(json.dumps({"containers": len(original), "identical": resumed_bytes(checkpoint, True) == original,
                      "without_state_identical": resumed_bytes(checkpoint, False) == original}))


if __name__ == "__main__":
    main()
