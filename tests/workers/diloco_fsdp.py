"""DiLoCo over FSDP2 shards (deepreduce.torch.DiLoCo with ``fully_shard(mesh=mesh["shard"])``) on 4
gloo ranks as 2 nodes x 2 ranks: FSDP shards over [0, 1] and [2, 3], the outer loop runs over the
replicate groups [0, 2] and [1, 3]. ``run`` puts ``(rank, {scenario: result})`` on the queue
(tests/test_diloco_fsdp.py checks them); every rank arms workers/watchdog.py, so a hang fails the
test with the ranks' stacks.

The model is workers/torch_fsdp.py's: four FSDP units, one used on even steps only, and one whose
1 x 32 weight and 1-element bias have fewer rows than ranks (rank 1 of a node holds none of them).
"""
import os
import shutil
import sys
import tempfile
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from diloco import record_sent, saved_and_read_back  # noqa: E402
from torch_ddp_hook import error_of, run_scenarios  # noqa: E402
from torch_fsdp import LOSSLESS, make  # noqa: E402

from deepreduce.sparsify.basic import DenseGradientWarning  # noqa: E402
from deepreduce.torch import DiLoCo  # noqa: E402

warnings.filterwarnings("ignore", category=DenseGradientWarning)


def hsdp_mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def inner_step(model, opt, rank, step):
    """One inner step on this rank's batch (two batches per rank, in turn, as workers/torch_fsdp.py)."""
    g = torch.Generator().manual_seed(1000 * (step % 2) + rank)
    x = torch.randn(16, 8, generator=g)
    opt.zero_grad()
    loss = model(x, step)
    loss.backward()
    opt.step()
    return float(loss.detach())


def full(model) -> np.ndarray:
    """Every parameter gathered (collective over the shard mesh), flat."""
    return torch.cat([p.detach().full_tensor().reshape(-1) for p in model.parameters()]).numpy().copy()


def shards(model) -> np.ndarray:
    """This rank's local shards, flat."""
    return torch.cat([p.detach().to_local().reshape(-1) for p in model.parameters()]).numpy().copy()


def sharded(mesh, compression, sync_every, inner="sgd", outer_lr=1.0, **kwargs):
    model = make(mesh["shard"])
    inner_opt = torch.optim.SGD(model.parameters(), lr=0.05) if inner == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr)
    return model, inner_opt, DiLoCo(model, inner_opt, outer, sync_every=sync_every, compression=compression,
                                    group=mesh["replicate"].get_group(), **kwargs)


def scenario_equals_native_hsdp(rank):
    """H = 1, lossless, outer SGD lr 1 against native HSDP (2-D mesh), both with inner SGD; each
    fragment bundled (a container per parameter) and flat (the shards end to end, ``flat=True``)."""
    return {layout: equals_native_hsdp(rank, flat=layout == "flat") for layout in ("bundled", "flat")}


def equals_native_hsdp(rank, flat):
    mesh = hsdp_mesh()
    reference = make(mesh)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    model, opt, diloco = sharded(mesh, LOSSLESS, 1, flat=flat)
    diffs, equal = [], []
    with diloco:
        for step in range(6):
            inner_step(reference, ref_opt, rank, step)
            inner_step(model, opt, rank, step)
            ours, theirs = full(model), full(reference)
            diffs.append(float(np.abs(ours - theirs).max()))
            equal.append(bool(np.array_equal(ours, theirs)))
    stats = diloco.stats()
    diloco.close()
    return {"diffs": diffs, "equal": equal, "outer_steps": stats["outer_steps"],
            "moved": float(np.abs(full(model) - full(make(mesh["shard"]))).max())}


def scenario_semisync_1bit(rank):
    """The shipped semisync_1bit at H = 5, outer SGD lr 1.2, inner AdamW: after each outer step,
    this rank's shards, DiLoCo's global copy of them and the gathered parameters."""
    mesh = hsdp_mesh()
    model, opt, diloco = sharded(mesh, "semisync_1bit", 5, inner="adamw", outer_lr=1.2)
    after, losses = [], []
    with diloco:
        for step in range(20):
            applied = diloco.outer_steps
            losses.append(inner_step(model, opt, rank, step))
            if diloco.outer_steps > applied:
                globals_ = torch.cat([g.reshape(-1) for g in diloco.globals]).numpy().copy()
                after.append({"shards": shards(model), "globals": globals_, "full": full(model)})
    stats = diloco.stats()
    diloco.close()
    return {"after": after, "losses": losses, "sent_bytes": stats["sent_bytes"], "parameters": stats["parameters"],
            "bits": stats["bits_per_parameter_per_inner_step"],
            "local_numel": sum(p.to_local().numel() for p in model.parameters())}


