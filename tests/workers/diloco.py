"""Gloo ranks (torch.multiprocessing spawn) running the outer loop, deepreduce.torch.DiLoCo; one
launch runs every scenario (tests/test_diloco.py checks the results). ``run``: 2 or 4 workers of
one rank each; ``run_nested``: 4 ranks as 2 workers of a 2-rank DDP group each."""
import io
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp_hook import error_of, run_scenarios  # noqa: E402

from deepreduce.torch import DiLoCo  # noqa: E402

LOSSLESS = {"sparsifier": "none", "index": "raw", "value": "raw", "memory": "none"}
TOPK = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": "raw", "value": "raw", "memory": "residual"}
TOPK_RAISE = dict(TOPK, nonfinite="raise")
TOPK_SPARSE_ALLREDUCE = dict(TOPK, aggregation={"id": "sparse_allreduce"})


class Net(nn.Module):
    """Four parameter tensors above and below the 1,000-element dense threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 48)
        self.fc2 = nn.Linear(48, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


TEACHER = torch.randn(32, 5, generator=torch.Generator().manual_seed(7))


def batch(worker: int, step: int):
    """A learnable task (a fixed linear teacher's labels), different inputs per worker and step."""
    g = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(16, 32, generator=g)
    return x, (x @ TEACHER).argmax(1)


def loss_of(model, worker, step):
    x, y = batch(worker, step)
    return nn.functional.cross_entropy(model(x), y)


def flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors]).numpy().copy()


def build(compression, sync_every, seed=0, inner="sgd", outer_lr=1.0, momentum=0.0, **kwargs):
    torch.manual_seed(seed)
    model = Net()
    inner_opt = torch.optim.SGD(model.parameters(), lr=0.1) if inner == "sgd" \
        else torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer_opt = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    return model, inner_opt, DiLoCo(model, inner_opt, outer_opt, sync_every=sync_every, compression=compression,
                                    **kwargs)


def inner_step(model, opt, worker, step):
    opt.zero_grad()
    loss_of(model, worker, step).backward()
    opt.step()


def scenario_equals_ddp(rank):
    """H = 1, lossless, outer SGD lr 1: DDP step for step, within float32 rounding."""
    torch.manual_seed(0)
    reference = DDP(Net())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, opt, diloco = build(LOSSLESS, 1)
    diffs, globals_ = [], []
    with diloco:
        for step in range(6):
            inner_step(reference, ref_opt, rank, step)
            inner_step(model, opt, rank, step)
            diffs.append(float(np.abs(flat(model.parameters()) - flat(reference.parameters())).max()))
            globals_.append(flat(diloco.globals))
    diloco.close()
    return {"diffs": diffs, "globals": globals_, "outer_steps": diloco.stats()["outer_steps"]}


def train_recording(compression, sync_every, steps, worker, **kwargs):
    """Train through the context manager; after every outer step, (globals, model, fragment applied)."""
    model, opt, diloco = build(compression, sync_every, inner="adamw", outer_lr=0.7, momentum=0.9, **kwargs)
    after, losses = [], []
    with diloco:
        for step in range(steps):
            applied = diloco.outer_steps
            losses.append(float(loss_of(model, worker, step)))
            inner_step(model, opt, worker, step)
            if diloco.outer_steps > applied:
                after.append((flat(diloco.globals), flat(model.parameters()), diloco.last_applied))
    stats = diloco.stats()
    diloco.close()
    return {"after": after, "losses": losses, "stats": stats, "groups": diloco.groups,
            "sizes": [p.numel() for _, p in diloco.named]}


def scenario_identical_globals(rank):
    return {"allgather": train_recording(TOPK, 3, 15, rank),
            "streaming": train_recording(TOPK, 4, 20, rank, fragments=2, delay=2),
            "sparse_allreduce": train_recording(TOPK_SPARSE_ALLREDUCE, 3, 12, rank),
            "flat_sparse_allreduce": train_recording(TOPK_SPARSE_ALLREDUCE, 3, 12, rank, flat=True)}


def scenario_conservation(rank, **kwargs):
    """Error feedback: the pseudo-gradients handed to the pipeline sum to what was sent plus the residual."""
    model, opt, diloco = build(TOPK, 2, outer_lr=1.0, **kwargs)
    handed, sent = {}, {}
    encode, core = diloco.pipeline.encode, diloco.pipeline.core

    def recording(tensor, name="", step=0):
        handed[name] = handed.get(name, 0) + tensor.detach().double().numpy().copy()
        payload = encode(tensor, name=name, step=step)
        decoded = core.decode(payload.numpy(), expected_shape=tuple(tensor.shape)).astype(np.float64)
        sent[name] = sent.get(name, 0) + decoded
        return payload

    diloco.pipeline.encode = recording
    with diloco:
        for step in range(10):
            inner_step(model, opt, rank, step)
    diloco.close()
    out = {}
    for name in handed:
        residual = core.memory.residual(name)
        residual = np.zeros_like(handed[name]) if residual is None else residual.astype(np.float64)
        out[name] = (float(np.abs(handed[name] - sent[name] - residual).max()), float(np.abs(handed[name]).max()),
                     float(np.abs(residual).max()))
    return out


