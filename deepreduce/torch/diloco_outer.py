"""The arithmetic of one DiLoCo outer step on a fragment (:mod:`deepreduce.torch.diloco`): the
pseudo-gradient a worker sends, and the outer optimizer's step with the reduced one.

A fragment's parts are ``(name, parameter, global float32 copy, Δ view)`` tuples. A sharded
parameter (FSDP2's DTensor) takes part through the shard this rank holds
(:mod:`deepreduce.torch.diloco_shards`): its global copy and Δ view are the shard's."""
from __future__ import annotations

from typing import List, Sequence

import torch

from .diloco_shards import as_gradient, local


def pseudo_gradient(parts: Sequence[tuple]) -> None:
    """Write ``Δ = θ_global − θ_local`` (float32) into each part's Δ view."""
    with torch.no_grad():
        for _, p, g, delta in parts:
            torch.sub(g.reshape(-1), local(p).detach().reshape(-1).to(torch.float32), out=delta)


def outer_step(outer: torch.optim.Optimizer, params: List[torch.Tensor], parts: Sequence[tuple],
               alpha: float) -> None:
    """Set the fragment's parameters to θ_global, step ``outer`` with ``grad`` = the reduced Δ
    (held in the Δ views; every other parameter has no gradient, so the outer optimizer leaves
    it alone), keep the result as the new θ_global, and mix ``θ ← α·θ_local + (1 − α)·θ_global``.
    The parameters' own gradients are put back afterwards, whatever happens."""
    grads = [p.grad for p in params]
    try:
        with torch.no_grad():
            saved = [local(p).detach().clone() for _, p, _, _ in parts] if alpha else None
            for p in params:
                p.grad = None
            for _, p, g, delta in parts:
                mine = local(p)
                mine.copy_(g.view_as(mine))
                p.grad = as_gradient(delta.view_as(mine).to(p.dtype), p)
        outer.step()
        with torch.no_grad():
            for k, (_, p, g, _) in enumerate(parts):
                mine = local(p)
                g.copy_(mine.detach().reshape(g.shape))
                if alpha:
                    mine.copy_((alpha * saved[k].to(torch.float32) + (1 - alpha) * g).view_as(mine))
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
