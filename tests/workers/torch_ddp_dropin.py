"""PyTorch's own DDP hook patterns with deepreduce's hook (two gloo ranks, torch.multiprocessing spawn).

``run(rank, world, port, queue, names)`` runs the named scenarios and puts ``(rank, results)`` on
the queue; tests/test_torch_ddp_dropin.py checks them. A rank that hangs prints its stacks and
exits (``watchdog.arm``), so the test fails with them instead of waiting.
"""
import copy
import io
import os
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch_ddp_hook import LOSSLESS, TOPK, flat_params, make, run_scenarios, train  # noqa: E402

from deepreduce.torch import ddp  # noqa: E402


def scenario_pickle(rank):
    """``torch.save``/``pickle`` of the hook state mid-training (as PyTorch's PowerSGD state
    test does): the restored state, registered on a model restored from the same checkpoint,
    trains on exactly like the original."""
    model, opt, state = make(TOPK)
    train(model, opt, rank, 2)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    pickled = pickle.dumps(state)
    saved = copy.deepcopy(model.module.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, rank, 2, start=2)

    restored, opt2, _ = make("default")
    restored.module.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ddp.register(restored, state=loaded)
    train(restored, opt2, rank, 2, start=2)
    again = pickle.loads(pickled)
    return {"equal": bool(np.array_equal(flat_params(model), flat_params(restored))),
            "step": loaded.step, "original_step": state.step, "unpickled_step": again.step,
            "repr": repr(again)}


def sparse_training(rank, make_opt, hooked, steps=3, compression=LOSSLESS):
    """An ``nn.Embedding(sparse=True)`` under DDP (DDP's sparse-gradient path), with deepreduce's
    hook or DDP's own all-reduce: (parameters, the first step's reduced gradient dense, its layout)."""
    torch.manual_seed(0)
    model = DDP(nn.Embedding(1000, 16, sparse=True))
    if hooked:
        ddp.register(model, compression)
    opt = make_opt(model.parameters())
    for i in range(steps):
        g = torch.Generator().manual_seed(10 * i + rank)
        ids, target = torch.randint(0, 1000, (8, 4), generator=g), torch.randn(8, 16, generator=g)
        opt.zero_grad()
        ((model(ids).sum(1) - target) ** 2).sum().backward()
        opt.step()
        if i == 0:
            grad = model.module.weight.grad
            first, layout = grad.coalesce().to_dense(), grad.is_sparse
    return flat_params(model), first, layout


def scenario_sparse(rank):
    """Sparse embedding gradients through the hook against DDP's own sparse all-reduce."""
    out = {}
    for label, make_opt in (("sparse_adam", lambda p: torch.optim.SparseAdam(p, lr=0.01)),
                            ("sgd", lambda p: torch.optim.SGD(p, lr=0.1))):
        ours, ours_grad, ours_sparse = sparse_training(rank, make_opt, True)
        theirs, theirs_grad, theirs_sparse = sparse_training(rank, make_opt, False)
        out[label] = {"grad_equal": bool(torch.equal(ours_grad, theirs_grad)),
                      "params_max_diff": float(np.abs(ours - theirs).max()), "sparse": [ours_sparse, theirs_sparse]}
    topk = dict(LOSSLESS, sparsifier={"id": "topk", "ratio": 0.25}, index="delta")
    params, _, _ = sparse_training(rank, lambda p: torch.optim.SparseAdam(p, lr=0.01), True, compression=topk)
    gathered = [np.zeros_like(params) for _ in range(2)]
    dist.all_gather_object(gathered, params)
    out["topk_params_agree"] = bool(np.array_equal(gathered[0], gathered[1]))
    return out


SCENARIOS = [scenario_pickle, scenario_sparse]


def run(rank, world, port, queue):
    run_scenarios(rank, world, port, queue, SCENARIOS, 150)
