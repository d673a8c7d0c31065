"""Horovod's own usage patterns with deepreduce's optimizer in place of Horovod's (one rank).

``python torch_horovod_patterns.py <scenario> <folder>`` under mpirun; each rank writes its
result to ``<folder>/rank<r>.json``. The config is lossless, so every difference from Horovod is a behaviour:

- ``resume``: rank 0 resumes optimizer state from a checkpoint, the others start fresh, then
  ``hvd.broadcast_optimizer_state`` (SGD momentum, Adam, Adagrad) must return quickly, leave the
  ranks with equal state, and training must go on equal to ``hvd.DistributedOptimizer``'s.
- ``synchronize``: ``step()`` after ``synchronize()`` without ``skip_synchronize()`` warns once.
- ``sparse``: ``nn.Embedding(sparse=True)`` / ``EmbeddingBag(sparse=True)`` with SparseAdam and
  with SGD: the gradients travel as entries and equal Horovod's sparse allgather exactly
  (``sparse_as_dense=True`` too); a Top-r config still trains the ranks alike, also with error
  feedback, whose residual stays sparse.
- ``process_set`` (3 ranks): ranks 0 and 1 form the set; rank 2 is outside it and applies its own
  gradient, as with Horovod.

A rank that hangs prints its stacks and exits (``watchdog.arm``).
"""
import json
import os
import sys
import time
import warnings

import horovod.torch as hvd
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import watchdog  # noqa: E402

import deepreduce.torch as drt  # noqa: E402

OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 4))