def run_with_checkpoint(rank, steps, stop=None, directory=None, per_node=True):
    """Train ``steps`` inner steps at H = 3 (semisync_1bit: decayed error feedback), recording the
    containers sent; with ``stop``, save every rank's state there and continue in freshly built
    objects that load it: with ``torch.save`` per rank, or with ``directory``, model, inner
    optimizer and DiLoCo together in a torch.distributed.checkpoint (DCP) there, one per node over
    its ranks (the documented recipe), or with ``per_node=False`` one over the whole world."""
    mesh = hsdp_mesh()
    model, opt, diloco = sharded(mesh, "semisync_1bit", 3, inner="adamw")
    sent = []

    start, peer = 0, None
    if stop is not None:
        with diloco:
            for step in range(stop):
                inner_step(model, opt, rank, step)
                if directory is not None and step == 1:   # an earlier checkpoint, loaded first on resume
                    dcp.save(dcp_state(model, opt, diloco), **dcp_place(mesh, directory + "-early", per_node))
        if directory is None:
            saved = saved_and_read_back(model, opt, diloco)
        else:
            where = dcp_place(mesh, directory, per_node)
            dcp.save(dcp_state(model, opt, diloco), **where)
            diloco.close()
        torch.manual_seed(123)
        model, opt, diloco = sharded(mesh, "semisync_1bit", 3, inner="adamw")
        if directory is None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["inner"])
            node = [None] * mesh["shard"].size()   # the state of the node's other rank: another shard
            dist.all_gather_object(node, saved["diloco"], group=mesh["shard"].get_group())
            peer = error_of(lambda: diloco.load_state_dict(node[1 - mesh["shard"].get_local_rank()]))
            diloco.load_state_dict(saved["diloco"])
        else:   # the earlier checkpoint, then the one to resume from: the last load is the one checked
            for place in (dcp_place(mesh, directory + "-early", per_node), where):
                state = dcp_state(model, opt, diloco)
                dcp.load(state, **place)
                set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = stop
    record_sent(diloco, sent)
    trained = []

    def train():
        for step in range(start, steps):
            inner_step(model, opt, rank, step)
            trained.append(step)
    with diloco:
        failed = error_of(train)   # the whole-world DCP resume: every rank raises at its first step
    diloco.close()
    if failed[0] is not None:
        return {"error": failed, "trained": len(trained)}
    return {"sent": sent, "shards": shards(model), "globals": [g.numpy().copy() for g in diloco.globals],
            "peer": peer}


def dcp_place(mesh, directory, per_node):
    """Where DCP saves: each node over its own ranks into a checkpoint of its own, or the world."""
    if not per_node:
        return {"checkpoint_id": os.path.join(directory, "world")}
    node = mesh["replicate"].get_local_rank()
    return {"checkpoint_id": os.path.join(directory, f"node{node}"), "process_group": mesh["shard"].get_group()}


def dcp_state(model, opt, diloco):
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "diloco": diloco.distributed_checkpoint()}


def dcp_refusals(rank, directory):
    """A DCP DiLoCo state loaded into another world size's meta, another rank's key, and bytes that
    are not a state: each a ConfigError naming it, before anything changes."""
    mesh = hsdp_mesh()
    _, _, diloco = sharded(mesh, "semisync_1bit", 3, inner="adamw")
    handle = diloco.distributed_checkpoint()
    good = handle.state_dict()
    key = f"rank{rank}"
    out = {
        "world": error_of(lambda: handle.load_state_dict({"meta": {"format": 1, "world": 8}, key: good[key]})),
        "key": error_of(lambda: handle.load_state_dict({"meta": good["meta"], f"rank{(rank + 1) % 4}": good[key]})),
        "corrupt": error_of(lambda: handle.load_state_dict({"meta": good["meta"], key: b"not a state"})),
    }
    diloco.close()
    return out


def scenario_resume(rank):
    directory = os.path.join(tempfile.gettempdir(), f"diloco-dcp-{os.environ['MASTER_PORT']}")
    out = {"whole": run_with_checkpoint(rank, 10), "resumed": run_with_checkpoint(rank, 10, stop=4),
           "dcp": run_with_checkpoint(rank, 10, stop=4, directory=directory),
           "dcp_world": run_with_checkpoint(rank, 10, stop=4, directory=directory, per_node=False),
           "dcp_refused": dcp_refusals(rank, directory)}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(directory + "-early", ignore_errors=True)
    return out


def scenario_refusals(rank):
    """The default group (it holds two ranks of every shard mesh) and a native HSDP model (a 2-D
    mesh: Replicate placements) are refused on every rank, naming the parameter."""
    mesh = hsdp_mesh()
    out = {}

    def build(model, group):
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        DiLoCo(model, inner, outer, sync_every=2, group=group)

    out["default_group"] = error_of(lambda: build(make(mesh["shard"]), None))
    out["native_hsdp"] = error_of(lambda: build(make(mesh), mesh["replicate"].get_group()))
    model = make(mesh["shard"])
    out["horovod"] = error_of(lambda: DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                             torch.optim.SGD(model.parameters(), lr=1.0), sync_every=2,
                                             backend="horovod"))
    return out


def run(rank, world, port, queue):
    run_scenarios(rank, world, port, queue, [scenario_refusals, scenario_equals_native_hsdp, scenario_semisync_1bit,
                                             scenario_resume], 200)
