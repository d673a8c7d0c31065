"""The sparse all-reduce (deepreduce.collective.sparse_allreduce): shard boundaries, bad settings, and
real runs on 2, 4 and 8 ranks (mpirun, mpi4py communicator; 8 marked slow) and 2 and 4 ranks
(horovodrun, Horovod's alltoall): exact equality with the allgather without re-selection, conservation of both
residuals with it, an uneven split, receive volume under 3k entries, and checkpoint resume
(tests/workers/sparse_allreduce.py)."""
import threading

import numpy as np
import pytest
from conftest import OneRank, ThreadRanks, run_ranks, run_threads

import deepreduce
from deepreduce.backend import native_pipeline
from deepreduce.collective import shards
from deepreduce.collective.sparse_allreduce import SparseAllreduce, balanced_bounds, even_bounds
from deepreduce.errors import ConfigError

SCENARIOS = ("exact", "conserve", "uneven", "volume", "resume")


def test_even_and_balanced_bounds():
    assert even_bounds(10, 3).tolist() == [0, 3, 6, 10]
    assert even_bounds(0, 2).tolist() == [0, 0, 0]
    assert balanced_bounds(np.array([1, 2, 3, 50, 60, 70, 80, 99]), 100, 4).tolist() == [0, 3, 60, 80, 100]
    assert balanced_bounds(np.array([5]), 100, 4).tolist() == even_bounds(100, 4).tolist()
    # all positions in one place: empty shards, never decreasing
    assert balanced_bounds(np.arange(8), 100, 4).tolist() == [0, 2, 4, 6, 100]


def test_settings_are_checked():
    pipe = deepreduce.build("topk_raw")
    with pytest.raises(ConfigError, match="reselect"):
        SparseAllreduce(pipe, OneRank(), reselect="random")
    with pytest.raises(ConfigError, match="repartition_every"):
        SparseAllreduce(pipe, OneRank(), repartition_every=0)
    with pytest.raises(ConfigError, match="needs a 'ratio'"):
        SparseAllreduce(deepreduce.build("none_raw"), OneRank())
    with pytest.raises(ConfigError, match="owner_residuals"):
        SparseAllreduce(pipe, OneRank()).load_state_dict({"bounds": {}})


def test_one_rank_delivers_the_selection_and_keeps_the_rest():
    pipe = deepreduce.build("topk_raw")
    g = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    out = SparseAllreduce(pipe, OneRank()).reduce(g, "w", 0)
    assert np.count_nonzero(out) == 100
    np.testing.assert_allclose(out + pipe.memory.residual("w"), g, rtol=0, atol=1e-6)


@pytest.mark.parametrize("config", ["topk_raw", "semisync_1bit"])
def test_the_owner_reselects_on_the_pipelines_threads(config, kernel_threads):
    """The owner's re-selection (Top-r, or k per chunk) runs on the pipeline's ``threads`` (it ran on
    one thread whatever the option said), and the result does not depend on it."""
    g = np.random.default_rng(1).standard_normal(1024 * 40).astype(np.float32)
    base = dict(deepreduce.build(config).get_config(), min_numel=0)
    one = SparseAllreduce(deepreduce.build(dict(base, threads=1)), OneRank()).reduce(g, "w", 0)
    seen = kernel_threads("topk", "chunk_topk")
    three = SparseAllreduce(deepreduce.build(dict(base, threads=3)), OneRank()).reduce(g, "w", 0)
    assert seen and all(threads == 3 for _, threads in seen)
    np.testing.assert_array_equal(three, one)


def test_warmup_steps_reduce_dense_on_both_phases():
    pipe = deepreduce.build(dict(deepreduce.load_config("topk_raw"), warmup=1))
    reducer = SparseAllreduce(pipe, OneRank())
    g = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    np.testing.assert_array_equal(reducer.reduce(g, "w", 0), g)
    assert not pipe.memory.residual("w").any() and not reducer.state_dict()["owner_residuals"]["w"].any()
    assert np.count_nonzero(reducer.reduce(g, "w", 1)) == 100


@pytest.mark.parametrize("launcher,ranks,kind", [("mpirun", 2, "mpi"), ("mpirun", 4, "mpi"),
                                                 ("horovodrun", 2, "horovod"), ("horovodrun", 4, "horovod"),
                                                 pytest.param("mpirun", 8, "mpi", marks=pytest.mark.slow)])
