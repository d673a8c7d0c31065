"""Worker: DistributedOptimizer with ``bucket_cap_mb`` (gradients compressed per bucket).

1. Lossless config: a bucketed optimizer trains exactly the parameters of a per-parameter one
   (the same sums, grouped differently), for caps giving one bucket and two buckets.
2. Top-r with residual memory: every container a rank sends for a bucket is byte for byte what a
   separate pipeline makes of the bucket's gradients concatenated in backward order (the plan,
   the copy-in and the bucket's name), one container per bucket and step; a large gradient that
   shares no bucket is sent on its own under its name; the background worker
   and the synchronous path send the same bytes and train the same parameters; ranks agree.
3. A bucketed parameter without a gradient (unused) and gradient accumulation over
   backward_passes_per_step passes give the per-parameter result; a checkpoint resumes the
   bucket's residual (the same bytes as the uninterrupted run).
4. Ranks whose caps give different buckets fail together with the agreement's CommunicationError.
Prints "OK <rank>" on success.
"""
import io

import horovod.torch as hvd
import numpy as np
import torch
from torch_background_encode import RecordingCommunicator  # this folder is the script's: on sys.path

import deepreduce.torch as drt
from deepreduce import CommunicationError, build

STEPS = 3
LOSSLESS = {"sparsifier": {"id": "none"}, "index": {"id": "raw"}, "value": {"id": "raw"}, "memory": {"id": "none"}}
TOPK = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "raw"}, "value": {"id": "raw"},
        "memory": {"id": "residual"}}
# MiB: every large gradient (23,040 and 4 x 1,200 floats) in one bucket, or the four 1,200-float
# ones in two buckets of two (2,621 floats at most) and the 23,040-float one on its own
ONE_BUCKET, TWO_BUCKETS = 1.0, 0.01


def make_model():
    torch.manual_seed(0)   # 432 + 16, the biases and 200 + 5 parameters stay below min_numel (1000): summed dense
    layers = [torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * 6 * 6, 40)]
    for width_in, width_out in ((40, 30), (30, 40), (40, 30), (30, 40)):
        layers += [torch.nn.ReLU(), torch.nn.Linear(width_in, width_out)]
    return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(40, 5))


def backward(model, step):
    rng = np.random.default_rng([hvd.rank(), step])
    x = torch.from_numpy(rng.standard_normal((8, 3, 8, 8)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 5, 8))
    torch.nn.functional.cross_entropy(model(x), y).backward()


def flat_params(model):
    return torch.cat([p.detach().ravel() for p in model.parameters()])


def optimizer(model, config, cap, background=True):
    comm = RecordingCommunicator()
    opt = drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=config,
                                   communicator=comm, background=background, bucket_cap_mb=cap)
    return opt, comm


def train_step(model, opt, step):
    opt.zero_grad()
    backward(model, step)
    opt.step()


def check_lossless_buckets_train_like_per_parameter():
    runs = [(make_model(),) for _ in range(3)]
    runs = [(m, optimizer(m, LOSSLESS, cap)[0]) for (m,), cap in zip(runs, (None, ONE_BUCKET, TWO_BUCKETS))]
    for step in range(STEPS):
        for model, opt in runs:
            train_step(model, opt, step)
        for model, _ in runs[1:]:
            assert torch.equal(flat_params(runs[0][0]), flat_params(model)), f"lossless step {step} differs"
    assert [opt.compression_stats()["buckets"] for _, opt in runs] == [0, 1, 2]


