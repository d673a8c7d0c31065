"""One rank of ``deepreduce reproduce semisync``: one method trained (``train``) or timed (``profile``).

Started by :mod:`experiments.reproduce.semisync` over loopback (gloo), one process per rank.
Every method starts from the same seeded :class:`~experiments.lm.model.TransformerLM` and sees the
same batches (:meth:`experiments.lm.data.LMData.batch` of ``(seed, step, rank)``), with AdamW and
a linear warm-up; the rows differ only in how the ranks communicate
(:mod:`experiments.reproduce.semisync_methods`): a DDP hook every step (one bucket for the whole
gradient, so the hook runs once per step after backward), or :class:`deepreduce.torch.DiLoCo`
around the plain model.

``train``: a :class:`~experiments.reproduce.comm_record.CollectiveRecorder` records the messages of
every training step (not of evaluation), and at the method's evaluation steps the validation
loss is measured (half the windows on each rank, summed). Each rank writes
``{"rank", "world", "parameters", "curve": [{"step", "val_loss", "bpb", "train_loss"}],
"steps": [[[op, bytes_in, bytes_received], ...] per step], "stats", "inside", "extra"}`` to
``--out`` (``inside``: ``[sent, received]`` of the calls a caller's ``on_link`` predicate leaves
out of ``steps``, see :func:`train`; ``extra``: the runner's own figures). No clock is kept: the
machine may be busy while this runs.

``profile``: ``--profile-steps`` steps timed with ``perf_counter`` (the DiLoCo rows with H cut to
``--profile-sync`` so that some steps carry an outer step); each rank writes
``{"rank", "steps": [[seconds, synced], ...]}``. The time phase runs this on an idle machine.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import time
from typing import List, Optional

import numpy as np

from .common import leave
from .quality_worker import evaluate


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one rank of deepreduce reproduce semisync")
    p.add_argument("--mode", choices=("train", "profile"), default="train")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--init", required=True, help="torch.distributed init method, tcp://ADDR:PORT")
    p.add_argument("--method", required=True, help="JSON: [name, method] (semisync_methods)")
    p.add_argument("--data", required=True, help="the tokenised corpus (.npz from experiments.lm.data.load)")
    p.add_argument("--budget", required=True, help="JSON: semisync_methods.Budget fields")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="this rank's JSON result")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    return p.parse_args(argv)


class Runner:
    """The model, optimizers and communication of one method on this rank; ``step(k)`` trains one step."""

    def __init__(self, name: str, method: dict, plan, rank: int, seed: int, data, profile: bool) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from ..lm.model import TransformerLM
        from .semisync_methods import sync_every

        self.name, self.method, self.plan, self.rank, self.seed, self.data = name, method, plan, rank, seed, data
        torch.manual_seed(seed)
        self.model = TransformerLM(plan.model())
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.state = self.diloco = None
        if method["kind"] == "ddp":
            whole_mib = math.ceil(4 * self.parameters / 2 ** 20) + 1
            self.forward = DistributedDataParallel(self.model, bucket_cap_mb=whole_mib)
            if "hook" in method:
                from . import torch_hooks

                state, hook = torch_hooks.make(torch_hooks.spec(method["hook"]))
                self.forward.register_comm_hook(state, hook)
            else:
                from deepreduce.torch.ddp import register

                self.state = register(self.forward, method["config"])
        else:
            self.forward = self.model
        self.optimizers()
        if method["kind"] == "diloco":
            from deepreduce.torch import DiLoCo

            from .semisync_methods import outer_sgd

            compression = method["compression"]
            if method.get("aggregation"):
                compression = dict(compression, aggregation={"id": method["aggregation"]})
            outer = torch.optim.SGD(self.model.parameters(), **outer_sgd(method["outer"]))
            h = min(sync_every(method, plan), plan.profile_sync) if profile else sync_every(method, plan)
            self.diloco = DiLoCo(self.model, self.opt, outer, sync_every=h, compression=compression,
                                 fragments=method.get("fragments", 1), delay=method.get("delay", 0),
                                 flat=method.get("flat", False))

    def optimizers(self) -> None:
        """AdamW (betas 0.9, 0.95, no weight decay) with a linear warm-up, the same for every method."""
        import torch

        plan = self.plan
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=plan.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / plan.warmup))

    def step(self, k: int) -> float:
        import torch

        from ..lm.model import loss_sum

        ids, targets = (torch.from_numpy(a) for a in self.data.batch(k, self.rank, self.plan.batch,
                                                                     self.plan.context, self.seed))
        self.opt.zero_grad(set_to_none=True)
        loss = loss_sum(self.forward, ids, targets) / targets.numel()
        loss.backward()
        self.opt.step()
        self.schedule.step()
        if self.diloco is not None:
            self.diloco.step()
        return loss.item()

    def stats(self) -> dict:
        if self.diloco is not None:
            return plain_stats(self.diloco.stats())
        if self.state is not None:
            return plain_stats(self.state.compression_stats())
        return {}


def plain_stats(stats: dict) -> dict:
    """A stats dict with only JSON-able leaves (numbers, strings, lists and dicts of them)."""
    out = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            out[str(key)] = plain_stats(value)
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[str(key)] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
            out[str(key)] = list(value)
        elif hasattr(value, "item"):
            out[str(key)] = value.item()
    return out


@contextlib.contextmanager
def global_view(runner):
    """The model holding DiLoCo's global parameters while evaluated, for a streaming row.

    A DiLoCo row is evaluated at its outer steps, where every worker holds θ_global, except a
    streaming one (``fragments`` > 1 or ``delay`` > 0): there the other fragments trained on
    locally since their syncs and a delayed reduction is not applied yet, so each rank would
    evaluate its own local model. Streaming DiLoCo evaluates the global model; so does this (the
    parameters of the last applied reductions; one in flight is not in them). Other rows: unchanged.
    """
    import torch

    diloco = getattr(runner, "diloco", None)
    method = getattr(runner, "method", {})
    if diloco is None or (method.get("fragments", 1) == 1 and method.get("delay", 0) == 0):
        yield
        return
    saved = [p.detach().clone() for _, p in diloco.named]
    with torch.no_grad():
        for (_, p), g in zip(diloco.named, diloco.globals):
            p.copy_(g)
    try:
        yield
    finally:
        with torch.no_grad():
            for (_, p), local in zip(diloco.named, saved):
                p.copy_(local)


def train(args, name: str, method: dict, plan, data, make_runner=None, on_link=None) -> dict:
    """Train and record (see the module docstring). ``make_runner``: the runner's class (default
    :class:`Runner`; :mod:`~experiments.reproduce.hsdp_worker` passes its FSDP one). ``on_link``:
    a predicate on a recorded call; only the calls it accepts are the step's messages (the others'
    bytes are summed into ``"inside": [sent, received]``). The runner's ``extra()``, if it has one,
    goes into ``"extra"``."""
    from .comm_record import CollectiveRecorder
    from .semisync_methods import eval_steps

    ids, targets = data.validation(plan.eval_windows, plan.context)
    val = (ids[args.rank::args.world], targets[args.rank::args.world])
    recorder = CollectiveRecorder().install()
    inside = [0, 0]
    try:
        runner = (make_runner or Runner)(name, method, plan, args.rank, args.seed, data, profile=False)
        recorder.take()                    # set-up traffic (DDP's parameter broadcast) is not a step's
        loss, bpb = evaluate(runner.model, *val, data)
        curve = [{"step": 0, "val_loss": loss, "bpb": bpb, "train_loss": None}]
        wanted, steps, losses = set(eval_steps(method, plan)), [], []
        for k in range(plan.steps):
            recorder.recording = True
            losses.append(runner.step(k))
            recorder.recording = False
            calls = recorder.take()
            for c in calls:
                if on_link is not None and not on_link(c):
                    inside[0] += c["bytes_in"]
                    inside[1] += c["bytes_received"]
            steps.append([[c["op"], c["bytes_in"], c["bytes_received"]] for c in calls
                          if on_link is None or on_link(c)])
            if k + 1 in wanted:
                with global_view(runner):
                    loss, bpb = evaluate(runner.model, *val, data)
                curve.append({"step": k + 1, "val_loss": loss, "bpb": bpb,
                              "train_loss": float(np.mean(losses[-plan.eval_every:]))})
                if not math.isfinite(loss):
                    break                  # diverged: the table says so
        return {"rank": args.rank, "world": args.world, "parameters": runner.parameters, "curve": curve,
                "steps": steps, "stats": runner.stats(), "inside": inside,
                "extra": runner.extra() if hasattr(runner, "extra") else {}}
    finally:
        recorder.uninstall()


def profile(args, name: str, method: dict, plan, data, make_runner=None, on_link=None) -> dict:
    """Time ``plan.profile_steps`` steps; a step is ``synced`` when it sent a message (one that
    ``on_link`` accepts, when given)."""
    import torch.distributed as dist

    from .comm_record import CollectiveRecorder

    recorder = CollectiveRecorder().install()
    try:
        runner = (make_runner or Runner)(name, method, plan, args.rank, args.seed, data, profile=True)
        runner.step(0)                     # first-call allocations and the engine's warm-up
        recorder.take()
        timed = []
        for k in range(1, plan.profile_steps + 1):
            dist.barrier()
            recorder.recording = True
            start = time.perf_counter()
            runner.step(k)
            elapsed = time.perf_counter() - start
            recorder.recording = False
            timed.append([elapsed, any(on_link is None or on_link(c) for c in recorder.take())])
        return {"rank": args.rank, "steps": timed}
    finally:
        recorder.uninstall()


def main(argv: Optional[List[str]] = None, args=None, make_runner=None, on_link=None) -> int:
    """One rank: parse ``argv`` (or take parsed ``args``), join the group, train or profile, write
    the JSON. ``make_runner`` and ``on_link``: see :func:`train`."""
    args = args if args is not None else parse_args(argv)
    import torch
    import torch.distributed as dist

    from ..lm.data import read
    from .semisync_methods import Budget

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    data = read(args.data)
    plan = Budget(**json.loads(args.budget))
    name, method = json.loads(args.method)
    result = (train if args.mode == "train" else profile)(args, name, method, plan, data, make_runner, on_link)
    result.update(method=name, mode=args.mode)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    os.replace(tmp, args.out)
    dist.barrier()
    return 0


if __name__ == "__main__":
    leave(main())
