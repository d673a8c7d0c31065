"""Worker: the Horovod optimizer with ``aggregation: sparse_allreduce``.

* ``exact``: without re-selection (``reselect: none``) and with raw codecs, training equals the
  allgather run parameter for parameter (per tensor and in 1 MiB buckets);
* ``fused``: a step's tensors share one alltoall per phase (a one-element tensor: an empty shard);
* ``trains``: Top-r 10% with re-selection lowers the loss like the allgather run does;
* ``resume``: a checkpoint (optimizer state dict, owner residuals included) resumes byte-identically;
* ``disagree``: ranks that disagree on the aggregation fail together with a clear error;
* ``auto``: the planner's choices follow the link (fast: dense; slow: compressed), agree across ranks.
"""
import io

import horovod.torch as hvd
import torch

import deepreduce.torch as drt
from deepreduce.errors import CommunicationError

hvd.init()
torch.manual_seed(0)
TOPK = {"sparsifier": {"id": "topk", "ratio": 0.1}, "index": "raw", "value": "raw", "memory": "residual",
        "min_numel": 100}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def batches(steps):
    g = torch.Generator().manual_seed(100 + hvd.rank())
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(steps)]


def train(config, steps=6, bucket_cap_mb=None, net=None, state=None, data=None):
    net = net or model()
    opt = drt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                   compression=config, bucket_cap_mb=bucket_cap_mb)
    if state is not None:
        opt.load_state_dict(state)
    losses = []
    for x, y in data if data is not None else batches(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return net, opt, losses


def with_aggregation(config, **aggregation):
    return dict(config, aggregation=dict({"id": "sparse_allreduce"}, **aggregation))


def exact():
    lossless = dict(TOPK, sparsifier={"id": "topk", "ratio": 1.0}, memory={"id": "none"})
    for cap in (None, 1):
        a, _, _ = train(lossless, bucket_cap_mb=cap)
        b, opt, _ = train(with_aggregation(lossless, reselect="none"), bucket_cap_mb=cap)
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), (cap, name, (p - q).abs().max())
        assert opt.compression_stats()["aggregation"] == "sparse_allreduce"


def fused():
    """A step's tensors (unequal sizes; a one-element bias, so one rank's shard of it is empty)
    share one Horovod alltoall per phase, and equal the allgather run without re-selection."""
    lossless = dict(TOPK, sparsifier={"id": "topk", "ratio": 1.0}, memory={"id": "none"}, min_numel=0)

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    data = [(x, y.float()[:, None]) for x, y in batches(3)]

    def run(config, calls=None):
        model = net()
        opt = drt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=config)
        if calls is not None:
            comm = opt._reduction.engine.communicator
            for kind in ("alltoall_async", "allgather_async"):
                real = getattr(comm, kind)
                setattr(comm, kind, lambda *args, real=real, kind=kind, **kw: (calls.append((kind, args[1])), real(*args, **kw))[1])
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return model
    calls = []
    a = run(lossless)
    b = run(with_aggregation(lossless, reselect="none"), calls)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q), (p - q).abs().max()
    sparse = [c for c in calls if c[1].startswith("deepreduce.sra")]
    assert sparse == [("alltoall_async", "deepreduce.sra1.0.bias"), ("alltoall_async", "deepreduce.sra2.0.bias")] * 3, calls


def trains():
    data = batches(2) * 20   # a small set seen again and again: the loss must fall
    _, _, gathered = train(TOPK, data=data)
    _, _, sparse = train(with_aggregation(TOPK), data=data)
    first, last = sum(sparse[:2]) / 2, sum(sparse[-2:]) / 2   # both batches: the data alternates
    assert last < first * 0.9, sparse
    assert abs(last - sum(gathered[-2:]) / 2) < 0.2 * first, (sparse[-2:], gathered[-2:])


def resume():
    config = with_aggregation(TOPK, repartition_every=2)
    data = batches(8)
    straight, _, _ = train(config, data=data)
    net, opt, _ = train(config, data=data[:4])
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert "aggregation" in saved["opt"]["deepreduce"]
    net2 = model()
    net2.load_state_dict(saved["model"])
    resumed, _, _ = train(config, net=net2, state=saved["opt"], data=data[4:])
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def disagree():
    config = TOPK if hvd.rank() == 0 else with_aggregation(TOPK)
    try:
        train(config, steps=1)
    except CommunicationError as exc:
        assert "aggregated by sparse_allreduce" in str(exc), str(exc)
    else:
        raise AssertionError("ranks with different aggregations trained together")


def auto():
    """``aggregation: auto``: a very fast link plans every tensor dense, a very slow one compressed
    (both stated, with ``host_costs`` off: the link decides); a probed link (with the probed host
    costs) plans too; every rank holds the same plan; training goes on under each. The fast
    link has no latency: with one, an allgather (N-1 messages) of a small tensor can rightly beat
    the ring's 2(N-1)."""
    plans = {}
    for label, gbit, latency in (("fast", 1e5, 0.0), ("slow", 1e-3, 25.0), ("probed", 0.0, 25.0)):
        net, opt, losses = train(with_aggregation(TOPK, bandwidth_gbit=gbit, latency_us=latency, id="auto",
                                                  host_costs=label == "probed"),
                                 data=batches(2) * 3)
        stats = opt.compression_stats()
        assert stats["plans_made"] == 1 and stats["plan"], stats
        plans[label] = stats["plan"]
        assert losses[-2] < losses[0] and losses[-1] < losses[1], losses   # each of the two batches
        everyone = hvd.allgather_object(sorted(stats["plan"].items()))
        assert all(p == everyone[0] for p in everyone), everyone
    assert set(plans["fast"].values()) == {"dense"}, plans["fast"]
    assert set(plans["slow"].values()) <= {"allgather", "sparse_allreduce"}, plans["slow"]


for scenario in (exact, fused, trains, resume, disagree, auto):
    scenario()
    print(f"OK {scenario.__name__} {hvd.rank()}", flush=True)
