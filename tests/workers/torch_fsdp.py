"""FSDP2 and HSDP on gloo ranks (torch.multiprocessing spawn) with deepreduce's comms
(deepreduce.torch.fsdp); tests/test_torch_fsdp.py checks the results.

``run_two`` (2 ranks, 1-D FSDP) and ``run_mesh`` (4 ranks as a 2x2 (replicate, shard) mesh, then
1-D FSDP over the 4) put
``(rank, {scenario: result})`` on the queue; every rank arms workers/watchdog.py first, so a hang
fails the test with the ranks' stacks.
"""
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch_ddp_hook import run_scenarios  # noqa: E402

from deepreduce.sparsify.basic import DenseGradientWarning  # noqa: E402
from deepreduce.torch import fsdp  # noqa: E402

warnings.filterwarnings("ignore", category=DenseGradientWarning)   # the lossless config sends dense layers

LOSSLESS = {"sparsifier": {"id": "none"}, "index": {"id": "raw"}, "value": {"id": "raw"}, "memory": {"id": "none"}}
TOPK_RATIO_ONE = {"sparsifier": {"id": "topk", "ratio": 1.0}, "index": {"id": "raw"}, "value": {"id": "raw"},
                  "memory": {"id": "none"}}
STEPS = 3


class Net(nn.Module):
    """Three FSDP units and one that only even steps use (a module with no gradient on odd steps);
    ``tiny`` (1 x 16 weight, 1-element bias) has fewer rows than ranks: uneven, padded shards."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.extra, self.tiny = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x, step):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if step % 2 == 0:
            h = torch.tanh(self.extra(h))
        return ((self.tiny(h).float() - x[:, :1].float()) ** 2).mean()   # learn the first feature


def make(mesh, reduce_dtype=None, param_dtype=None, force_sum=False, divide=None):
    torch.manual_seed(0)
    model = Net()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in (model.a, model.b, model.extra, model.tiny, model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    for module in (model.a, model.b, model.extra, model.tiny):
        if force_sum:
            module.set_force_sum_reduction_for_comms(True)
        if divide is not None:
            module.set_gradient_divide_factor(divide)
    return model


def train(model, rank, steps=STEPS, lr=0.05):
    """``steps`` SGD steps on this rank's data; every step's local gradient shards (flat) and the
    losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads, losses = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * (step % 2) + rank)   # two batches per rank, in turn
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = model(x, step)
        loss.backward()
        grads.append(torch.cat([p.grad.to_local().reshape(-1).float() for p in model.parameters()
                                if p.grad is not None]))
        losses.append(float(loss.detach()))
        opt.step()
    return grads, losses


def full_params(model):
    return torch.cat([p.detach().full_tensor().reshape(-1).float() for p in model.parameters()])


