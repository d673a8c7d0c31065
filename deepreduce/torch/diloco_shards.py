"""DiLoCo over FSDP2-sharded parameters (:class:`deepreduce.torch.diloco.DiLoCo`): each rank's
outer step runs on the shard it holds.

``fully_shard(model, mesh=mesh["shard"])`` turns every parameter into a DTensor sharded over the
ranks of a node. Each rank then snapshots, reduces and steps only its local shard
(``p.to_local()``): the pseudo-gradient of shard ``i`` is averaged over DiLoCo's ``group``, the
ranks that hold shard ``i`` on the other nodes (the replicate dimension of HSDP), so a node's
ranks never mix different shards, and the outer optimizer, built over the DTensor parameters as
usual, is handed DTensor gradients with the parameter's mesh and placements. The inner optimizer
and FSDP's own reduce-scatter inside the node are untouched. docs/fsdp.md, "Semi-synchronous
across nodes", gives the recipe.

Supported: DTensors whose placements are all ``Shard`` (FSDP2's ``Shard(0)``, uneven shards
included: a rank may hold fewer rows, or none). Refused with a ConfigError naming the parameter:
a ``Replicate`` or ``Partial`` placement (a 2-D native HSDP mesh given to ``fully_shard``,
tensor-parallel layouts), a group holding two ranks of one parameter's mesh (they hold different
shards: the default group of a sharded model), and Horovod as the backend.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..errors import ConfigError
from .diloco_arguments import OWNER

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:   # a torch built without distributed: no parameter can be sharded
    DTensor = Shard = None


def is_sharded(p) -> bool:
    return DTensor is not None and isinstance(p, DTensor)


def local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of parameter ``p``: its shard of a DTensor (sharing storage, so
    writing it writes the parameter), ``p`` itself otherwise."""
    return p.to_local() if is_sharded(p) else p


def as_gradient(tensor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``tensor`` (shaped as ``local(p)``) as a gradient the outer optimizer accepts for ``p``: a
    DTensor of ``p``'s mesh, placements, shape and stride for a sharded ``p``."""
    if not is_sharded(p):
        return tensor
    return DTensor.from_local(tensor, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def check_sharded(named: List[tuple], backend: str, group) -> None:
    """A ConfigError unless every sharded parameter can be stepped shard by shard over ``group``
    (see the module docstring)."""
    sharded = [(n, p) for n, p in named if is_sharded(p)]
    if not sharded:
        return
    if backend != "torch":
        raise ConfigError(f"{OWNER}: parameter {sharded[0][0]!r} is sharded (a DTensor); sharded models are "
                          f"supported with backend='torch', got {backend!r}")
    import torch.distributed as dist

    if not dist.is_initialized() or (group is not None and not isinstance(group, dist.ProcessGroup)):
        return   # the transport names the problem
    me = dist.get_rank()
    members = set(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))
    for name, p in sharded:
        if not all(isinstance(placement, Shard) for placement in p.placements):
            raise ConfigError(f"{OWNER}: parameter {name!r} has placements {tuple(p.placements)}; DiLoCo steps "
                              "each rank's shard and supports DTensors whose placements are all Shard, as "
                              "fully_shard(module, mesh=mesh['shard']) makes (for HSDP give fully_shard the 1-D "
                              "shard mesh and DiLoCo group=mesh['replicate'].get_group())")
        others = sorted(members & set(p.device_mesh.mesh.flatten().tolist()) - {me})
        if others:
            raise ConfigError(f"{OWNER}: group holds ranks {others} that hold other shards of parameter {name!r} "
                              f"(its mesh: ranks {p.device_mesh.mesh.flatten().tolist()}); give group= the ranks "
                              "that hold the same shard on other nodes, e.g. mesh['replicate'].get_group()")


def local_numel(named: List[tuple], indices: Optional[List[int]] = None) -> int:
    """Elements this rank holds of the parameters (all, or those at ``indices``)."""
    chosen = named if indices is None else [named[i] for i in indices]
    return sum(local(p).numel() for _, p in chosen)
