"""One rank of ``deepreduce reproduce quality``: the language model trained with each method in turn.

Started by :mod:`experiments.reproduce.quality` (inside a network namespace, ``ip netns exec``),
one process per rank, joined by torch.distributed (gloo over TCP). For each method it rebuilds
the same seeded :class:`~experiments.lm.model.TransformerLM`, wraps it in
``DistributedDataParallel`` with one bucket for the whole gradient (so the hook runs once per step,
after backward, for every method alike) and registers the method's communication hook:

* ``{"ddp_hook": "allreduce" | "fp16" | "powersgd"}``: PyTorch's own hooks as PyTorch ships
  them (:mod:`experiments.reproduce.torch_hooks`; ``allreduce`` is DDP's default behaviour);
* a deepreduce config (dict): deepreduce's DDP hook (:func:`deepreduce.torch.ddp.register`).

It then trains ``--steps`` steps of AdamW on the same batches for every method
(:meth:`experiments.lm.data.LMData.batch`), keeping a clock of training time only (forward,
backward with the hook's communication, optimizer step; not evaluation), and every
``--eval-every`` steps evaluates the validation windows (half on each rank, summed). After the
budget, ``--profile-steps`` more steps split a step into codec and communication: PyTorch's hooks
through :class:`~experiments.reproduce.torch_hooks.HookTimer` (which waits for each collective
where it is issued, so it only runs in these steps and never distorts the training clock),
deepreduce's through its state's counters. Rank 0 appends one JSON object per line to
``--events``: ``{"method", "step", "time_s", "val_loss", "bpb", "train_loss"}`` at each evaluation
and ``{"method", "summary": {...}}`` at the end of a method.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import statistics
import time
from typing import List, Optional

import numpy as np

from .common import leave


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one rank of deepreduce reproduce quality")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--init", required=True, help="torch.distributed init method, tcp://ADDR:PORT")
    p.add_argument("--methods", required=True, help="JSON: list of [name, hook spec or deepreduce config]")
    p.add_argument("--data", required=True, help="the tokenised corpus (.npz from experiments.lm.data.load)")
    p.add_argument("--model", required=True, help="JSON: LMConfig fields")
    p.add_argument("--steps", type=int, required=True, help="training steps per method (the token budget)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-windows", type=int, default=64, help="validation windows (over all ranks)")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--events", default=None, help="rank 0 appends JSON lines here")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    return p.parse_args(argv)


class TorchHookSplit:
    """A PyTorch hook that runs plain while training and under a HookTimer while profiling."""

    def __init__(self, ddp, method: dict) -> None:
        from . import torch_hooks

        state, hook = torch_hooks.make(method)
        self.timer = torch_hooks.HookTimer()
        timed = self.timer.wrap(hook)
        self.profiling = False
        ddp.register_comm_hook(state, lambda s, bucket: (timed if self.profiling else hook)(s, bucket))

    @contextlib.contextmanager
    def profile(self):
        """Time the hooks of the steps inside: yields a dict filled with codec_s, comm_s, bytes."""
        self.timer.reset()
        self.profiling = True
        out: dict = {}
        try:
            with self.timer:
                yield out
        finally:
            self.profiling = False
        out.update(codec_s=self.timer.encode_s + self.timer.decode_s, comm_s=self.timer.comm_s,
                   bytes=self.timer.bytes)


class DeepReduceSplit:
    """deepreduce's DDP hook; ``profile()`` reads its state's counters around the steps inside."""

    def __init__(self, ddp, config: dict) -> None:
        from deepreduce.torch.ddp import register

        self.state = register(ddp, config)

    @contextlib.contextmanager
    def profile(self):
        before = self.state.compression_stats()
        out: dict = {}
        yield out
        after = self.state.compression_stats()

        def delta(key):
            return after[key] - before[key]

        out.update(codec_s=delta("encode_seconds") + delta("decode_seconds"), comm_s=delta("communication_seconds"),
                   bytes=delta("collective_bytes"))


def evaluate(model, ids, targets, data) -> tuple:
    """``(mean validation loss in nats per token, bits per byte)`` over every rank's windows."""
    import torch
    import torch.distributed as dist

    from ..lm.model import loss_sum

    model.eval()
    with torch.no_grad():
        total = loss_sum(model, torch.from_numpy(ids), torch.from_numpy(targets)).item() if len(ids) else 0.0
    model.train()
    sums = torch.tensor([total, targets.size, data.bytes_of(targets)], dtype=torch.float64)
    dist.all_reduce(sums)
    loss, tokens, nbytes = sums.tolist()
    return loss / tokens, data.bits_per_byte(loss / tokens, int(tokens), int(nbytes))


