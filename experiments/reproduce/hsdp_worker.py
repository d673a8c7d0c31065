"""One rank of ``deepreduce reproduce hsdp``: the stdlib LM trained (``train``) or timed
(``profile``) with FSDP2 as HSDP on two "nodes".

The ranks form a 2-D mesh ``(replicate, shard) = (nodes, world / nodes)`` (``nodes``: the method's
``"nodes"``, default 2): ranks ``0 .. world/nodes - 1`` are node 0 (one FSDP shard group), and so
on; the replicate groups (``[0, 2]`` and ``[1, 3]`` on 4 ranks in 2 nodes) are what crosses the
link between the nodes. Every block and the root are
``fully_shard``-ed; the rows (:mod:`experiments.reproduce.hsdp`) differ only in how gradients are
reduced:

* ``{"kind": "native", "reduce_dtype": "float32" | "bfloat16"}``: native HSDP (the 2-D mesh given
  to ``fully_shard``): FSDP's reduce-scatter in the node, its dense all-reduce across nodes, in
  ``MixedPrecisionPolicy(reduce_dtype=...)`` (parameters and compute stay float32);
* ``{"kind": "deepreduce", "config": dict, "reduce_scatter": bool}``: the recipe of docs/fsdp.md
  (``fully_shard`` on the ``shard`` mesh) and ``deepreduce.torch.fsdp.register(model, config,
  replicate_group=mesh["replicate"].get_group(), reduce_scatter=...)``: deepreduce on the
  replicate dimension, and with ``reduce_scatter`` on FSDP's reduce-scatter in the node too;
* ``{"kind": "diloco", "sync_every": H, "compression": dict, "outer": {...}}``: semi-synchronous
  across the nodes (docs/fsdp.md, "Semi-synchronous across nodes"): ``fully_shard`` on the
  ``shard`` mesh, no per-step reduction between nodes, and :class:`deepreduce.torch.DiLoCo` over
  the replicate group stepping each rank's shard every H inner steps (the profile cuts H to
  ``profile_sync``, as :mod:`~experiments.reproduce.semisync_worker` does).

The training loop, the evaluation and the recording are :mod:`~experiments.reproduce.semisync_worker`'s
(same seeds, batches of ``(seed, step, global rank)``, AdamW with warm-up); only the calls whose
process group spans both nodes are the step's messages (the link's traffic), the rest is summed
as ``"inside"``. ``"extra"``: the rank's persistent compressor bytes (``state_bytes``, from
:meth:`deepreduce.torch.fsdp.FSDPCompression.state_bytes`; a DiLoCo row's: :func:`diloco_state`)
and its fp32 gradient shard (``shard_bytes``).
"""
from __future__ import annotations

import json
from typing import List, Optional

from .common import leave
from .semisync_worker import Runner, parse_args, plain_stats
from .semisync_worker import main as run_rank

NODES = 2


def node_of(rank: int, world: int, nodes: int = NODES) -> int:
    """The "node" of ``rank``: consecutive blocks of ``world / nodes`` ranks."""
    return rank // max(1, world // nodes)


def crosses_nodes(call: dict, world: int, nodes: int = NODES) -> bool:
    """Whether a recorded call's process group spans more than one node (the default group does)."""
    ranks = call.get("ranks")
    return ranks is None or len({node_of(r, world, nodes) for r in ranks}) > 1


