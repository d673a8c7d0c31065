"""Worker: the ``nonfinite`` policy and a caught encode error over every route of the DDP hook's
step engine (the DDP twin of workers/torch_engine_policies.py; gloo, torch.multiprocessing spawn).

For each route (allgather, sparse_allreduce, dense, fp16, entries, summable) and policy:

* ``nan``: rank 1's gradient of ``0.weight`` is NaN at step 1. Under ``propagate`` no rank raises,
  every rank applies the NaN and counts it in ``compression_stats()["nonfinite_propagated"]``;
  under ``raise`` every rank's backward raises the same NonFiniteGradientError (DDP wraps it in a
  RuntimeError carrying its text), nothing is applied and every residual (the sparse all-reduce's
  owner residuals too) is as before the step.
* ``encode_error``: rank 1's route raises while starting the bucket of ``0.weight`` at step 3.
  Rank 1 reports its own error, every other rank a CommunicationError; nothing is applied.

After each scenario the next step works and every rank holds the same parameters. A summable
compressor has no ``nonfinite`` option: it runs once, and a NaN propagates.
"""

import torch
import torch.distributed as dist
from policy_checks import aggregation, equal, flat, residuals, route_id
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_ddp_hook import run_scenarios

from deepreduce.torch import ddp

TOPK = {"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw", "memory": "residual",
        "min_numel": 0}
ROUTES = ("allgather", "sparse_allreduce", "sparse_allreduce_early", "dense", "fp16", "entries", "summable")


def make(route, policy):
    """(DDP model, optimizer, hook state): two or more buckets, ``0.weight`` in one of them."""
    torch.manual_seed(0)
    if route == "entries":
        net = torch.nn.Sequential(torch.nn.EmbeddingBag(40, 16, mode="sum", sparse=True), torch.nn.Linear(16, 3))
    else:
        net = torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.Tanh(), torch.nn.Linear(48, 3))
    model = DDP(net, bucket_cap_mb=0.001)
    if route == "summable":
        compression = ddp.FP16Compressor()
    else:
        compression = dict(TOPK, nonfinite=policy)
        compression.update(aggregation(route))
    state = ddp.register(model, compression)
    if route in ("dense", "fp16"):   # what the auto plan chooses for a bucket that hides behind backward
        state._engine.protocol.route = lambda name: route
    return model, torch.optim.SGD(model.parameters(), lr=0.05), state


def batch(route, step):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    if route == "entries":
        return torch.randint(0, 40, (6, 4), generator=g)
    return torch.randn(6, 8, generator=g)


def step(model, opt, route, i):
    """One training step; the text of what backward raised (DDP's RuntimeError), or None."""
    opt.zero_grad()
    try:
        model(batch(route, i)).square().sum().backward()
    except RuntimeError as exc:
        return str(exc).split("\nAt:")[0]
    opt.step()
    return None


def same_on_every_rank(tensor):
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, torch.nan_to_num(tensor, nan=7.0))
    return all(torch.equal(everyone[0], row) for row in everyone)


def nan_scenario(route, policy):
    model, opt, state = make(route, policy)
    target = model.module[0].weight
    poison = {"on": False}
    target.register_hook(lambda g: g * float("nan") if poison["on"] and dist.get_rank() == 1 else g)
    step(model, opt, route, 0)
    before, kept = flat(model).clone(), residuals(state.pipeline, state._protocol)
    poison["on"] = True
    raised = step(model, opt, route, 1)
    poison["on"] = False
    out = {"raised": raised, "unchanged": bool(torch.equal(flat(model), before)),
           "residuals_kept": equal(kept, residuals(state.pipeline, state._protocol)), "nan_applied": bool(torch.isnan(target).any()),
           "propagated": state.compression_stats()["nonfinite_propagated"],
           "wire_bytes": state.compression_stats()["wire_bytes"]}
    if policy == "raise":
        out["next"] = step(model, opt, route, 2)
        out["finite_after"] = bool(torch.isfinite(flat(model)).all())
    out["same"] = same_on_every_rank(flat(model))
    state.close()
    return out


def encode_error_scenario(route, policy):
    model, opt, state = make(route, policy)
    real = state._engine.routes[route_id(route)].start
    armed = {"on": False}

    def start(engine, item):
        if armed["on"] and dist.get_rank() == 1 and "0.weight" in [part[0] for part in item.parts]:
            raise ValueError("injected encode failure")
        return real(engine, item)
    state._engine.routes[route_id(route)].start = start
    for i in range(3):
        step(model, opt, route, i)
    before, kept = flat(model).clone(), residuals(state.pipeline, state._protocol)
    armed["on"] = True
    raised = step(model, opt, route, 3)
    armed["on"] = False
    out = {"raised": raised, "unchanged": bool(torch.equal(flat(model), before)),
           "residuals_kept": equal(kept, residuals(state.pipeline, state._protocol)), "next": step(model, opt, route, 4)}
    out.update(finite_after=bool(torch.isfinite(flat(model)).all()), same=same_on_every_rank(flat(model)))
    state.close()
    return out


def every_route(rank):
    """Every route and policy: ``{(scenario, route, policy): result}``."""
    results = {}
    for route in ROUTES:
        for policy in (("propagate",) if route == "summable" else ("propagate", "raise")):
            results[("nan", route, policy)] = nan_scenario(route, policy)
            results[("encode_error", route, policy)] = encode_error_scenario(route, policy)
    return results


def run(rank, world, port, queue):
    """Puts ``(rank, {"every_route": {(scenario, route, policy): result}})`` on ``queue``."""
    run_scenarios(rank, world, port, queue, [every_route], 300)