def train_method(args, name: str, method, data, config, val, emit) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ..lm.model import TransformerLM, loss_sum
    from . import torch_hooks

    torch.manual_seed(args.seed)
    model = TransformerLM(config)
    # One bucket for the whole gradient: PowerSGD issues its second all_reduce from a future's
    # callback, which gloo runs on its own thread, so with several buckets those collectives could
    # reach the group in a different order on each rank. Every method gets the same single bucket.
    whole_mib = math.ceil(4 * sum(p.numel() for p in model.parameters()) / 2 ** 20) + 1
    ddp = DistributedDataParallel(model, bucket_cap_mb=whole_mib)
    split = TorchHookSplit(ddp, method) if torch_hooks.is_hook(method) else DeepReduceSplit(ddp, method)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))

    def step(k: int) -> float:
        ids, targets = (torch.from_numpy(a) for a in data.batch(k, args.rank, args.batch, config.context, args.seed))
        opt.zero_grad(set_to_none=True)
        loss = loss_sum(ddp, ids, targets) / targets.numel()
        loss.backward()
        opt.step()
        schedule.step()
        return loss.item()

    val_loss, bpb = evaluate(model, *val, data)
    emit({"method": name, "step": 0, "time_s": 0.0, "val_loss": val_loss, "bpb": bpb, "train_loss": None})
    clock, losses = 0.0, []
    dist.barrier()
    for k in range(args.steps):
        start = time.perf_counter()
        losses.append(step(k))
        clock += time.perf_counter() - start
        if (k + 1) % args.eval_every == 0 or k + 1 == args.steps:
            val_loss, bpb = evaluate(model, *val, data)
            emit({"method": name, "step": k + 1, "time_s": clock, "val_loss": val_loss, "bpb": bpb,
                  "train_loss": float(np.mean(losses[-args.eval_every:]))})
            if not math.isfinite(val_loss):
                break           # diverged: the summary says so, the next method runs
    totals, codec, comm, sent = [], [], [], []
    for k in range(args.steps, args.steps + args.profile_steps):
        with split.profile() as measured:
            start = time.perf_counter()
            step(k)
            totals.append(time.perf_counter() - start)
        codec.append(measured["codec_s"])
        comm.append(measured["comm_s"])
        sent.append(measured["bytes"])
    # The slower rank sets the pace: report the max over ranks of each median.
    stats = torch.tensor([statistics.median(totals), statistics.median(codec), statistics.median(comm),
                          float(np.mean(sent))], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    total_s, codec_s, comm_s, nbytes = stats.tolist()
    emit({"method": name, "summary": {
        "step_s": total_s, "codec_s": codec_s, "comm_s": comm_s, "compute_s": max(0.0, total_s - codec_s - comm_s),
        "bytes_per_step": nbytes, "dense_bytes": 4 * sum(p.numel() for p in model.parameters()),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_time_s": clock}})
    dist.barrier()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from ..lm.data import read
    from ..lm.model import LMConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    data = read(args.data)
    config = LMConfig(**json.loads(args.model))
    ids, targets = data.validation(args.eval_windows, config.context)
    val = (ids[args.rank::args.world], targets[args.rank::args.world])
    events = open(args.events, "a", encoding="utf-8") if args.rank == 0 and args.events else None

    def emit(event: dict) -> None:
        if events is not None:
            events.write(json.dumps(event) + "\n")
            events.flush()

    try:
        for name, method in json.loads(args.methods):
            train_method(args, name, method, data, config, val, emit)
    finally:
        if events is not None:
            events.close()
    return 0


if __name__ == "__main__":
    leave(main())
