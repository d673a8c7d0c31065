"""Worker: the background encoder sends the same bytes and trains the same parameters as the
synchronous path, and an error raised on the worker surfaces in step() without wedging anything.

Part 1, for Top-r raw and BF-P0 (both with residual memory): two copies of one model, one
optimizer encoding on the worker thread and one inside the backward hook, take the same steps;
every container each rank sends (recorded per tensor and step) and the parameters after every
step must be identical, and the parameters must agree across ranks.

The same check runs a third copy whose codecs take the torch device path (``path="device"``:
the core on torch tensors, decode-accumulate into ``p.grad`` as a tensor): identical containers
and parameters to the host path.

Part 2: with ``nonfinite: raise``, a NaN gradient injected on every rank at one step makes
step() raise NonFiniteGradientError naming the parameter (decided by every rank together); zero_grad() and the next steps work
and the ranks still agree. Prints "OK <rank>" on success.
"""
import horovod.torch as hvd
import numpy as np
import torch

import deepreduce.torch as drt
from deepreduce import NonFiniteGradientError
from deepreduce.collective.comm.horovod import HorovodCommunicator
from deepreduce.collective.routes.dense import summed_dense

STEPS = 4
CONFIGS = {
    "topk_raw": {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "raw"}, "value": {"id": "raw"},
                 "memory": {"id": "residual"}},
    "bf_p0": {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "bloom", "policy": "p0", "fpr": 0.001},
              "value": {"id": "raw"}, "memory": {"id": "residual"}},
}


class RecordingCommunicator(HorovodCommunicator):
    """Horovod allgather that keeps a copy of every container this rank sends, by collective name
    (not the record the ranks compare before the first step, deepreduce.collective.agreement)."""

    def _validate(self):
        super()._validate()
        self.sent = []

    def allgather_async(self, payload, name):
        if name != "deepreduce.collective.agreement":
            self.sent.append((name, bytes(payload)))
        return super().allgather_async(payload, name)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(16 * 6 * 6, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))


def batch(rank, step):
    rng = np.random.default_rng([rank, step])
    return torch.from_numpy(rng.standard_normal((8, 3, 8, 8)).astype(np.float32)), torch.from_numpy(rng.integers(0, 5, 8))


def train_step(model, opt, step):
    opt.zero_grad()
    x, y = batch(hvd.rank(), step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def flat_params(model):
    return torch.cat([p.detach().ravel() for p in model.parameters()])


def assert_ranks_agree(model, tag):
    gathered = hvd.allgather(flat_params(model).unsqueeze(0), name=f"agree.{tag}")
    assert torch.equal(gathered[0], gathered[-1]), f"{tag}: ranks diverged"


def check_background_matches_synchronous(label, config):
    runs = {}
    for background, path in ((True, "auto"), (False, "auto"), ("device", "device")):
        model = make_model()
        comm = RecordingCommunicator()
        opt = drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=config,
                                       communicator=comm, background=bool(background), path=path)
        runs[background] = (model, opt, comm)
    for step in range(STEPS):
        for run in runs.values():                 # one full step each, so collective names never overlap
            train_step(run[0], run[1], step)
        for other in (False, "device"):
            assert torch.equal(flat_params(runs[True][0]), flat_params(runs[other][0])), \
                f"{label}: step {step} differs ({other})"
    (model, opt, comm), (_, sync_opt, sync_comm) = runs[True], runs[False]
    # tensors below min_numel (1000) skip the container: Horovod's fused all-reduce sums them
    containers = [p for p in model.parameters() if not summed_dense(opt._reduction.pipeline.core, p.numel())]
    assert 0 < len(containers) < len(list(model.parameters()))
    assert len(comm.sent) == STEPS * len(containers)
    assert sorted(comm.sent) == sorted(sync_comm.sent), f"{label}: containers differ"
    assert sorted(comm.sent) == sorted(runs["device"][2].sent), f"{label}: device-path containers differ"
    assert_ranks_agree(model, label)
    stats, sync_stats = opt.compression_stats(), sync_opt.compression_stats()
    assert stats["background"] and not sync_stats["background"]
    assert stats["wire_bytes"] == sync_stats["wire_bytes"] > 0
    assert 0.0 <= stats["encode_hidden_seconds"] and sync_stats["encode_hidden_seconds"] == 0.0
    assert stats["encode_wait_seconds"] >= 0.0 and stats["decode_seconds"] > 0.0 and stats["steps"] == STEPS


def check_worker_error_surfaces_in_step():
    model = make_model()
    config = dict(CONFIGS["topk_raw"], nonfinite="raise")
    opt = drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=config)
    poison = {"on": False}
    model[3].weight.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"] else g)
    train_step(model, opt, 0)
    poison["on"] = True
    try:
        train_step(model, opt, 1)
    except NonFiniteGradientError as exc:
        assert "'3.weight'" in str(exc) and "NaN" in str(exc), str(exc)
    else:
        raise SystemExit("the worker's NonFiniteGradientError did not surface in step()")
    poison["on"] = False
    before = flat_params(model)
    for step in (2, 3):
        train_step(model, opt, step)
    assert not torch.equal(before, flat_params(model)) and torch.isfinite(flat_params(model)).all()
    assert opt.compression_stats()["steps"] == 3
    assert_ranks_agree(model, "after_error")


def main():
    hvd.init()
    torch.set_num_threads(1)
    for label, config in CONFIGS.items():
        check_background_matches_synchronous(label, config)
    check_worker_error_surfaces_in_step()
    print(f"OK {hvd.rank()}", flush=True)


if __name__ == "__main__":
    main()
