"""DCP save and resume of deepreduce's FSDP comms on gloo ranks (tests/test_torch_fsdp_checkpoint.py).

Three settings on 2 ranks, each with per-rank state: ``fsdp`` (1-D FSDP, a Top-r config with an
error-feedback residual of each module's reduce-scatter input) and ``hsdp`` (a 2x1 (replicate,
shard) mesh, the recipe of docs/fsdp.md: the sparse all-reduce over the replicate group keeps
owner residuals of each rank's shard, plus the pipeline's residual; ``hsdp_compact`` the same with
every entry in 8 bits and the pipeline's residual kept as int8 codes, ``compact_residual``). ``run_save`` trains ``K``
steps, saves model, optimizer and the handle with ``dcp.save``, then trains ``M`` more steps
recording every container this rank sent; ``run_resume`` (fresh processes) loads the checkpoint
and trains the same ``M`` steps, recording the same, loads the checkpoint again into the now
trained handle and trains them once more, then tries loads that must be refused
(another config, a corrupt state); ``run_world`` loads the checkpoint with another world size.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch_ddp_hook import run_scenarios  # noqa: E402
from torch_fsdp import full_params, make  # noqa: E402

from deepreduce.collective.comm.torch_distributed import TorchDistributedCommunicator  # noqa: E402
from deepreduce.torch import fsdp  # noqa: E402

K, M = 3, 4
RESIDUAL_TOPK = {"sparsifier": {"id": "topk", "ratio": 0.1}, "index": {"id": "raw"}, "value": {"id": "raw"},
                 "memory": {"id": "residual"}}
HSDP = dict(RESIDUAL_TOPK, aggregation={"id": "sparse_allreduce"})
# every entry, 8-bit values, the int8 residual of memory_compact (its codes and scales are the state)
COMPACT = {"sparsifier": {"id": "topk", "ratio": 1.0}, "index": {"id": "rle"},
           "value": {"id": "qsgd", "levels": 127, "bucket_size": 16}, "memory": {"id": "compact_residual", "block": 8},
           "aggregation": {"id": "sparse_allreduce"}}
SETTINGS = ("fsdp", "hsdp", "hsdp_compact")


def build(setting, config=None):
    """The model, optimizer and handle of ``setting`` (see the module docstring)."""
    if setting == "fsdp":
        model = make(init_device_mesh("cpu", (dist.get_world_size(),)))
        handle = fsdp.register(model, config or RESIDUAL_TOPK)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
        model = make(mesh["shard"])
        handle = fsdp.register(model, config or (COMPACT if setting == "hsdp_compact" else HSDP),
                               replicate_group=mesh["replicate"].get_group())
    return model, torch.optim.Adam(model.parameters(), lr=0.01), handle


class Recorder:
    """Every payload this rank hands the torch.distributed communicator (alltoall and allgather),
    except the layout agreement, in order."""

    def __init__(self):
        self.sent = []
        self._alltoall, self._allgather = TorchDistributedCommunicator.alltoall, \
            TorchDistributedCommunicator.allgather_async

    def __enter__(self):
        recorder = self

        def alltoall(comm, payloads, name):
            recorder.sent.append(b"".join(bytes(memoryview(p)) for p in payloads))
            return recorder._alltoall(comm, payloads, name)

        def allgather_async(comm, payload, name, *args, **kwargs):
            if name != "deepreduce.collective.agreement":
                recorder.sent.append(bytes(memoryview(payload)))
            return recorder._allgather(comm, payload, name, *args, **kwargs)
        TorchDistributedCommunicator.alltoall, TorchDistributedCommunicator.allgather_async = alltoall, allgather_async
        return self

    def __exit__(self, *exc):
        TorchDistributedCommunicator.alltoall, TorchDistributedCommunicator.allgather_async = \
            self._alltoall, self._allgather


def train(model, opt, rank, start, steps):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        model(x, step).backward()
        opt.step()


def checkpoint_state(model, opt, handle):
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "compression": handle}


def path_of(directory, setting):
    return os.path.join(directory, setting)


def scenario_save(directory):
    def scenario_save(rank):
        out = {}
        for setting in SETTINGS:
            model, opt, handle = build(setting)
            train(model, opt, rank, 0, K)
            dcp.save(checkpoint_state(model, opt, handle), checkpoint_id=path_of(directory, setting))
            with Recorder() as recorder:
                train(model, opt, rank, K, M)
            out[setting] = {"sent": recorder.sent, "params": full_params(model).numpy(), "state_bytes": handle.state_bytes(),
                            "keys": sorted(handle.state_dict())}
            handle.close()
        return out
    return scenario_save


def load(setting, directory, config=None, planner=None):
    model, opt, handle = build(setting, config)
    state = checkpoint_state(model, opt, handle)
    dcp.load(state, checkpoint_id=path_of(directory, setting), planner=planner)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt, handle


def scenario_resume(directory):
    def scenario_resume(rank):
        out = {}
        for setting in SETTINGS:
            model, opt, handle = load(setting, directory)
            with Recorder() as recorder:
                train(model, opt, rank, K, M)
            out[setting] = {"sent": recorder.sent, "params": full_params(model).numpy(), "state_bytes": handle.state_bytes()}
            # the same checkpoint loaded again into this process's model, optimizer and handle,
            # whose engines are built now (they are restored in place, not when next built)
            state = checkpoint_state(model, opt, handle)
            dcp.load(state, checkpoint_id=path_of(directory, setting))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            with Recorder() as again:
                train(model, opt, rank, K, M)
            out[setting]["again"] = {"sent": again.sent, "params": full_params(model).numpy()}
            handle.close()
        out["refused"] = refusals(rank, directory)
        return out
    return scenario_resume


def failure(call):
    """What ``call`` raised, as "Type: message" (DCP's CheckpointException is a BaseException)."""
    try:
        call()
        return "no error"
    except (Exception, CheckpointException) as exc:   # noqa: BLE001 (the test checks type and message)
        return f"{type(exc).__name__}: {exc}"


def refusals(rank, directory):
    """Loads into the same world size that must be refused: another config, a corrupt rank
    state, another rank's state."""
    out = {"config": failure(lambda: load("fsdp", directory, dict(RESIDUAL_TOPK, sparsifier={
        "id": "topk", "ratio": 0.2})))}
    _, _, handle = build("fsdp")
    state = handle.state_dict()
    state[f"rank{rank}"] = b"not a checkpoint"
    out["corrupt"] = failure(lambda: handle.load_state_dict(state))
    state = handle.state_dict()
    out["other_rank"] = failure(lambda: handle.load_state_dict(
        {"meta": state["meta"], f"rank{rank + 1}": state[f"rank{rank}"]}))
    handle.close()
    return out


def scenario_world(directory):
    """The 2-rank checkpoint loaded by this launch's other world size: strict, and with DCP's
    partial load (which skips keys the checkpoint lacks)."""
    def scenario_world(rank):
        from torch.distributed.checkpoint import DefaultLoadPlanner

        return {"strict": failure(lambda: load("fsdp", directory)),
                "partial": failure(lambda: load("fsdp", directory,
                                                planner=DefaultLoadPlanner(allow_partial_load=True)))}
    return scenario_world


def run_save(rank, world, port, queue, directory):
    run_scenarios(rank, world, port, queue, [scenario_save(directory)], 300)


def run_resume(rank, world, port, queue, directory):
    run_scenarios(rank, world, port, queue, [scenario_resume(directory)], 300)


def run_world(rank, world, port, queue, directory):
    run_scenarios(rank, world, port, queue, [scenario_world(directory)], 300)
    # A rank whose strict DCP load raised can abort in torch's own teardown after the group was
    # destroyed ("terminate called without an active exception": a joinable C++ thread, seen once
    # in a loaded CI run, never in 8 reruns). The results are on the queue: flush it and leave
    # without the interpreter's destructors, so the exit code speaks of deepreduce's scenario.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
