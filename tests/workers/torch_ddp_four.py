"""Four gloo ranks (torch.multiprocessing spawn) through the DDP hook: allgather and the sparse
all-reduce, per parameter and in whole buckets, and a gradient whose selected entries all lie in
one shard (tests/test_torch_ddp_four_ranks.py checks the results).

``run(rank, world, port, queue)`` puts ``(rank, results)`` on the queue. A rank that hangs prints
its stacks and exits (``watchdog.arm``), so the test fails with them instead of waiting.
"""
import os
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp_hook import LOSSLESS, TOPK, flat_params, make, run_scenarios, train  # noqa: E402

from deepreduce.torch import ddp  # noqa: E402

NUMEL, LIVE = 4000, 400   # the probe's parameter; only its first LIVE entries get a gradient


def sparse(config, **aggregation):
    return dict(config, aggregation=dict({"id": "sparse_allreduce", "reselect": "none"}, **aggregation))


def scenario_allgather_and_sparse_allreduce(rank):
    """Plain DDP, the lossless hook, and Top-r by allgather and by the sparse all-reduce without
    re-selection, per parameter and in whole buckets, three steps each."""
    reference, opt, _ = make()
    train(reference, opt, rank, 3)
    lossless, opt, _ = make(LOSSLESS)
    train(lossless, opt, rank, 3)
    out = {"reference": flat_params(reference), "lossless": flat_params(lossless)}
    for per_parameter in (True, False):
        for label, config in (("allgather", TOPK), ("sparse_allreduce", sparse(TOPK, repartition_every=2))):
            model, opt, state = make(config, per_parameter=per_parameter)
            train(model, opt, rank, 3)
            out[(label, per_parameter)] = flat_params(model)
            out[("stats", label, per_parameter)] = state.compression_stats()
    return out


class Probe(nn.Module):
    """One parameter whose gradient is ``x``: non-zero in its first LIVE entries only."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(NUMEL))

    def forward(self, x):
        return (self.weight * x).sum()


def probe_step(model, opt, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.zeros(NUMEL)
    x[:LIVE] = torch.randn(LIVE, generator=g)
    opt.zero_grad()
    model(x).backward()
    opt.step()


def scenario_one_shard(rank):
    """Every selected entry in shard 0 of 4 even shards (the owners of shards 1-3 receive
    nothing), then, after each step's repartition, shards of very uneven lengths: the sparse
    all-reduce without re-selection gives the allgather's parameters exactly."""
    config = dict(TOPK, sparsifier={"id": "topk", "ratio": 0.05})
    out = {}
    for label, compression in (("allgather", config), ("even", sparse(config, repartition_every=1000)),
                               ("repartitioned", sparse(config, repartition_every=1))):
        torch.manual_seed(0)
        model = DDP(Probe())
        state = ddp.register(model, compression)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            probe_step(model, opt, rank, step)
        out[label] = model.module.weight.detach().numpy().copy()
        reducer = state._protocol.sparse
        if reducer is not None:
            out[label + "_bounds"] = reducer.state_dict()["bounds"]["weight"].tolist()
            out[label + "_received"] = dict(reducer.received_bytes)
    return out


SCENARIOS = [scenario_allgather_and_sparse_allreduce, scenario_one_shard]


def run(rank, world, port, queue):
    run_scenarios(rank, world, port, queue, SCENARIOS, 200)