class HSDPRunner(Runner):
    """The LM under FSDP2 on the (replicate, shard) mesh, reduced as the method says."""

    def __init__(self, name: str, method: dict, plan, rank: int, seed: int, data, profile: bool) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ..lm.model import TransformerLM

        self.name, self.method, self.plan, self.rank, self.seed, self.data = name, method, plan, rank, seed, data
        self.state = self.diloco = self.handle = None
        torch.manual_seed(seed)
        self.model = TransformerLM(plan.model())
        self.parameters = sum(p.numel() for p in self.model.parameters())
        world = dist.get_world_size()
        nodes = method.get("nodes", NODES)
        mesh = init_device_mesh("cpu", (nodes, world // nodes), mesh_dim_names=("replicate", "shard"))
        native = method["kind"] == "native"
        policy = MixedPrecisionPolicy(reduce_dtype=getattr(torch, method["reduce_dtype"])) if native else \
            MixedPrecisionPolicy()
        target = mesh if native else mesh["shard"]
        for block in self.model.blocks:
            fully_shard(block, mesh=target, mp_policy=policy)
        fully_shard(self.model, mesh=target, mp_policy=policy)
        self.shard_bytes = sum(p.to_local().numel() for p in self.model.parameters()) * 4   # while sharded
        if method["kind"] == "deepreduce":
            from deepreduce.torch.fsdp import register

            self.handle = register(self.model, method["config"], replicate_group=mesh["replicate"].get_group(),
                                   reduce_scatter=method["reduce_scatter"])
            if method.get("reference"):
                shared_reference(self.handle)
            if method.get("ef21"):
                ef21(self.handle, method["ef21"])
        self.forward = self.model
        self.optimizers()
        if method["kind"] == "diloco":
            from deepreduce.torch import DiLoCo

            from .semisync_methods import outer_sgd, sync_every

            outer = torch.optim.SGD(self.model.parameters(), **outer_sgd(method["outer"]))
            h = min(sync_every(method, plan), plan.profile_sync) if profile else sync_every(method, plan)
            self.diloco = DiLoCo(self.model, self.opt, outer, sync_every=h, compression=method["compression"],
                                 group=mesh["replicate"].get_group())

    def stats(self) -> dict:
        if self.diloco is not None:
            return plain_stats(self.diloco.stats())
        return plain_stats(self.handle.stats()) if self.handle is not None else {}

    def extra(self) -> dict:
        if self.diloco is not None:
            parts = diloco_state(self.diloco)
            return {"state_bytes": sum(parts.values()), "state_parts": parts, "shard_bytes": self.shard_bytes}
        return {"state_bytes": self.handle.state_bytes() if self.handle is not None else 0,
                "shard_bytes": self.shard_bytes}


def shared_reference(handle) -> None:
    """A searched candidate (docs/fsdp.md, "Sending differences instead of gradients"): each rank
    compresses the difference between its reduced shard and the previous step's aggregate G, and
    the optimizer gets G plus the average of the differences, which becomes the next G (EF21's
    estimate, shared by every rank of the replicate group rather than kept per rank: S more bytes
    of state, not counted in ``state_bytes``). What a coordinate's difference does not send stays
    in it for the next step, so no residual is kept."""
    import torch

    references = {}
    reduce = handle.all_reduce

    def all_reduce(module, fsdp_module, group, shard):
        reference = references.get(module)
        if reference is None:
            reference = references[module] = torch.zeros_like(shard, dtype=torch.float32)
        shard.sub_(reference)
        reduce(module, fsdp_module, group, shard)
        reference.add_(shard)
        shard.copy_(reference)
    handle.all_reduce = all_reduce


def ef21(handle, ratio: float) -> None:
    """A searched candidate (docs/fsdp.md, "Sending differences instead of gradients"), EF21
    (Richtarik, Sokolov and Fatkhullin, 2021) on a Top-``ratio`` config with raw values and no
    memory: each rank keeps its own estimate h of its reduced shard and sends the Top-r of the
    difference (g - h), adding what it sent to h; the optimizer gets the previous aggregate plus
    the average of what was sent, i.e. the average of the ranks' estimates. The rank's copy of
    what it sent is its own Top-r of the difference (``torch.topk``; every entry below the
    default ``min_numel``), as the config's sparsifier selects it. Two shard-sized states (2 S,
    not counted in ``state_bytes``)."""
    import torch

    from deepreduce.pipeline import DEFAULT_MIN_NUMEL
    from deepreduce.sparsify import count_for
    own, shared = {}, {}
    reduce = handle.all_reduce

    def all_reduce(module, fsdp_module, group, shard):
        if module not in own:
            own[module] = torch.zeros_like(shard, dtype=torch.float32)
            shared[module] = torch.zeros_like(shard, dtype=torch.float32)
        h, g = own[module], shared[module]
        x = shard.float() - h
        flat = x.reshape(-1)
        if flat.numel() < DEFAULT_MIN_NUMEL:
            c = flat
        else:
            k = count_for(ratio, flat.numel())
            top = flat.abs().topk(k).indices
            c = torch.zeros_like(flat)
            c[top] = flat[top]
        h += c.view_as(h)
        shard.copy_(x)
        reduce(module, fsdp_module, group, shard)
        g += shard
        shard.copy_(g)
    handle.all_reduce = all_reduce


def diloco_state(diloco) -> dict:
    """The bytes a DiLoCo keeps on this rank between outer steps, by part: ``globals`` (the float32
    θ_global of its shard), ``deltas`` (a Δ buffer still held: none once every reduction is
    applied, as at the end of a run; one lives from a fragment's submission to its application),
    ``compressor`` (the pipeline's state: the error-feedback accumulator), ``outer`` (the outer
    optimizer's state: none for plain SGD)."""
    from deepreduce.torch.fsdp_checkpoint import nbytes

    def tensors(state) -> int:
        if isinstance(state, dict):
            return sum(tensors(v) for v in state.values())
        if hasattr(state, "to_local"):
            state = state.to_local()
        return int(state.numel() * state.element_size()) if hasattr(state, "numel") else 0

    return {"globals": sum(g.numel() * g.element_size() for g in diloco.globals),
            "deltas": sum(d.numel() * d.element_size() for d in diloco.deltas if d is not None),
            "compressor": nbytes(diloco.pipeline.core.state_dict()),
            "outer": tensors(diloco.outer.state_dict()["state"])}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    nodes = json.loads(args.method)[1].get("nodes", NODES)
    if args.world % nodes:
        raise SystemExit(f"hsdp_worker: --world must be a multiple of the {nodes} nodes, got {args.world}")
    return run_rank(args=args, make_runner=HSDPRunner, on_link=lambda call: crosses_nodes(call, args.world, nodes))


if __name__ == "__main__":
    leave(main())
