"""The sparse all-reduce's batches (deepreduce.collective.sparse_allreduce: ``send``, ``exchange``,
``complete``; the step engine's route): the shard exchanges of a step's tensors share one
collective per phase, with the same sums as one reduce per tensor; the length-tabled payloads;
a rank's encode failure inside a batch. Ranks are threads here (conftest.ThreadRanks); the
Horovod optimizer and the DDP hook run batches on real ranks in test_multirank.py,
test_sparse_allreduce.py and test_torch_ddp.py."""
import numpy as np
import pytest
from conftest import ThreadRanks, run_threads

import deepreduce
from deepreduce.collective.ports import NumpyTensors
from deepreduce.collective.sparse_allreduce import SparseAllreduce, cut, fuse
from deepreduce.collective.step import Item, StepEngine
from deepreduce.errors import CommunicationError

CONFIG = {"sparsifier": {"id": "topk", "ratio": 0.3}, "index": "raw", "value": "raw", "memory": "residual",
          "min_numel": 0}
AGGREGATION = {"id": "sparse_allreduce", "repartition_every": 2}
# unequal sizes; "c" has fewer elements than there are ranks, so some of its shards are empty
SIZES = {"a": 20_000, "b": 7, "c": 1, "d": 3001}
RANKS = 3


def test_fuse_and_cut_round_trip_with_empty_containers():
    parts = [np.arange(10, dtype=np.uint8), np.zeros(0, np.uint8), np.full(3, 7, np.uint8)]
    fused = fuse(parts)
    assert fused.shape[0] == 3 + 13   # a one-byte varint length per container
    long = [np.zeros(300, np.uint8), np.zeros(20_000, np.uint8)]
    assert fuse(long).shape[0] == 2 + 3 + 20_300 and [c.shape[0] for c in cut(fuse(long), 2, 'here')] == [300, 20_000]
    for got, sent in zip(cut(fused, 3, "here"), parts):
        np.testing.assert_array_equal(got, sent)
    one = np.arange(5, dtype=np.uint8)
    assert fuse([one]) is one and cut(one, 1, "here")[0] is one   # a batch of one: the container itself


@pytest.mark.parametrize("damage", ["short", "long", "table", "unended"])
def test_cut_refuses_a_payload_its_table_does_not_describe(damage):
    fused = fuse([np.arange(10, dtype=np.uint8), np.arange(4, dtype=np.uint8)])
    bad = {"short": fused[:-1], "long": np.concatenate([fused, fused[:1]]), "table": fused[:1],
           "unended": np.full(30, 0x80, np.uint8)}[damage]
    with pytest.raises(CommunicationError, match="sparse_allreduce of 'w' from rank 2"):
        cut(bad, 2, "sparse_allreduce of 'w' from rank 2")


def gradients(steps):
    rng = np.random.default_rng(11)
    return [[{n: rng.standard_normal(m).astype(np.float32) for n, m in SIZES.items()} for _ in range(RANKS)]
            for _ in range(steps)]


def reference(grads, steps):
    """Every rank's averaged sums of ``grads[i]`` as step ``steps[i]``, one blocking reduce per
    tensor (no batches)."""
    ranks = ThreadRanks(RANKS)
    pipes = [deepreduce.build(CONFIG) for _ in range(RANKS)]
    out = [None] * RANKS

    def run(rank):
        sra = SparseAllreduce(pipes[rank], ranks.rank_view(rank), repartition_every=AGGREGATION["repartition_every"])
        out[rank] = [{n: sra.reduce(grads[i][rank][n], n, step) / np.float32(RANKS) for n in SIZES}
                     for i, step in enumerate(steps)]
    run_threads(run, [(r,) for r in range(RANKS)], 120)
    return out


def engine_steps(grads, background, fail=None, nonfinite="propagate", early_numel=2**62, sends=None):
    """Every rank's results per step through the step engine: the averaged sums, or the error
    the step raised (``fail``: (rank, step, name) whose encode raises). Each rank submits its
    tensors in its own order (in one order where some go early: their exchanges start at submit,
    in submission order, as the allgather route's collectives do); ``calls``: rank 0's collectives;
    ``sends``: a list that gets rank 0's phase-one batches, (tensor names, sent while finishing)."""
    ranks = ThreadRanks(RANKS)
    aggregation = dict(AGGREGATION, early_numel=early_numel)
    pipes = [deepreduce.build(dict(CONFIG, aggregation=aggregation, nonfinite=nonfinite)) for _ in range(RANKS)]
    out = [[] for _ in range(RANKS)]

    def run(rank):
        pipes[rank].collective_steps()   # as the bindings do: a step journals its residual changes
        engine = StepEngine(pipes[rank], ranks.rank_view(rank), NumpyTensors(), None, background=background)
        reducer = engine.protocol.sparse
        encode = reducer.encode

        def flaky(grad, name, step):
            if (rank, step, name) == fail:
                raise RuntimeError(f"injected encode failure of {name}")
            return encode(grad, name, step)
        reducer.encode = flaky
        finishing = [False]
        if sends is not None and rank == 0:
            send = reducer.send
            reducer.send = lambda phases: (sends.append((tuple(p.name for p in phases), finishing[0])), send(phases))[1]
        order = list(SIZES)[::-1] if rank % 2 and early_numel > max(SIZES.values()) else list(SIZES)
        for step, per_rank in enumerate(grads):
            tensors = {n: per_rank[rank][n].copy() for n in order}
            finishing[0] = False
            for name in order:
                engine.submit(Item(name, step, tensors[name]))
            try:
                finishing[0] = True
                engine.finish(step, list(SIZES))
                out[rank].append(tensors)
            except Exception as exc:   # noqa: BLE001 (which one is the point)
                out[rank].append(exc)
        engine.close()
    run_threads(run, [(r,) for r in range(RANKS)], 120)
    return out, ranks.calls


