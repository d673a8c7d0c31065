"""Worker (horovodrun -np 2): ranks that disagree fail together within seconds; a non-finite step is
skipped by both ranks. One launch runs every scenario; each prints "OK <rank> <scenario> ..." lines.

* a wider layer on rank 1, an extra layer on rank 1, GradiVeQ() on rank 1 against a config on
  rank 0: loss.backward() raises the same CommunicationError on both ranks, naming the first
  difference, before any per-tensor collective starts;
* ``nonfinite: raise``: rank 1's gradient is NaN at step 1; both ranks raise the same
  NonFiniteGradientError from step(), the weights and residuals are those of before the step, and
  the following steps run and leave the ranks identical (the README's skip-the-step loop).
"""
import time

import horovod.torch as hvd
import numpy as np
import torch

import deepreduce.torch as drt
from deepreduce import CommunicationError, NonFiniteGradientError

TOPK = {"sparsifier": {"id": "topk", "ratio": 0.1}, "index": "raw", "value": "raw", "memory": "residual",
        "min_numel": 100}


def model_of(hidden=16, extra=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)]
    if extra:
        layers += [torch.nn.ReLU(), torch.nn.Linear(4, 4)]
    return torch.nn.Sequential(*layers)


def optimizer_of(model, compression):
    return drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), compression=compression)


def batch(rank, step, nan=False):
    rng = np.random.default_rng([rank, step])
    x = torch.from_numpy(rng.standard_normal((8, 8)).astype(np.float32))
    if nan:
        x[0, 0] = float("nan")
    return x, torch.from_numpy(rng.integers(0, 4, 8))


def backward_error(model, opt):
    """(message, seconds) of the CommunicationError that the first backward must raise."""
    start = time.perf_counter()
    x, y = batch(hvd.rank(), 0)
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    except CommunicationError as exc:
        return str(exc), time.perf_counter() - start
    raise SystemExit(f"rank {hvd.rank()}: no error for ranks that disagree")


COMPARISONS = []


def same_on_every_rank(text):
    COMPARISONS.append(text)
    data = torch.from_numpy(np.frombuffer(text.encode().ljust(600)[:600], dtype=np.uint8).copy())
    gathered = hvd.allgather(data[None, :], name=f"compare.{len(COMPARISONS)}").numpy()
    return all(np.array_equal(gathered[0], row) for row in gathered)


def report(scenario, message, seconds, *expected):
    assert all(e in message for e in expected), message
    assert seconds < 20, f"{scenario} took {seconds:.1f} s"
    assert same_on_every_rank(message), f"{scenario}: the ranks raised different errors: {message}"
    print(f"OK {hvd.rank()} {scenario} {seconds:.2f}s {message}", flush=True)


def scenario_wider_layer():
    model = model_of(hidden=16 + hvd.rank())
    message, seconds = backward_error(model, optimizer_of(model, TOPK))
    report("wider_layer", message, seconds, "parameter '0.weight' is (16, 8) float32 on rank 0 and (17, 8) "
           "float32 on rank 1")


def scenario_extra_layer():
    model = model_of(extra=hvd.rank() == 1)
    message, seconds = backward_error(model, optimizer_of(model, TOPK))
    report("extra_layer", message, seconds, "rank 1 has parameter '4.weight' (4, 4) float32 that rank 0 lacks")


def scenario_mixed_compressors():
    model = model_of()
    message, seconds = backward_error(model, optimizer_of(model, drt.GradiVeQ() if hvd.rank() else TOPK))
    report("mixed_compressors", message, seconds, "rank 0 uses deepreduce config (sparsifier topk",
           "rank 1 uses GradiVeQ(")


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def residuals(opt):
    return {k: v.copy() for k, v in opt._reduction.pipeline.core.memory.state_dict()["residuals"].items()}


def scenario_nonfinite_skip():
    model = model_of(hidden=32)
    opt = optimizer_of(model, dict(TOPK, nonfinite="raise"))
    skipped = []
    for step in range(4):
        x, y = batch(hvd.rank(), step, nan=step == 1 and hvd.rank() == 1)
        weights, kept = flat(model), residuals(opt)
        try:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        except NonFiniteGradientError as exc:       # the documented skip-the-step pattern
            opt.zero_grad()
            np.testing.assert_array_equal(flat(model), weights)          # nothing applied
            now = residuals(opt)
            assert sorted(now) == sorted(kept) and all(np.array_equal(now[k], kept[k]) for k in kept)
            skipped.append((step, str(exc)))
            continue
        opt.zero_grad()
    assert [s for s, _ in skipped] == [1], skipped
    message = skipped[0][1]
    assert "at step 1" in message and "on rank 1" in message and "nonfinite='raise'" in message, message
    assert same_on_every_rank(message), message
    gathered = hvd.allgather(torch.from_numpy(flat(model))[None, :], name="nonfinite.final").numpy()
    assert np.array_equal(gathered[0], gathered[1]), "ranks diverged after the skipped step"
    assert np.isfinite(gathered).all() and not np.array_equal(gathered[0], flat(model_of(hidden=32)))
    print(f"OK {hvd.rank()} nonfinite_skip {message}", flush=True)


def main():
    hvd.init()
    torch.set_num_threads(1)
    scenario_wider_layer()
    scenario_extra_layer()
    scenario_mixed_compressors()
    scenario_nonfinite_skip()


if __name__ == "__main__":
    main()
