"""The outer loop's state in a ``torch.distributed.checkpoint`` (DCP) checkpoint, beside a sharded
model and its optimizer: :meth:`deepreduce.torch.DiLoCo.distributed_checkpoint` returns a DCP
``Stateful``::

    model_sd, optim_sd = get_state_dict(model, inner)
    dcp.save({"model": model_sd, "optim": optim_sd, "diloco": diloco.distributed_checkpoint()}, checkpoint_id=path)
    ...   # resume: build, fully_shard, the optimizers and DiLoCo as before, then
    state = {"model": model_sd, "optim": optim_sd, "diloco": diloco.distributed_checkpoint()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optim"])

Each rank's outer state (:func:`deepreduce.torch.diloco_state.save`: the global copy of its shard,
its error feedback, the schedule, the outer optimizer's state) is per rank and does not reshard:
it travels as that rank's own value (:mod:`deepreduce.torch.rank_state`), and ``meta`` records the
world size, so a load into another world size is refused on every rank alike. A rank that loads
another rank's state is refused by the state itself (it records which shard it holds). The
loaded state goes through :meth:`DiLoCo.load_state_dict`, checked whole before any of it applies.

**Save each node apart.** Between outer steps the nodes hold different values of the same shard
(each trains on its own data), and the inner optimizer's state always differs between them; DCP,
given the whole world, keeps one copy of each shard, so the other node would resume with the first
node's parameters and moments. Save and load each node's model, optimizer and DiLoCo state over
that node's ranks, into a checkpoint of its own::

    node = mesh["replicate"].get_local_rank()
    dcp.save(state, checkpoint_id=f"{path}/node{node}", process_group=mesh["shard"].get_group())

The state records a digest of this rank's local parameters and inner optimizer state; before the
first inner step after a load every worker compares its own (one small allgather over the DiLoCo
group), and if any rank's differ, every worker raises a ConfigError naming those ranks, instead of
training on from what the other node saved.
"""
from __future__ import annotations

import hashlib
import weakref

import numpy as np
import torch
import torch.distributed as dist

from .. import checkpoint
from ..errors import ConfigError, quote
from .diloco_shards import local
from .rank_state import mine, packed, rank_key, unpacked

FORMAT = 1
OWNER = "DiLoCo distributed checkpoint"
#: DiLoCo -> the hook of its pending post-load check (at most one: the last load's)
_PENDING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class DiLoCoCheckpoint:
    """A DCP ``Stateful`` of one DiLoCo's state on this rank: ``{"meta": {format, world},
    "rank<r>": bytes}``. ``state_dict()`` is collective while a reduction is in flight (it finishes
    it first, as :meth:`DiLoCo.state_dict`); DCP calls it on every rank."""

    def __init__(self, diloco) -> None:
        self.diloco = diloco

    def state_dict(self) -> dict:
        rank = dist.get_rank()
        blob = {"diloco": self.diloco.state_dict(), "local": local_digest(self.diloco)}
        return {"meta": {"format": FORMAT, "world": dist.get_world_size()}, rank_key(rank): packed(blob)}

    def load_state_dict(self, state: dict) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        value = mine(OWNER, state, rank)
        meta = checkpoint.checked_keys(f"{OWNER} meta", state["meta"], ("format", "world"))
        if checkpoint.scalar(meta["format"]) != FORMAT:
            raise ConfigError(f"{OWNER}: format {quote(meta['format'])}, this version reads {FORMAT}")
        if checkpoint.scalar(meta["world"]) != world:
            raise ConfigError(f"{OWNER}: saved by {quote(meta['world'])} ranks, this run has {world}; the outer "
                              "state is per rank and does not reshard")
        blob = checkpoint.checked_keys(f"{OWNER} of rank {rank}", unpacked(OWNER, value, rank), ("diloco", "local"))
        if not isinstance(blob["local"], str):
            raise ConfigError(f"{OWNER}: the local digest of rank {rank} must be a string, got {quote(blob['local'])}")
        self.diloco.load_state_dict(blob["diloco"])
        self._check_before_next_step(blob["local"])

    def _check_before_next_step(self, expected: str) -> None:
        """Before the next inner step, every worker compares its local parameters and inner
        optimizer state with what was saved; all raise if any differs (one allgather). A later
        load into the same DiLoCo replaces a check still pending (the last load is checked)."""
        diloco, hook = self.diloco, None
        previous = _PENDING.pop(diloco, None)
        if previous is not None:
            previous.remove()

        def check(*_):
            hook.remove()
            _PENDING.pop(diloco, None)
            same = local_digest(diloco) == expected
            found = diloco.communicator.inner.allgather(np.array([same], np.uint8), "deepreduce.diloco.restored")
            differ = [worker for worker, flag in enumerate(found) if not int(np.asarray(flag).reshape(-1)[0])]
            if differ:
                raise ConfigError(f"{OWNER}: on worker(s) {differ} of the DiLoCo group the model's local parameters "
                                  "or the inner optimizer's state are not those saved with the DiLoCo state; a "
                                  "torch.distributed.checkpoint of the whole world keeps one node's copy of each "
                                  "shard: save each node apart (process_group=mesh['shard'].get_group(), a "
                                  "checkpoint_id per node)")
        hook = _PENDING[diloco] = diloco.inner.register_step_pre_hook(check)


def local_digest(diloco) -> str:
    """A digest of what this rank trains on between outer steps and DCP may not keep apart: its
    local shard of every trainable parameter and the inner optimizer's state of it."""
    h = hashlib.blake2b(digest_size=16)

    def add(tensor: torch.Tensor) -> None:
        flat = local(tensor).detach().reshape(-1).contiguous().cpu()
        h.update(flat.view(torch.uint8).numpy().tobytes())

    for name, p in diloco.named:
        h.update(name.encode())
        add(p)
        for key, value in sorted(diloco.inner.state.get(p, {}).items()):
            h.update(str(key).encode())
            if isinstance(value, torch.Tensor):
                add(value)
            else:
                h.update(repr(value).encode())
    return h.hexdigest()