@pytest.mark.parametrize("background", [True, False])
def test_a_step_shares_one_collective_per_phase_and_equals_one_reduce_per_tensor(background):
    grads = gradients(4)
    got, calls = engine_steps(grads, background)
    want = reference(grads, range(4))
    for rank in range(RANKS):
        for step in range(4):
            for name in SIZES:
                np.testing.assert_array_equal(got[rank][step][name], want[rank][step][name], err_msg=f"{rank} {step} {name}")
    # two collectives a step, whatever the number of tensors; named after the first tensor by name
    assert calls == ["deepreduce.sra1.a", "deepreduce.sra2.a"] * 4


def test_one_ranks_encode_failure_inside_a_batch_fails_the_step_on_every_rank():
    """Rank 1 cannot encode "b" at step 1: it raises its own error, every other rank a
    CommunicationError naming it; under ``nonfinite: raise`` (which journals the step) the step is
    undone everywhere (residuals, owner residuals, bounds), so step 2 gives what a run without
    step 1 gives, in phase on every rank."""
    grads = gradients(3)
    got, calls = engine_steps(grads, True, fail=(1, 1, "b"), nonfinite="raise")
    assert isinstance(got[1][1], RuntimeError) and "injected encode failure of b" in str(got[1][1])
    for rank in (0, 2):
        assert isinstance(got[rank][1], CommunicationError), repr(got[rank][1])
        assert "rank 1 could not encode" in str(got[rank][1]) and "'b'" in str(got[rank][1])
    assert calls == ["deepreduce.sra1.a", "deepreduce.sra2.a"] * 3   # the failed step's batch went as usual
    skipped = [grads[0], grads[2]]
    want = reference(skipped, [0, 2])
    for rank in range(RANKS):
        for name in SIZES:
            np.testing.assert_array_equal(got[rank][0][name], want[rank][0][name])
            np.testing.assert_array_equal(got[rank][2][name], want[rank][1][name], err_msg=f"{rank} {name}")


def test_large_tensors_start_their_exchange_at_submit_and_the_rest_share_a_batch():
    """``early_numel``: "a" (20,000) and "d" (3,001) send phase one as each is encoded (before the
    step's finish), "b" and "c" share one batch after backward; the sums are one reduce per
    tensor's, bit for bit."""
    grads, sends = gradients(3), []
    got, calls = engine_steps(grads, False, early_numel=3000, sends=sends)
    want = reference(grads, range(3))
    for rank in range(RANKS):
        for step in range(3):
            for name in SIZES:
                np.testing.assert_array_equal(got[rank][step][name], want[rank][step][name], err_msg=f"{rank} {step} {name}")
    # phase one of "a" and "d" is sent at submit, "b" and "c" go in one batch while finishing
    assert sends == [(("a",), False), (("d",), False), (("b", "c"), True)] * 3
    # a blocking communicator makes each collective when it is waited for: the early items' phase
    # one at their owner steps (in name order), the batch's, then each phase two as finish reads it
    assert calls == ["deepreduce.sra1.a", "deepreduce.sra1.d", "deepreduce.sra1.b",
                     "deepreduce.sra2.a", "deepreduce.sra2.b", "deepreduce.sra2.d"] * 3


@pytest.mark.parametrize("name", ["a", "b"])
def test_an_encode_failure_early_or_batched_fails_the_step_on_every_rank(name):
    """Rank 1 cannot encode ``name`` at step 1 ("a" goes early, "b" in the batch): every rank raises
    and undoes the step; step 2 equals a run without step 1."""
    grads = gradients(3)
    got, calls = engine_steps(grads, True, fail=(1, 1, name), nonfinite="raise", early_numel=3000)
    assert isinstance(got[1][1], RuntimeError) and f"injected encode failure of {name}" in str(got[1][1])
    for rank in (0, 2):
        assert isinstance(got[rank][1], CommunicationError) and f"'{name}'" in str(got[rank][1]), repr(got[rank][1])
    assert len(calls) == 6 * 3
    want = reference([grads[0], grads[2]], [0, 2])
    for rank in range(RANKS):
        for n in SIZES:
            np.testing.assert_array_equal(got[rank][0][n], want[rank][0][n])
            np.testing.assert_array_equal(got[rank][2][n], want[rank][1][n], err_msg=f"{rank} {n}")