def test_sparse_allreduce_on_real_ranks(launcher, ranks, kind):
    out = run_ranks(launcher, "sparse_allreduce.py", kind, np_=ranks, timeout=300).stdout
    for scenario in SCENARIOS:
        assert out.count(f"OK {scenario} ") == ranks, (scenario, out[-2000:])


@pytest.mark.parametrize("ranks", [2, 4])
def test_horovod_optimizer_with_sparse_allreduce(ranks):
    """``aggregation: {id: sparse_allreduce}`` in the torch Horovod optimizer: equal to the
    allgather run without re-selection (per tensor and in buckets), trains with it, resumes from
    a checkpoint byte-identically, ranks that disagree on the aggregation fail together, and the
    ``auto`` plan follows the link and is the same on every rank."""
    out = run_ranks("horovodrun", "torch_sparse_allreduce.py", np_=ranks, timeout=600).stdout
    for scenario in ("exact", "fused", "trains", "resume", "disagree", "auto"):
        assert out.count(f"OK {scenario} ") == ranks, (scenario, out[-2000:])


def _reduce_on_threads(config, grads, corrupt=None):
    """Every rank's (outputs per step, final residual, error text) for ``grads[step][rank]``;
    ``corrupt(rank, step, payloads)`` may spoil what a rank sends in the first phase."""
    size = len(grads[0])
    ranks = ThreadRanks(size)
    results = [None] * size
    pipes = [deepreduce.build(config) for _ in range(size)]   # the registry fills on first use: not in threads

    def run(rank):
        pipe = pipes[rank]
        sra = SparseAllreduce(pipe, ranks.rank_view(rank), repartition_every=2)
        outs = []
        try:
            for step, per_rank in enumerate(grads):
                outs.append(sra.reduce(per_rank[rank], "w", step))
        except deepreduce.DeepReduceError as exc:   # every rank raises at the same step: no abort needed
            outs.append(f"{type(exc).__name__}: {exc}")
        except threading.BrokenBarrierError:
            outs.append("aborted")
        results[rank] = (outs, pipe.memory.residual("w"), sra.owner_residual("w"), pipe.stats.tensors_decoded)

    encode = shards.encode_shards
    if corrupt is not None:   # the shard encode of the rank whose pipeline it is, spoiled
        rank_of = {id(pipe): rank for rank, pipe in enumerate(pipes)}
        shards.encode_shards = lambda core, g, name, step, bounds: corrupt(rank_of[id(core)], step,
                                                                           encode(core, g, name, step, bounds))
    try:
        run_threads(run, [(r,) for r in range(size)], 120)
    finally:
        shards.encode_shards = encode
    return results


def _both_paths(config, grads, monkeypatch, corrupt=None):
    native = _reduce_on_threads(config, grads, corrupt)
    with monkeypatch.context() as m:
        m.setattr(native_pipeline, "module", lambda: None)
        python = _reduce_on_threads(config, grads, corrupt)
    return native, python


def _assert_same(native, python):
    for (outs_n, res_n, own_n, dec_n), (outs_p, res_p, own_p, dec_p) in zip(native, python):
        assert len(outs_n) == len(outs_p)
        for a, b in zip(outs_n, outs_p):
            if isinstance(b, str):
                assert a == b
            else:
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(res_n, res_p)
        np.testing.assert_array_equal(own_n, own_p)
        assert dec_n == dec_p


@pytest.mark.parametrize("name", ["elias_fano", "topk_raw", "bf_p0"])
def test_native_decode_of_both_phases_equals_the_python_path(name, monkeypatch):
    assert native_pipeline.module() is not None
    rng = np.random.default_rng(3)
    grads = [[rng.standard_normal(30_000).astype(np.float32) for _ in range(4)] for _ in range(5)]
    grads[3][2][77] = np.nan   # one rank's non-finite gradient: every rank gets the flagged sum
    native, python = _both_paths(name, grads, monkeypatch)
    assert np.isnan(native[0][0][3][77])
    _assert_same(native, python)