def same(a, b):
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def largest(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def relative(a, b):
    """The largest difference relative to the reference's largest magnitude, over the steps."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(a, b))


# ------------------------------------------------------------------ 2 ranks, 1-D FSDP
CASES = {   # name: (make's arguments for deepreduce, for the baseline)
    "avg_fp32": ({}, {}),
    "sum_forced": ({"force_sum": True}, {"force_sum": True}),
    "divide_forced_sum": ({"force_sum": True, "divide": 4.0}, {"force_sum": True, "divide": 4.0}),
    "premul_sum": ({"divide": 4.0}, {"force_sum": True, "divide": 4.0}),   # gloo has no PREMUL_SUM
    "bf16_reduce_bf16": ({"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16},
                         {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}),
    "bf16_reduce_fp32": ({"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
                         {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}),
}


def scenario_lossless(rank, configs=(("none", LOSSLESS), ("topk1", TOPK_RATIO_ONE))):
    """Every case of CASES with each lossless config against FSDP's own reduce-scatter over all
    ranks (1-D mesh): gradients of every step, parameters, the engine's step count."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for case, (ours, theirs) in CASES.items():
        reference = make(mesh, **theirs)
        ref_grads, _ = train(reference, rank)
        for label, config in configs:
            model = make(mesh, **ours)
            handle = fsdp.register(model, config)
            grads, _ = train(model, rank)
            out[(case, label)] = {"equal": same(grads, ref_grads), "largest": largest(grads, ref_grads),
                                  "relative": relative(grads, ref_grads),
                                  "params_equal": torch.equal(full_params(model), full_params(reference)),
                                  "steps": handle.stats()["reduce_scatter"]["steps"]}
            handle.close()
    return out


def scenario_refusals(rank):
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    model = make(mesh)
    handle = fsdp.register(model, LOSSLESS)
    comm = model.a._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
    buf = torch.zeros(2 * world)
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        try:
            comm(torch.zeros(2), buf, dist.group.WORLD, op)
            out[str(op)] = "no error"
        except Exception as exc:   # noqa: BLE001 (the test checks type and message)
            out[str(op)] = f"{type(exc).__name__}: {exc}"
    handle.close()
    for label, call in (("plain_module", lambda: fsdp.register(nn.Linear(2, 2), LOSSLESS)),
                        ("summable", lambda: fsdp.register(make(mesh), _Summable())),
                        ("auto", lambda: fsdp.register(make(mesh), dict(LOSSLESS, aggregation={"id": "auto"}))),
                        ("bad_group", lambda: fsdp.register(make(mesh), LOSSLESS, replicate_group="replicate"))):
        try:
            call()
            out[label] = "no error"
        except Exception as exc:   # noqa: BLE001
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


class _Summable:
    def compress(self, tensor):
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor


def scenario_disagree(rank):
    """Rank 0 registers the lossless config, the others Top-r: every rank fails in backward with
    the same error (run last: FSDP's backward is left half done)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = make(mesh)
    fsdp.register(model, LOSSLESS if rank == 0 else TOPK_RATIO_ONE)
    try:
        train(model, rank, steps=1)
        return "no error"
    except Exception as exc:   # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------ 4 ranks
def scenario_four_ranks_1d(rank):
    """1-D FSDP over the 4 ranks: every case of CASES, the lossless config without sparsifier."""
    return scenario_lossless(rank, configs=(("none", LOSSLESS),))


# ------------------------------------------------------------------ 4 ranks, 2x2 (replicate, shard)
def scenario_hsdp(rank):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh["replicate"].get_group()
    native = make(mesh)
    ref_grads, _ = train(native, rank)
    out = {}
    for label, kwargs in (("hook", {"reduce_scatter": False}), ("both", {})):
        for config_label, config in (("allgather", LOSSLESS),
                                     ("sparse_allreduce", dict(TOPK_RATIO_ONE, aggregation={
                                         "id": "sparse_allreduce", "reselect": "none"}))):
            model = make(mesh["shard"])
            handle = fsdp.register(model, config, replicate_group=replicate, **kwargs)
            grads, _ = train(model, rank)
            out[(label, config_label)] = {"equal": same(grads, ref_grads), "largest": largest(grads, ref_grads)}
            handle.close()
    try:
        fsdp.register(make(mesh), LOSSLESS, replicate_group=replicate)
        out["native"] = "no error"
    except Exception as exc:   # noqa: BLE001
        out["native"] = f"{type(exc).__name__}: {exc}"
    return out


def scenario_lossy(rank):
    """The recommended config on the 2x2 mesh (compressed reduce-scatter and replicate sparse
    all-reduce), bf16 parameters: losses, every rank's full parameters, the persistent state."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make(mesh["shard"], param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    handle = fsdp.register(model, "fsdp_topk", replicate_group=mesh["replicate"].get_group())
    _, losses = train(model, rank, steps=24, lr=0.1)
    shard_numel = sum(p.to_local().numel() for p in model.parameters())
    out = {"losses": losses, "params": full_params(model).numpy(), "shard_numel": shard_numel,
           "state_bytes": handle.state_bytes(), "stats": handle.stats()}
    handle.close()
    return out


def run_two(rank, world, port, queue):
    run_scenarios(rank, world, port, queue, [scenario_lossless, scenario_refusals, scenario_disagree], 150)


def run_mesh(rank, world, port, queue):
    run_scenarios(rank, world, port, queue, [scenario_hsdp, scenario_lossy, scenario_four_ranks_1d], 200)
