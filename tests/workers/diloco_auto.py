"""Gloo ranks (torch.multiprocessing spawn) for tests/test_diloco_auto.py: ``DiLoCo(sync_every="auto")``
(the workers measure and choose H), the mix ``alpha > 0``, the shipped semi-synchronous configs and
``aggregation: auto`` through the outer loop. One launch runs every scenario."""
import io
import os
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diloco import TOPK, build, flat, inner_step, loss_of, record_sent  # noqa: E402
from torch_ddp_hook import error_of, run_scenarios  # noqa: E402

from deepreduce.collective.cost_model import CodecCosts, Link  # noqa: E402
from deepreduce.torch import DiLoCo  # noqa: E402

#: A Top-1% codec's costs, fixed so the choice depends on the link alone.
CODEC = CodecCosts("fixed", 0.01, 20e-6, 2e-9, 20e-6, 0.0, 5e-9, 64, 8)
SLOW, FAST = Link.from_gbit(1e-4, 25e-6), Link.from_gbit(100.0, 25e-6)
CANDIDATES = (1, 2, 5, 10, 20, 50, 100, 200, 500)


def train(model, opt, diloco, rank, steps, start=0):
    """Inner steps through the context manager; (step, globals) after every outer step."""
    after = []
    with diloco:
        for step in range(start, steps):
            applied = diloco.outer_steps
            inner_step(model, opt, rank, step)
            if diloco.outer_steps > applied:
                after.append((step + 1, flat(diloco.globals)))
    return after


def scenario_auto_measured(rank):
    """Every input measured: compute, link probe, the config's codec probe."""
    model, opt, diloco = build(TOPK, "auto", inner="adamw", outer_lr=0.7, momentum=0.9, auto_probe_steps=3,
                               auto_candidates=(2, 4, 8))
    before = []
    with diloco:
        for step in range(3):
            before.append((diloco.stats()["sync_every"], diloco.outer_steps))
            inner_step(model, opt, rank, step)
    chosen = diloco.stats()
    after = train(model, opt, diloco, rank, 3 + 2 * 8, start=3)
    stats = diloco.stats()
    diloco.close()
    return {"before": before, "chosen": chosen, "after": after, "stats": stats}


def choose_with(link, compression=TOPK, codec=CODEC, **kwargs):
    inputs = {"link": link, "compute_s": 0.05}
    if codec is not None:
        inputs["codec"] = codec
    model, opt, diloco = build(compression, "auto", auto_probe_steps=2, auto_inputs=inputs,
                               auto_candidates=CANDIDATES, **kwargs)
    train(model, opt, diloco, rank=0, steps=2)
    decision = diloco.stats()["sync_period"]
    diloco.close()
    return decision


def scenario_auto_links(rank):
    """The same model and codec over a slow and a fast (injected) link; the shipped chunked
    config's costs measured (its k per chunk priced as a ratio); the sparse all-reduce's option."""
    return {"slow": choose_with(SLOW), "fast": choose_with(FAST),
            "sparseloco": choose_with(SLOW, compression="sparseloco", codec=None),
            "sparse_allreduce": choose_with(SLOW, compression=dict(TOPK, aggregation={"id": "sparse_allreduce"})),
            "lossless": error_of(lambda: build(None, "auto")),
            "lossless_given": choose_with(SLOW, compression=None)}


def run_with_checkpoint(rank, steps, stop=None):
    """sync_every="auto" with the slow link (H = 4 of (2, 3, 4)); with ``stop``, checkpoint there
    and continue in fresh objects built with the fast link (which alone would choose H = 2)."""
    def make(link, seed):
        return build(TOPK, "auto", seed=seed, inner="adamw", outer_lr=0.7, momentum=0.9, auto_probe_steps=2,
                     auto_candidates=(2, 3, 4), auto_inputs={"link": link, "compute_s": 0.05, "codec": CODEC})

    model, opt, diloco = make(SLOW, 0)
    sent = []
    start, checkpointed = 0, None
    if stop is not None:
        train(model, opt, diloco, rank, stop)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "inner": opt.state_dict(), "diloco": diloco.state_dict()}, buffer)
        diloco.close()
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        checkpointed = saved["diloco"]["sync_period"]
        model, opt, diloco = make(FAST, 123)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["inner"])
        diloco.load_state_dict(saved["diloco"])
        start = stop
    record_sent(diloco, sent)
    after = train(model, opt, diloco, rank, steps, start)
    stats = diloco.stats()
    diloco.close()
    return {"sent": sent, "after": after, "params": flat(model.parameters()), "globals": flat(diloco.globals),
            "sync_every": stats["sync_every"], "decision": stats["sync_period"], "checkpointed": checkpointed,
            "bytes": (stats["outer_steps"], stats["sent_bytes"], stats["received_bytes"])}


def scenario_auto_resume(rank):
    fast = choose_with(FAST)["sync_every"]
    return {"whole": run_with_checkpoint(rank, 18), "resumed": run_with_checkpoint(rank, 18, stop=6),
            "while_probing": run_with_checkpoint(rank, 10, stop=1), "fast_alone": fast}