def test_an_overflowing_shard_sum_under_nonfinite_raise_is_refused_as_the_python_path(monkeypatch):
    """Finite containers whose sum overflows float32: under ``raise`` the owner refuses it with the
    core's error (the C++ decode, which returns Inf, hands such a sum to the core's decode_sum)."""
    config = dict(deepreduce.load_config("topk_raw"), nonfinite="raise")
    rng = np.random.default_rng(5)
    grads = [[rng.standard_normal(30_000).astype(np.float32) for _ in range(4)] for _ in range(2)]
    for g in grads[1]:
        g[5] = np.float32(3e38)   # in rank 0's shard: 4 x 3e38 is beyond float32
    native, python = _both_paths(config, grads, monkeypatch)
    # the owner that refuses; the others are aborted wherever they were (a thread race)
    _assert_same(native[:1], python[:1])
    assert "NonFiniteGradientError: rank 1: " in native[0][0][1] and "overflow when added" in native[0][0][1]


def test_native_decode_reports_a_corrupt_container_as_the_python_path(monkeypatch):
    def corrupt(rank, step, payloads):
        if rank == 1 and step == 1:
            payloads[2] = payloads[2].copy()
            payloads[2][-1] ^= 1   # the checksum
        return payloads

    rng = np.random.default_rng(4)
    grads = [[rng.standard_normal(20_000).astype(np.float32) for _ in range(3)] for _ in range(2)]
    native, python = _both_paths("elias_fano", grads, monkeypatch, corrupt)
    for results in (native, python):
        assert results[2][0][1].startswith("ContainerError: rank 1: ")
        # the owner's error travels in its shard: every other rank raises too, naming it
        for rank in (0, 1):
            assert results[rank][0][1].startswith("CommunicationError: sparse_allreduce of 'w' at step 1: rank 2 could "
                                                  "not reduce its shard (ContainerError: rank 1: ")
    # the decode count differs by the containers Python decoded before the bad one
    _assert_same([r[:3] + (0,) for r in native], [r[:3] + (0,) for r in python])


@pytest.mark.parametrize("policy", ["propagate", "raise"])
def test_entries_whose_sum_with_the_owner_residual_overflows_are_flagged_or_refused(policy):
    """Finite shard entries and a finite owner residual whose sum is beyond float32: under
    ``propagate`` the owner sends the shard's sum dense and flagged (every rank then sees it),
    under ``raise`` it refuses with a NonFiniteGradientError; the owner residual is left as it was."""
    from deepreduce.collective.sparse_allreduce import OwnerResidual
    from deepreduce.errors import NonFiniteGradientError
    from deepreduce.wire import container

    core = deepreduce.build(dict(deepreduce.load_config("topk_raw"), nonfinite=policy))
    core = getattr(core, "core", core)
    m = 4096
    grads = [np.random.default_rng(r).standard_normal(m).astype(np.float32) for r in range(2)]
    grads[0][5], grads[1][5] = np.float32(2e38), np.float32(-1e38)   # the largest entries: both sent; their sum 1e38
    payloads = [shards.encode_shards(core, g, f"w{r}", 1, [0, m])[0] for r, g in enumerate(grads)]
    owner = OwnerResidual(0, np.zeros(m, np.float32), m)
    owner.values[5] = np.float32(3e38)   # 3e38 + 1e38 is beyond float32
    before = owner.values.copy()
    reducer = SparseAllreduce(core, None)
    if policy == "raise":
        core.collective_steps()
        with pytest.raises(NonFiniteGradientError, match="owner residual overflow float32"):
            reducer._owner_step(payloads, owner, m, "w", 1, m)
    else:
        c = container.unpack(reducer._owner_step(payloads, owner, m, "w", 1, m))
        assert c.nonfinite and c.dense
        assert np.isclose(np.frombuffer(c.value_section, dtype="<f4")[5], 1e38, rtol=1e-6)   # the ranks' sum
    np.testing.assert_array_equal(owner.values, before)


# ------------------------------------------------------------------ chunked sparsifiers
CHUNKED = {"sparsifier": {"id": "chunk_topk", "chunk": 256, "k": 8}, "index": {"id": "chunk_enum", "chunk": 256},
           "value": {"id": "binmean", "bits": 2}, "memory": {"id": "residual"}, "min_numel": 500}