def scenario_flat(rank):
    """``flat=True``: a lossless run equals the per-parameter one bit for bit (the same sums, one
    container per fragment), and error feedback is conserved per fragment."""
    runs = {}
    for flat_ in (False, True):
        model, opt, diloco = build(LOSSLESS, 2, flat=flat_)
        with diloco:
            for step in range(6):
                inner_step(model, opt, rank, step)
        diloco.close()
        runs[flat_] = (flat(diloco.globals), diloco.stats()["sent_bytes"])
    return {"equal": bool(np.array_equal(runs[False][0], runs[True][0])), "sent": [runs[False][1], runs[True][1]],
            "conservation": scenario_conservation(rank, flat=True)}


def scenario_delta_buffers(rank):
    """The Δ buffers live from a fragment's submission to its application only: after every inner
    step, which fragments hold one; at the end, how many of the buffers ever allocated are still
    alive (weak references, after a collection)."""
    import gc
    import weakref

    model, opt, diloco = build(TOPK, 4, fragments=2, delay=2)
    held, refs = [], []
    with diloco:
        for step in range(16):
            inner_step(model, opt, rank, step)
            held.append([d is not None for d in diloco.deltas])
            refs += [weakref.ref(d) for d in diloco.deltas if d is not None and all(r() is not d for r in refs)]
    diloco.close()
    gc.collect()
    return {"held": held, "allocated": len(refs), "alive": sum(r() is not None for r in refs),
            "outer_steps": diloco.outer_steps}


def record_sent(diloco, sent):
    """From now on append (name, step, container bytes) of every container ``diloco`` encodes to ``sent``."""
    encode = diloco.pipeline.encode

    def recording(tensor, name="", step=0):
        payload = encode(tensor, name=name, step=step)
        sent.append((name, step, payload.numpy().tobytes()))
        return payload
    diloco.pipeline.encode = recording