def train_step(net: nn.Module, opt, rank: int, i: int) -> None:
    g = torch.Generator().manual_seed(100 * i + rank)
    x, y = torch.randn(16, 40, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()


def flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def state_tensors(opt) -> torch.Tensor:
    parts = [v.reshape(-1).float() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return torch.cat(parts) if parts else torch.zeros(0)


def same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = hvd.allgather_object(t)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def checkpoint(kind: str):
    """A checkpoint of a run that took 3 local steps: (model state, optimizer state)."""
    net = model()
    opt = OPTIMIZERS[kind](net.parameters())
    for i in range(3):
        train_step(net, opt, 0, i)
    return net.state_dict(), opt.state_dict()


def resume(kind: str, wrap) -> dict:
    """Horovod's resume pattern: rank 0 loads the checkpoint, then both broadcasts."""
    net = model(seed=hvd.rank() + 1)   # the broadcast must make the ranks equal
    opt = wrap(OPTIMIZERS[kind](net.parameters()), net)
    if hvd.rank() == 0:
        net_state, opt_state = checkpoint(kind)
        net.load_state_dict(net_state)
        opt.load_state_dict(opt_state)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    start = time.perf_counter()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    seconds = time.perf_counter() - start
    agree = same_on_every_rank(state_tensors(opt))
    for i in range(3, 5):
        train_step(net, opt, hvd.rank(), i)
    return {"seconds": seconds, "state_agrees": agree, "params": flat(net), "state": state_tensors(opt)}


def scenario_resume() -> dict:
    out = {}
    for kind in OPTIMIZERS:
        ours = resume(kind, lambda o, net: drt.DistributedOptimizer(o, named_parameters=net.named_parameters(),
                                                                    compression="none_raw"))
        theirs = resume(kind, lambda o, net: hvd.DistributedOptimizer(o, named_parameters=net.named_parameters()))
        out[kind] = {"seconds": ours["seconds"], "state_agrees": ours["state_agrees"],
                     "params_agree": same_on_every_rank(ours["params"]),
                     "equals_horovod": torch.equal(ours["params"], theirs["params"])
                     and torch.equal(ours["state"], theirs["state"])}
    # a fresh start: every rank initialises its state locally, then the broadcast
    net = model(seed=hvd.rank() + 1)
    opt = drt.DistributedOptimizer(OPTIMIZERS["adam"](net.parameters()), named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    train_step(net, opt, hvd.rank(), 0)
    out["fresh_params_agree"] = same_on_every_rank(flat(net))
    return out


def scenario_synchronize() -> dict:
    net = model()
    opt = drt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            g = torch.Generator().manual_seed(i + hvd.rank())
            opt.zero_grad()
            net(torch.randn(4, 40, generator=g)).sum().backward()
            opt.synchronize()
            opt.step()     # without skip_synchronize(): warns (once), reduces again, goes on
    messages = [str(w.message) for w in caught if "skip_synchronize" in str(w.message)]
    return {"warnings": len(messages), "params_agree": same_on_every_rank(flat(net))}


SPARSE_CASES = {
    "embedding_sparse_adam": (lambda: nn.Embedding(1000, 16, sparse=True),
                              lambda params: torch.optim.SparseAdam(params, lr=0.01), {}),
    "embedding_bag_sgd": (lambda: nn.EmbeddingBag(1000, 16, mode="sum", sparse=True),
                          lambda params: torch.optim.SGD(params, lr=0.1), {}),
    "embedding_sgd_sparse_as_dense": (lambda: nn.Embedding(1000, 16, sparse=True),
                                      lambda params: torch.optim.SGD(params, lr=0.1), {"sparse_as_dense": True}),
}


def sparse_training(layer, make_opt, wrap, steps: int = 3):
    """(parameters after ``steps`` steps, the first step's reduced gradient (dense), whether the
    optimizer got it sparse)."""
    torch.manual_seed(0)
    net = layer()
    opt = wrap(make_opt(net.parameters()), net)
    for i in range(steps):
        g = torch.Generator().manual_seed(10 * i + hvd.rank())
        ids = torch.randint(0, 1000, (8, 4), generator=g)     # repeats within and across ranks
        target = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        out = net(ids) if isinstance(net, nn.EmbeddingBag) else net(ids).sum(1)
        ((out - target) ** 2).sum().backward()
        opt.step()
        if i == 0:
            first, layout = net.weight.grad.coalesce().to_dense(), net.weight.grad.is_sparse
    return flat(net), first, layout


def scenario_sparse() -> dict:
    out = {}
    for label, (layer, make_opt, kwargs) in SPARSE_CASES.items():
        ours, ours_grad, ours_sparse = sparse_training(layer, make_opt, lambda o, net: drt.DistributedOptimizer(
            o, named_parameters=net.named_parameters(), compression="none_raw", **kwargs))
        theirs, theirs_grad, theirs_sparse = sparse_training(layer, make_opt, lambda o, net: hvd.DistributedOptimizer(
            o, named_parameters=net.named_parameters(), **kwargs))
        # Horovod hands SGD its allgathered entries uncoalesced, and SGD adds repeated rows one
        # by one, ours summed: the parameters may differ in the last bit there (SparseAdam
        # coalesces first), the reduced gradient is the same
        out[label] = {"grad_equals_horovod": torch.equal(ours_grad, theirs_grad),
                      "params_equal_horovod": torch.equal(ours, theirs),
                      "params_max_diff": float((ours - theirs).abs().max()), "grad_sparse": [ours_sparse, theirs_sparse]}
    topk = {"sparsifier": {"id": "topk", "ratio": 0.25}, "index": "delta", "value": "raw", "memory": "none"}
    params, _, _ = sparse_training(SPARSE_CASES["embedding_sparse_adam"][0], SPARSE_CASES["embedding_sparse_adam"][1],
                                lambda o, net: drt.DistributedOptimizer(o, named_parameters=net.named_parameters(),
                                                                        compression=topk))
    out["topk_params_agree"] = same_on_every_rank(params)
    # error feedback on a sparse gradient: the residual stays sparse, the ranks stay alike
    made = []
    params, _, _ = sparse_training(SPARSE_CASES["embedding_sparse_adam"][0], SPARSE_CASES["embedding_sparse_adam"][1],
                                lambda o, net: made.append(drt.DistributedOptimizer(
                                    o, named_parameters=net.named_parameters(),
                                    compression=dict(topk, memory="residual"))) or made[0])
    from deepreduce.memory import SparseResidual

    held = made[0]._reduction.pipeline.core.memory._residuals["weight"]
    out["residual_params_agree"] = same_on_every_rank(params)
    out["residual_sparse_entries"] = int(held.positions.shape[0]) if isinstance(held, SparseResidual) else -1
    return out


def scenario_process_set() -> dict:
    members = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[members])    # re-initialising with the set is Horovod's documented way
    out = {}
    for label, wrap in (("ours", lambda o, net: drt.DistributedOptimizer(
            o, named_parameters=net.named_parameters(), process_set=members)),
                        ("horovod", lambda o, net: hvd.DistributedOptimizer(
                            o, named_parameters=net.named_parameters(), process_set=members)),
                        ("local", lambda o, net: o)):
        net = model()
        opt = wrap(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), net)
        for i in range(3):
            train_step(net, opt, hvd.rank(), i)
        out[label] = flat(net)
        hvd.allreduce(torch.zeros(1), name=f"done.{label}")   # Horovod stops when any rank finishes
    return {"member": bool(members.included()), "equals_horovod": torch.equal(out["ours"], out["horovod"]),
            "equals_local": torch.equal(out["ours"], out["local"])}


def main() -> None:
    watchdog.arm(float(os.environ.get("DEEPREDUCE_TEST_HANG_SECONDS", "120")))
    scenario = sys.argv[1]
    if scenario != "process_set":
        hvd.init()
    torch.set_num_threads(1)
    result = globals()[f"scenario_{scenario}"]()
    with open(os.path.join(sys.argv[2], f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(dict(result, rank=hvd.rank()), f)
    watchdog.disarm()


if __name__ == "__main__":
    main()