def scenario_auto_checkpoint_refused(rank):
    """An "auto" checkpoint into a DiLoCo of a fixed H, and a decision of an H not among the
    candidates: ConfigErrors naming the problem; the good checkpoint still loads."""
    model, opt, diloco = build(TOPK, "auto", auto_probe_steps=2, auto_candidates=(2, 3, 4),
                               auto_inputs={"link": SLOW, "compute_s": 0.05, "codec": CODEC})
    train(model, opt, diloco, rank, 3)
    state = diloco.state_dict()
    diloco.close()
    fixed = build(TOPK, 4)[2]
    out = {"fixed": error_of(lambda: fixed.load_state_dict(state))}
    fixed.close()
    target = build(TOPK, "auto", auto_probe_steps=2, auto_candidates=(2, 3, 4))[2]
    bad = dict(state, sync_period=dict(state["sync_period"], sync_every=7))
    out["candidate"] = error_of(lambda: target.load_state_dict(bad))
    target.load_state_dict(state)
    out["loaded"] = (target.step_count, target.stats()["sync_every"])
    target.close()
    return out


def scenario_auto_disagree(rank):
    """One worker asks for "auto", the other for H = 4: the same error on both, before any outer step."""
    return error_of(lambda: build(TOPK, "auto" if rank == 0 else 4))


def scenario_alpha(rank):
    """alpha = 0.3 with a delay of 1: at the apply, theta = 0.3 theta_local + 0.7 theta_global."""
    out = {}
    for delay in (0, 1):
        model, opt, diloco = build(TOPK, 3, inner="adamw", outer_lr=0.7, momentum=0.9, delay=delay, alpha=0.3)
        gaps, moved, globals_ = [], [], []
        for step in range(12):
            inner_step(model, opt, rank, step)
            local = flat(model.parameters()).astype(np.float64)
            applied = diloco.outer_steps
            diloco.step()
            if diloco.outer_steps > applied:
                g = flat(diloco.globals).astype(np.float64)
                expected = 0.3 * local + 0.7 * g
                gaps.append(float(np.abs(flat(model.parameters()) - expected).max()))
                moved.append(float(np.abs(local - g).max()))
                globals_.append(flat(diloco.globals))
        diloco.close()
        out[delay] = {"gaps": gaps, "moved": moved, "globals": globals_}
    return out


class Wide(nn.Module):
    """A weight of 8,192 elements (two chunks of 4,096) and three small tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 256)
        self.fc2 = nn.Linear(256, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def shipped(config, rank, steps=12, sync_every=2):
    """``config`` through DiLoCo (SparseLoCo's plain averaging: outer SGD at lr 1); per parameter
    and outer step (residual before, pseudo-gradient handed, what the receiver decodes), the final
    residuals and the global parameters after every outer step."""
    torch.manual_seed(0)
    model = Wide()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    diloco = DiLoCo(model, inner, outer, sync_every=sync_every, compression=config)
    core = diloco.pipeline.core
    encode = diloco.pipeline.encode
    records = {}

    def residual(name, like):
        held = core.memory.residual(name)
        return np.zeros_like(like) if held is None else np.asarray(held, dtype=np.float64).copy()

    def recording(tensor, name="", step=0):
        handed = tensor.detach().double().numpy().copy()
        before = residual(name, handed)
        payload = encode(tensor, name=name, step=step)
        decoded = core.decode(payload.numpy(), expected_shape=tuple(tensor.shape)).astype(np.float64)
        records.setdefault(name, []).append((before, handed, decoded.reshape(handed.shape)))
        return payload

    diloco.pipeline.encode = recording
    after = []
    with diloco:
        for step in range(steps):
            applied = diloco.outer_steps
            inner.zero_grad()
            loss_of(model, rank, step).backward()
            inner.step()
            if diloco.outer_steps > applied:
                after.append(flat(diloco.globals))
    stats = diloco.stats()
    diloco.close()
    final = {name: residual(name, rows[-1][1]) for name, rows in records.items()}
    return {"records": records, "final": final, "after": after, "stats": stats,
            "decay": float(core.memory.decay)}


def scenario_shipped(rank):
    return {config: shipped(config, rank) for config in ("sparseloco", "semisync_topk")}


def scenario_aggregation_auto(rank):
    """``aggregation: auto`` (a given link, so no probe) through the outer loop."""
    config = dict(TOPK, aggregation={"id": "auto", "bandwidth_gbit": 1.0})
    model, opt, diloco = build(config, 2, inner="adamw", outer_lr=0.7, momentum=0.9)
    after = train(model, opt, diloco, rank, 10)
    stats = diloco.stats()
    diloco.close()
    return {"after": after, "plan": stats.get("plan"), "outer_steps": stats["outer_steps"],
            "routes": stats.get("routes_taken")}


SCENARIOS = [scenario_auto_measured, scenario_auto_links, scenario_auto_resume, scenario_auto_checkpoint_refused,
             scenario_auto_disagree,
             scenario_alpha, scenario_shipped, scenario_aggregation_auto]


def run(rank, world, port, queue):
    run_scenarios(rank, world, port, queue, SCENARIOS, 280)
