"""Worker: the sparse all-reduce on real ranks (``mpi`` or ``horovod`` communicator, argv[1]).

Every scenario checks its result on every rank and prints ``OK <scenario> <rank>``:

* ``exact``: without re-selection and with raw codecs it equals the allgather's decode-sum bit
  for bit (twin pipelines see the same gradients, so they select the same entries);
* ``conserve``: with re-selection and boundary moves every 2 steps, what was delivered plus
  every rank's residual and owner residual equals the sum of all gradients;
* ``uneven``: every selected entry lies in shard 0 (the other owners receive nothing);
* ``volume``: the entries a rank receives from other ranks stay under 3k;
* ``resume``: a run restored from a checkpoint delivers what the uninterrupted run delivers.
"""
import sys

import numpy as np

import deepreduce
from deepreduce.collective import shards
from deepreduce.collective.sparse_allreduce import SparseAllreduce

D = 20_000
TOPK = {"sparsifier": {"id": "topk", "ratio": 0.01}, "index": "raw", "value": "raw",
        "memory": "residual", "min_numel": 0}


def communicator(kind):
    if kind == "mpi":
        from deepreduce.collective.comm.mpi import MPICommunicator

        return MPICommunicator()
    import horovod.torch as hvd

    from deepreduce.collective.comm.horovod import HorovodCommunicator

    hvd.init()
    return HorovodCommunicator()


def gradient(rank, step, span=D):
    g = np.zeros(D, np.float32)
    g[:span] = np.random.default_rng(1000 * step + rank).laplace(size=span).astype(np.float32)
    return g


def gather_sum(comm, pipe, x):
    """The sum over the ranks of the float32 vector ``x`` (dense containers through the communicator)."""
    parts = comm.allgather(shards.encode_dense(pipe, x), "check")
    return np.sum([pipe.decode(p) for p in parts], axis=0, dtype=np.float64)


def exact(comm):
    config = dict(TOPK, memory="none")
    sra_pipe, ag_pipe = deepreduce.build(config), deepreduce.build(config)
    sra = SparseAllreduce(sra_pipe, comm, reselect="none", repartition_every=1)
    for step in range(4):
        g = gradient(comm.rank, step)
        got = sra.reduce(g, "w", step)
        want = ag_pipe.decode_sum(comm.allgather(ag_pipe.encode(g, name="w", step=step), "ag"), expected_shape=(D,))
        assert np.array_equal(got, want), (step, np.abs(got - want).max())


def conserve(comm, span=D, name="w"):
    pipe = deepreduce.build(TOPK)
    sra = SparseAllreduce(pipe, comm, repartition_every=2)
    sent = np.zeros(D, np.float64)
    grads = np.zeros(D, np.float64)
    for step in range(7):
        g = gradient(comm.rank, step, span)
        grads += gather_sum(comm, pipe, g)
        sent += sra.reduce(g, name, step)
    held = pipe.memory.residual(name) + sra.owner_residual(name)
    total = sent + gather_sum(comm, pipe, held.astype(np.float32))
    assert np.allclose(total, grads, rtol=1e-5, atol=1e-4), np.abs(total - grads).max()
    return sra


def uneven(comm):
    sra = conserve(comm, span=D // 8, name="u")
    bounds = sra.state_dict()["bounds"]["u"]
    assert bounds[-1] == D and bounds[1] <= D // 8, bounds   # rebalanced into the first eighth


def volume(comm):
    pipe = deepreduce.build(TOPK)
    sra = SparseAllreduce(pipe, comm)
    k = D // 100
    seen = []

    def counting(method):
        def call(payload, name):
            parts = method(payload, name)
            seen.append(sum(deepreduce.inspect(p)["n"] for j, p in enumerate(parts) if j != comm.rank))
            return parts
        return call

    comm.alltoall, comm.allgather = counting(comm.alltoall), counting(comm.allgather)
    for step in range(3):
        sra.reduce(gradient(comm.rank, step), "w", step)
    per_step = [a + b for a, b in zip(seen[0::2], seen[1::2])]
    assert max(per_step) <= 3 * k, (per_step, k)
    print(f"VOLUME {comm.rank} ranks={comm.size} k={k} entries_from_others={per_step}", flush=True)
    del comm.alltoall, comm.allgather


def resume(comm):
    def run(steps, state=None):
        pipe = deepreduce.build(TOPK)
        sra = SparseAllreduce(pipe, comm, repartition_every=2)
        if state is not None:
            pipe.load_state_dict(state[0])
            sra.load_state_dict(state[1])
        outs = [sra.reduce(gradient(comm.rank, s), "w", s) for s in steps]
        return outs, (pipe.state_dict(), sra.state_dict())

    straight, _ = run(range(6))
    _, state = run(range(3))
    resumed, _ = run(range(3, 6), state)
    for a, b in zip(straight[3:], resumed):
        assert np.array_equal(a, b)


if __name__ == "__main__":
    comm = communicator(sys.argv[1])
    for scenario in (exact, conserve, uneven, volume, resume):
        scenario(comm)
        print(f"OK {scenario.__name__} {comm.rank}", flush=True)