@pytest.mark.parametrize("numel,ranks,chunk", [(4096, 4, 256), (4196, 4, 256), (4196, 3, 256), (600, 4, 256),
                                               (100, 4, 256), (0, 2, 8), (262144, 4, 1024), (12288, 4, 4096)])
def test_chunk_bounds_cover_every_element_once_in_whole_chunks(numel, ranks, chunk):
    from deepreduce.collective.sparse_allreduce import chunk_bounds
    from deepreduce.wire import chunks

    bounds = chunk_bounds(numel, ranks, chunk)
    assert bounds.shape == (ranks + 1,) and bounds[0] == 0 and bounds[-1] == numel
    assert np.all(np.diff(bounds) >= 0)   # every element in exactly one shard
    inner = bounds[bounds < numel]
    assert np.all(inner % chunk == 0)     # shards start at chunk bounds: the tail is in the last non-empty one
    per_shard = -(-np.diff(bounds) // chunk)
    assert per_shard.sum() == chunks.chunk_count(numel, chunk) and per_shard.max() - per_shard.min() <= 1
    assert np.array_equal(bounds, chunk_bounds(numel, ranks, chunk))


def test_chunk_bounds_of_a_tensor_smaller_than_its_ranks_chunks():
    from deepreduce.collective.sparse_allreduce import chunk_bounds

    assert chunk_bounds(600, 4, 256).tolist() == [0, 0, 256, 512, 600]   # 3 chunks, the tail of 88 last
    assert chunk_bounds(100, 4, 256).tolist() == [0, 0, 0, 0, 100]       # one tail chunk, one owner
    assert chunk_bounds(4196, 4, 256).tolist() == [0, 1024, 2048, 3072, 4196]   # 17 chunks: the tail with 4 more


def _chunked_run(size, numel, steps=3, config=CHUNKED, loaded=None):
    """Each rank's (sum per step, residual, owner residual, bounds, shard containers it sent per
    step, owner container per step) for a chunked config on ``size`` thread ranks (``loaded``:
    shard bounds restored from a checkpoint first)."""
    ranks = ThreadRanks(size)
    pipes = [deepreduce.build(config) for _ in range(size)]
    rng = np.random.default_rng(size)
    grads = [[rng.standard_normal(numel).astype(np.float32) for _ in range(size)] for _ in range(steps)]
    results = [None] * size

    def run(rank):
        sra = SparseAllreduce(pipes[rank], ranks.rank_view(rank), repartition_every=1)
        if loaded is not None:
            sra.load_state_dict({"owner_residuals": {}, "bounds": {"w": loaded}})
        sent, owned, outs = [], [], []
        owner_step = sra._owner_step

        def record(*args):
            owned.append(owner_step(*args))
            return owned[-1]
        sra._owner_step = record
        for step in range(steps):
            phase = sra.encode(grads[step][rank], "w", step)
            sent.append(list(phase.sent))
            batch = sra.send([phase])
            sra.exchange(batch)
            outs.append(sra.complete(batch)[0])
        results[rank] = (outs, pipes[rank].memory.residual("w"), sra.owner_residual("w"), sra._bounds["w"].copy(),
                         sent, owned)

    run_threads(run, [(r,) for r in range(size)], 120)
    return grads, results


@pytest.mark.parametrize("size", [2, 4])
def test_chunked_shards_carry_whole_chunks_and_the_owner_keeps_k_per_chunk(size):
    """With chunk_topk the bounds are whole chunks on every rank and stay there (repartition_every
    1), every shard container has the sparsifier's geometry (no per-chunk counts), the owner's
    container is exactly as large as each sender's (k per chunk, not a ratio of the shard), and
    the ranks' gradients are conserved in the sum delivered and both residuals."""
    from deepreduce.collective.sparse_allreduce import chunk_bounds
    from deepreduce.wire import chunks, container

    numel = 4196   # 16 full chunks of 256 and a tail of 100
    grads, results = _chunked_run(size, numel)
    bounds = chunk_bounds(numel, size, 256)
    for outs, _, _, held, sent, owned in results:
        assert np.array_equal(held, bounds)
        np.testing.assert_array_equal(outs[-1], results[0][0][-1])
        for step in range(len(grads)):
            for j in range(size):
                c = container.unpack(sent[step][j])
                length = int(bounds[j + 1] - bounds[j])
                assert c.n == chunks.uniform_total(length, 256, 8)
                assert chunks.read_params("chunk_enum", c.index_params, c.n, length)[1] == 8   # uniform: no counts
    for rank, (outs, _, _, _, sent, owned) in enumerate(results):
        for step in range(len(grads)):
            length = int(bounds[rank + 1] - bounds[rank])
            assert container.unpack(owned[step]).n == chunks.uniform_total(length, 256, 8)
            assert owned[step].shape[0] == sent[step][rank].shape[0]   # phase two no larger than phase one
            assert chunks.counts_of(np.flatnonzero(outs[step][bounds[rank]:bounds[rank + 1]]), length, 256).max() <= 8
    total = sum(g for per_step in grads for g in per_step)
    delivered = sum(results[0][0])
    held = sum(r[1] for r in results) + sum(r[2] for r in results)
    np.testing.assert_allclose(delivered + held, total, rtol=0, atol=1e-4)


def test_chunked_received_bytes_are_whole_shard_containers_from_2_to_4_ranks():
    """Each rank receives 2 (N - 1) containers per tensor, each exactly the size of one whole
    tensor's container of the shard's chunks: on 16 chunks, (N - 1) / N of the message twice,
    plus the containers' own fixed bytes (header, parameters, codebook)."""
    numel = 4096
    received = {}
    for size in (2, 4):
        _, results = _chunked_run(size, numel, steps=2)
        shard = numel // size
        whole = deepreduce.build(CHUNKED).encode(np.random.default_rng(9).standard_normal(shard).astype(np.float32),
                                                 "x", 0)
        per_rank = []
        for rank, (_, _, _, _, sent, owned) in enumerate(results):
            got = sum(results[r][4][-1][rank].shape[0] + results[r][5][-1].shape[0] for r in range(size) if r != rank)
            assert got == 2 * (size - 1) * np.asarray(whole).shape[0]
            per_rank.append(got)
        received[size] = per_rank[0]
    # a container's bytes are linear in its chunks: fixed bytes (header, parameters, codebook) + per chunk
    size = [len(deepreduce.build(CHUNKED).encode(np.ones(n, np.float32), "x", 0)) for n in (1024, 2048)]
    fixed = 2 * size[0] - size[1]
    assert fixed > 0
    assert (received[4] - 6 * fixed) * 2 == (received[2] - 2 * fixed) * 3   # the entries' bytes 1.5x, the fixed 3x


@pytest.mark.parametrize("config", ["topk_raw", CHUNKED])
def test_a_tensor_below_min_numel_is_summed_exactly_in_both_phases(config):
    """Its shards travel dense and the owner sends their sum dense too (as the allgather delivers
    it), keeping no owner residual: no re-selection of a tensor the config sends dense."""
    rng = np.random.default_rng(11)
    grads = [[rng.standard_normal(300).astype(np.float32) for _ in range(4)] for _ in range(3)]
    results = _reduce_on_threads(config, grads)
    for step, per_rank in enumerate(grads):
        exact = np.zeros(300, np.float32)
        for g in per_rank:   # the owner adds in rank order
            exact += g
        for outs, residual, owner, _ in results:
            np.testing.assert_array_equal(outs[step], exact)
            assert not residual.any() and not owner.any()


def test_bounds_of_an_older_checkpoint_move_onto_chunks_and_nothing_is_lost():
    """Bounds restored from a checkpoint written before chunk bounds (even, mid-chunk) are used
    for the step they were saved for, then moved onto chunk bounds at the next repartition; the
    owner residual moves with them, so the gradients are still conserved."""
    from deepreduce.collective.sparse_allreduce import chunk_bounds

    grads, results = _chunked_run(3, 4196, steps=3, loaded=even_bounds(4196, 3))
    total = sum(g for per_step in grads for g in per_step)
    for outs, _, _, held, sent, _ in results:
        assert np.array_equal(held, chunk_bounds(4196, 3, 256))
        assert [c.shape[0] for c in sent[0]] != [c.shape[0] for c in sent[-1]]   # the first step's shards were even
    delivered = sum(results[0][0])
    np.testing.assert_allclose(delivered + sum(r[1] + r[2] for r in results), total, rtol=0, atol=1e-4)
