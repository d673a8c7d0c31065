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
  replicate dimension, and with ``reduce_scatter`` on FSDP's reduce-scatter in the node too.

The training loop, the evaluation and the recording are :mod:`~experiments.reproduce.semisync_worker`'s
(same seeds, batches of ``(seed, step, global rank)``, AdamW with warm-up); only the calls whose
process group spans both nodes are the step's messages (the link's traffic), the rest is summed
as ``"inside"``. ``"extra"``: the rank's persistent compressor bytes (``state_bytes``, from
:meth:`deepreduce.torch.fsdp.FSDPCompression.state_bytes`) and its fp32 gradient shard
(``shard_bytes``).
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
        if not native:
            from deepreduce.torch.fsdp import register

            self.handle = register(self.model, method["config"], replicate_group=mesh["replicate"].get_group(),
                                   reduce_scatter=method["reduce_scatter"])
        self.forward = self.model
        self.optimizers()

    def stats(self) -> dict:
        return plain_stats(self.handle.stats()) if self.handle is not None else {}

    def extra(self) -> dict:
        return {"state_bytes": self.handle.state_bytes() if self.handle is not None else 0,
                "shard_bytes": self.shard_bytes}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    nodes = json.loads(args.method)[1].get("nodes", NODES)
    if args.world % nodes:
        raise SystemExit(f"hsdp_worker: --world must be a multiple of the {nodes} nodes, got {args.world}")
    return run_rank(args=args, make_runner=HSDPRunner, on_link=lambda call: crosses_nodes(call, args.world, nodes))


if __name__ == "__main__":
    leave(main())