def check_topk_buckets_send_the_concatenated_gradient(cap, expected_buckets):
    model, sync_model = make_model(), make_model()
    opt, comm = optimizer(model, TOPK, cap)
    sync_opt, sync_comm = optimizer(sync_model, TOPK, cap, background=False)
    reference = build(TOPK)
    params = list(model.parameters())
    alone = set()
    for step in range(STEPS):
        for m, o in ((model, opt), (sync_model, sync_opt)):   # one full step each: collective names never overlap
            o.zero_grad()
            backward(m, step)
            if m is model:
                grads = {p: p.grad.detach().clone() for p in params}
            o.step()
        assert torch.equal(flat_params(model), flat_params(sync_model)), f"step {step}: background differs"
        buckets = opt._reduction._buckets
        assert len(buckets) == expected_buckets
        sent = dict(comm.sent)   # by name: this step's containers replaced the earlier steps'
        for bucket in buckets:
            flat = torch.cat([grads[p].reshape(-1) for p in bucket.params]).numpy()
            expected = reference.encode(flat, name=bucket.name, step=step).tobytes()
            assert sent[f"deepreduce.{bucket.name}"] == expected, f"step {step}: {bucket.name} differs"
        in_buckets = {p for b in buckets for p in b.params}
        for name, p in model.named_parameters():       # a large gradient that shares no bucket: on its own
            if p.numel() >= 1000 and p not in in_buckets:
                expected = reference.encode(grads[p].numpy(), name=name, step=step).tobytes()
                assert sent[f"deepreduce.{name}"] == expected, f"step {step}: {name} differs"
                alone.add(name)
    assert alone == (set() if expected_buckets == 1 else {"3.weight"})
    in_buckets = {p for b in opt._reduction._buckets for p in b.params}
    order = [p for p in reversed(params) if p in in_buckets]
    assert [p for b in opt._reduction._buckets for p in b.params] == order, "buckets not in backward order"
    assert sorted(comm.sent) == sorted(sync_comm.sent)
    gathered = hvd.allgather(flat_params(model).unsqueeze(0), name=f"agree.topk.{cap}")
    assert torch.equal(gathered[0], gathered[-1]), "ranks diverged"


class WithUnused(torch.nn.Module):
    """make_model() beside a large layer no step uses (its gradient stays None)."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.unused = torch.nn.Linear(40, 40)

    def forward(self, x):
        return self.body(x)


def check_unused_parameters_and_accumulation():
    # A bucket whose parameter got no gradient is completed by step() with zeros, and gradients
    # of backward_passes_per_step passes are summed before the copy: bucketed = per-parameter.
    runs = []
    for cap in (None, ONE_BUCKET):
        model = WithUnused()
        opt = drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=LOSSLESS,
                                       backward_passes_per_step=2, bucket_cap_mb=cap)
        for step in range(2):
            opt.zero_grad()
            backward(model, 2 * step)
            backward(model, 2 * step + 1)
            opt.step()
        runs.append((model, opt))
    assert runs[1][1].compression_stats()["buckets"] == 1
    assert any(runs[1][0].unused.weight in b.params for b in runs[1][1]._reduction._buckets)
    assert torch.equal(flat_params(runs[0][0]), flat_params(runs[1][0])), "unused / accumulation differ"


def check_checkpoint_resumes_the_bucket_residual():
    # The residual is kept under the bucket's name: a resumed run sends the uninterrupted run's
    # bytes, and one resumed without the deepreduce state does not (the state made them equal).
    model = make_model()
    opt, comm = optimizer(model, TOPK, ONE_BUCKET)
    for i in range(2):
        train_step(model, opt, i)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    mark = len(comm.sent)
    train_step(model, opt, 2)
    original = sorted(comm.sent[mark:])
    resumed = {}
    for keep in (True, False):
        buffer.seek(0)
        checkpoint = torch.load(buffer, weights_only=True)
        other = make_model()
        other.load_state_dict(checkpoint["model"])
        other_opt, other_comm = optimizer(other, TOPK, ONE_BUCKET)
        state = dict(checkpoint["optimizer"])
        if not keep:
            state.pop("deepreduce")
        other_opt.load_state_dict(state)
        train_step(other, other_opt, 2)
        resumed[keep] = sorted(other_comm.sent)
    assert len(original) == 1 and resumed[True] == original and resumed[False] != original


def check_different_caps_fail_together():
    model = make_model()
    opt, _ = optimizer(model, TOPK, ONE_BUCKET if hvd.rank() == 0 else TWO_BUCKETS)
    try:
        backward(model, 0)
        opt.step()
    except CommunicationError as exc:
        assert "bucket" in str(exc), str(exc)
    else:
        raise SystemExit("ranks with different bucket plans did not fail")


def main():
    hvd.init()
    torch.set_num_threads(1)
    check_lossless_buckets_train_like_per_parameter()
    for cap, expected in ((ONE_BUCKET, 1), (TWO_BUCKETS, 2)):
        check_topk_buckets_send_the_concatenated_gradient(cap, expected)
    check_unused_parameters_and_accumulation()
    check_checkpoint_resumes_the_bucket_residual()
    check_different_caps_fail_together()
    print(f"OK {hvd.rank()}", flush=True)


if __name__ == "__main__":
    main()
