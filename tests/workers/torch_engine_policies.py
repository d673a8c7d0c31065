"""Worker: the ``nonfinite`` policy and a caught encode error, over every route of the Horovod
optimizer's step engine, with the same outcome on every route and every rank.

For each route (allgather, sparse_allreduce, dense, fp16, entries, summable) and policy:

* ``nan``: rank 1's gradient of one parameter is NaN at step 1. Under ``propagate`` no rank
  raises, every rank writes the NaN (an AMP scaler would skip the step) and counts it in
  ``compression_stats()["nonfinite_propagated"]``; under ``raise`` every rank raises the same
  NonFiniteGradientError, nothing is applied, and every residual (the sparse all-reduce's owner
  residuals too) is as before the step.
* ``encode_error``: rank 1's route raises while starting one tensor at step 3. Rank 1 raises its
  own error, every other rank a CommunicationError; nothing is applied on any rank, and under
  either policy every residual is as before the step (what a rank compressed away is not lost).

After each scenario the next step works and every rank holds the same parameters. A summable
compressor has no ``nonfinite`` option: it runs once, and a NaN propagates.
"""
import sys

import horovod.torch as hvd
import torch
import watchdog
from policy_checks import aggregation, equal, flat, residuals, route_id

import deepreduce.torch as drt
from deepreduce.errors import CommunicationError, NonFiniteGradientError
from deepreduce.torch.summable import FP16Compressor

TOPK = {"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw", "memory": "residual",
        "min_numel": 0}
ROUTES = ("allgather", "sparse_allreduce", "sparse_allreduce_early", "dense", "fp16", "entries", "summable")


def model(route):
    torch.manual_seed(0)
    if route == "entries":
        return torch.nn.Sequential(torch.nn.EmbeddingBag(40, 16, mode="sum", sparse=True), torch.nn.Linear(16, 3))
    return torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.Tanh(), torch.nn.Linear(48, 3))


def batch(route, step):
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    if route == "entries":
        return torch.randint(0, 40, (6, 4), generator=g)
    return torch.randn(6, 8, generator=g)


def optimizer(route, policy, net):
    if route == "summable":
        compression = FP16Compressor()
    else:
        compression = dict(TOPK, nonfinite=policy)
        compression.update(aggregation(route))
    opt = drt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                                   named_parameters=net.named_parameters(), compression=compression)
    if route in ("dense", "fp16"):   # what the auto plan chooses for a tensor that hides behind backward
        opt._reduction.engine.protocol.route = lambda name: route
    return opt


def same_on_every_rank(tensor):
    everyone = hvd.allgather(torch.nan_to_num(tensor, nan=7.0)[None, :])
    return all(torch.equal(everyone[0], row) for row in everyone)


def step(net, opt, route, i):
    x = batch(route, i)
    loss = net(x).square().sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def nan_scenario(route, policy):
    net = model(route)
    opt = optimizer(route, policy, net)
    target = net[0].weight   # the embedding's sparse gradient on the entries route
    poison = {"on": False}
    target.register_hook(lambda g: g * float("nan") if poison["on"] and hvd.rank() == 1 else g)
    step(net, opt, route, 0)
    before, kept = flat(net).clone(), residuals(opt._reduction.pipeline, opt._reduction.protocol)
    poison["on"] = True
    try:
        step(net, opt, route, 1)
        raised = None
    except NonFiniteGradientError as exc:
        raised = exc
    poison["on"] = False
    if policy == "raise":
        assert raised is not None and "'0.weight'" in str(raised), (route, raised)
        assert torch.equal(flat(net), before), route
        after = residuals(opt._reduction.pipeline, opt._reduction.protocol)
        assert kept.keys() == after.keys() and all(equal(kept[k], after[k]) for k in kept), route
        step(net, opt, route, 2)
        assert torch.isfinite(flat(net)).all(), route
    else:
        assert raised is None, (route, raised)
        assert torch.isnan(target).any(), route
        assert opt.compression_stats()["nonfinite_propagated"] >= 1, route
    assert same_on_every_rank(flat(net)), (route, policy)


def encode_error_scenario(route, policy):
    net = model(route)
    opt = optimizer(route, policy, net)
    real = opt._reduction.engine.routes[route_id(route)].start
    armed = {"on": False}

    def start(engine, item):
        if armed["on"] and hvd.rank() == 1 and item.name == "0.weight":
            raise RuntimeError("injected encode failure")
        return real(engine, item)
    opt._reduction.engine.routes[route_id(route)].start = start
    for i in range(3):
        step(net, opt, route, i)
    before, kept = flat(net).clone(), residuals(opt._reduction.pipeline, opt._reduction.protocol)
    armed["on"] = True
    try:
        step(net, opt, route, 3)
        raised = None
    except Exception as exc:   # noqa: BLE001 (which one is the point)
        raised = exc
    armed["on"] = False
    expected = RuntimeError if hvd.rank() == 1 else CommunicationError
    assert isinstance(raised, expected), (route, policy, repr(raised))
    assert torch.equal(flat(net), before), route
    after = residuals(opt._reduction.pipeline, opt._reduction.protocol)   # nothing sent is lost
    assert kept.keys() == after.keys() and all(equal(kept[k], after[k]) for k in kept), (route, policy)
    step(net, opt, route, 4)
    assert torch.isfinite(flat(net)).all() and same_on_every_rank(flat(net)), (route, policy)


def main():
    hvd.init()
    watchdog.arm(240)
    routes = sys.argv[1:] or ROUTES
    for route in routes:
        for policy in (("propagate",) if route == "summable" else ("propagate", "raise")):
            nan_scenario(route, policy)
            print(f"OK nan {route} {policy} {hvd.rank()}", flush=True)
            encode_error_scenario(route, policy)
            print(f"OK encode_error {route} {policy} {hvd.rank()}", flush=True)


main()