def saved_and_read_back(model, opt, diloco) -> dict:
    """Model, inner optimizer and DiLoCo state as ``torch.save`` writes them and
    ``torch.load(weights_only=True)`` reads them back (DiLoCo closed after its state is taken)."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": opt.state_dict(), "diloco": diloco.state_dict()}, buffer)
    diloco.close()
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def run_with_checkpoint(rank, steps, stop=None):
    """Train ``steps`` inner steps (fragments and a delay), recording every container sent after
    step ``stop``; with ``stop``, checkpoint there and continue in fresh objects."""
    kwargs = dict(fragments=2, delay=1)
    model, opt, diloco = build(TOPK, 3, inner="adamw", outer_lr=0.7, momentum=0.9, **kwargs)
    sent = []

    start = 0
    if stop is not None:
        with diloco:
            for step in range(stop):
                inner_step(model, opt, rank, step)
        saved = saved_and_read_back(model, opt, diloco)
        model, opt, diloco = build(TOPK, 3, seed=123, inner="adamw", outer_lr=0.7, momentum=0.9, **kwargs)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["inner"])
        diloco.load_state_dict(saved["diloco"])
        start = stop
    record_sent(diloco, sent)
    with diloco:
        for step in range(start, steps):
            inner_step(model, opt, rank, step)
    pending = diloco.in_flight is not None
    diloco.close()
    return {"sent": sent, "params": flat(model.parameters()), "globals": flat(diloco.globals),
            "stats": {k: v for k, v in diloco.stats().items() if k in ("outer_steps", "sent_bytes", "received_bytes")},
            "pending": pending}


def scenario_resume(rank):
    return {"whole": run_with_checkpoint(rank, 14),
            "resumed": run_with_checkpoint(rank, 14, stop=6)}   # fragment 0 is in flight at step 6


def scenario_checkpoint_refused(rank):
    """A checkpoint of another schedule or model is refused with a ConfigError naming the field."""
    model, opt, diloco = build(TOPK, 3)
    for step in range(4):
        inner_step(model, opt, rank, step)
        diloco.step()
    state = diloco.state_dict()
    diloco.close()
    out = {}
    other = build(TOPK, 4)[2]
    out["schedule"] = error_of(lambda: other.load_state_dict(state))
    other.close()
    target = build(TOPK, 3)[2]
    bad = dict(state, globals=dict(state["globals"], **{"fc1.weight": torch.zeros(2, 2)}))
    out["globals"] = error_of(lambda: target.load_state_dict(bad))
    out["pending"] = error_of(lambda: target.load_state_dict(dict(state, pending={"fragment": 5})))
    out["shards"] = error_of(lambda: target.load_state_dict(dict(state, shards={"fc1.weight": [[1], [2]]})))
    # a checkpoint written before shards were recorded (format 2) loads into an unsharded model
    out["format2"] = error_of(lambda: target.load_state_dict(dict({k: v for k, v in state.items() if k != "shards"},
                                                                  format=2)))
    target.load_state_dict(state)   # the good one still loads
    out["loaded"] = target.step_count
    target.close()
    return out


def scenario_disagree(rank):
    """Ranks that differ in H, fragments, delay, config or outer optimizer fail together."""
    out = {}
    cases = {"sync_every": dict(sync_every=4 + rank),
             "fragments": dict(fragments=1 + rank % 2),
             "delay": dict(fragments=2, delay=rank % 2),
             "config": dict(compression=LOSSLESS if rank % 2 else TOPK),
             "flat": dict(flat=rank % 2 == 1)}
    for case, kwargs in cases.items():
        args = dict(compression=TOPK, sync_every=4)
        args.update(kwargs)
        out[case] = error_of(lambda: build(args.pop("compression"), args.pop("sync_every"), **args))
    out["outer_lr"] = error_of(lambda: build(TOPK, 4, outer_lr=1.0 + rank % 2))
    # the group still works afterwards: one more DiLoCo trains
    model, opt, diloco = build(TOPK, 2)
    with diloco:
        for step in range(4):
            inner_step(model, opt, rank, step)
    diloco.close()
    out["after"] = flat(diloco.globals)
    return out


def scenario_nonfinite(rank):
    out = {}
    # propagate: the NaN reaches the outer optimizer on every worker and is counted
    model, opt, diloco = build(TOPK, 2)
    inner_step(model, opt, rank, 0)
    diloco.step()
    inner_step(model, opt, rank, 1)
    if rank == 1:
        with torch.no_grad():
            model.fc1.weight[0, 0] = float("nan")
    diloco.step()
    out["propagate"] = (bool(torch.isnan(torch.cat([g.reshape(-1) for g in diloco.globals])).any()),
                        diloco.stats()["nonfinite_propagated"])
    diloco.close()
    # raise: every worker raises, globals, outer state and residuals as before, local reset to global
    model, opt, diloco = build(TOPK_RAISE, 2, outer_lr=0.7, momentum=0.9)
    for step in range(2):
        inner_step(model, opt, rank, step)
        diloco.step()
    residuals = diloco.pipeline.core.memory.residual
    before = (flat(diloco.globals), {n: residuals(n).copy() for n, _ in diloco.named if residuals(n) is not None},
              {k: v["momentum_buffer"].clone() for k, v in diloco.outer.state_dict()["state"].items()})
    inner_step(model, opt, rank, 2)
    diloco.step()
    inner_step(model, opt, rank, 3)
    if rank == 1:
        with torch.no_grad():
            model.fc2.weight[1, 1] = float("inf")
    out["raise_error"] = error_of(diloco.step)
    out["raise_state_kept"] = (
        bool(np.array_equal(before[0], flat(diloco.globals))),
        bool(before[1]) and all(np.array_equal(v, residuals(k)) for k, v in before[1].items()),
        all(torch.equal(v, diloco.outer.state_dict()["state"][k]["momentum_buffer"]) for k, v in before[2].items()),
        bool(np.array_equal(flat(model.parameters()), flat(diloco.globals))))
    for step in range(4, 6):   # training goes on alike
        inner_step(model, opt, rank, step)
        diloco.step()
    out["raise_after"] = flat(diloco.globals)
    diloco.close()
    return out


SCENARIOS = [scenario_equals_ddp, scenario_identical_globals, scenario_conservation, scenario_flat, scenario_resume,
             scenario_checkpoint_refused, scenario_nonfinite, scenario_disagree, scenario_delta_buffers]


def run(rank, world, port, queue):
    run_scenarios(rank, world, port, queue, SCENARIOS, 280)


def scenario_nested(rank):
    """4 ranks: workers {0, 1} and {2, 3}, each a 2-rank DDP group; DiLoCo over {0, 2} and {1, 3}."""
    ddp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    outer_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    worker, local = divmod(rank, 2)
    torch.manual_seed(worker)   # the workers start apart: DiLoCo's broadcast makes them equal
    net = Net()
    model = DDP(net, process_group=ddp_groups[worker])
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    diloco = DiLoCo(model, inner, outer, sync_every=3, compression=TOPK, group=outer_groups[local])
    after, losses = [], []
    with diloco:
        for step in range(13):   # the last step is a local one
            applied = diloco.outer_steps
            inner.zero_grad()
            loss = loss_of(model, 2 * worker + local, step)
            loss.backward()
            inner.step()
            losses.append(float(loss.detach()))
            if diloco.outer_steps > applied:
                after.append(flat(diloco.globals))
    diloco.close()
    return {"after": after, "params": flat(model.parameters()), "losses": losses}


def run_nested(rank, world, port, queue):
    run_scenarios(rank, world, port, queue, [scenario_nested], 200)
