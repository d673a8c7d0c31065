"""Chunked Top-k (``chunk_topk``): the k largest magnitudes of every chunk, a fixed count per
chunk (tail included), ties to the lowest positions, and the 64 x 64 block layout helpers."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce.errors import ConfigError
from deepreduce.registry import create
from deepreduce.sparsify.chunked import chunk_topk_positions, from_blocks, to_blocks
from deepreduce.wire import chunks
from deepreduce.wire.seeding import EncodeContext

CTX = EncodeContext(b"\x01" * 16, "t", 0)


def brute_force(flat, chunk, k):
    """Per chunk: order by (-|v|, position), keep the first count; the count rule of the tail."""
    out = []
    for start in range(0, flat.shape[0], chunk):
        part = np.abs(flat[start:start + chunk])
        keep = k if part.shape[0] == chunk else chunks.tail_count(k, part.shape[0], chunk)
        order = sorted(range(part.shape[0]), key=lambda i: (-part[i], i))[:keep]
        out.extend(start + i for i in sorted(order))
    return np.asarray(out, dtype=np.int64)


@pytest.mark.parametrize("numel,chunk,k", [(4096 * 3, 4096, 64), (4096 * 3 + 700, 4096, 64), (100, 4096, 64),
                                           (1, 4096, 64), (64 * 5 + 1, 64, 32), (50, 8, 8), (4096, 4096, 4096)])
def test_selection_is_the_per_chunk_top_k(numel, chunk, k):
    flat = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    chosen = chunk_topk_positions(flat, chunk, k)
    np.testing.assert_array_equal(chosen, brute_force(flat, chunk, k))
    assert chosen.shape[0] == chunks.uniform_total(numel, chunk, k)


def test_ties_go_to_the_lowest_positions_of_each_chunk():
    flat = np.ones(4096 * 2 + 10, dtype=np.float32)
    flat[4096 + 7] = -2.0                            # one larger magnitude in chunk 1
    chosen = chunk_topk_positions(flat, 4096, 4)
    np.testing.assert_array_equal(chosen, [0, 1, 2, 3, 4096, 4097, 4098, 4096 + 7, 8192])


def test_every_gradient_gives_a_container_of_the_same_size():
    pipe = deepreduce.build({"sparsifier": {"id": "chunk_topk", "k": 32}, "index": {"id": "chunk_fixed"},
                             "value": {"id": "raw"}, "memory": {"id": "none"}})
    rng = np.random.default_rng(3)
    sizes = set()
    for step, grad in enumerate([rng.standard_normal(10_000), rng.laplace(size=10_000) * 1e-6,
                                 np.zeros(10_000), np.r_[np.ones(5000), np.zeros(5000)]]):
        sizes.add(pipe.encode(grad.astype(np.float32), "w", step).shape[0])
    assert len(sizes) == 1


def test_k_ratio_and_default():
    assert create("sparsifier", {"id": "chunk_topk"}).per_chunk == 64
    assert create("sparsifier", {"id": "chunk_topk", "chunk": 64}).per_chunk == 1
    assert create("sparsifier", {"id": "chunk_topk", "ratio": 0.02}).per_chunk == 81
    assert create("sparsifier", {"id": "chunk_topk", "k": 32}).count(4096 * 2 + 128) == 65
    with pytest.raises(ConfigError, match="not both"):
        create("sparsifier", {"id": "chunk_topk", "k": 32, "ratio": 0.01})
    with pytest.raises(ConfigError, match="more than the chunk"):
        create("sparsifier", {"id": "chunk_topk", "chunk": 16, "k": 32})
    with pytest.raises(ConfigError, match="chunk"):
        create("sparsifier", {"id": "chunk_topk", "chunk": 0})


def test_tail_count_rule():
    assert chunks.tail_count(64, 0, 4096) == 0
    assert chunks.tail_count(64, 1, 4096) == 1
    assert chunks.tail_count(64, 64, 4096) == 1
    assert chunks.tail_count(64, 65, 4096) == 2
    assert chunks.tail_count(64, 4095, 4096) == 64
    assert chunks.tail_count(4, 3, 4) == 3


def test_blocks_round_trip_and_chunks_are_blocks():
    matrix = np.arange(128 * 192, dtype=np.float32).reshape(128, 192)
    flat = to_blocks(matrix, 64)
    np.testing.assert_array_equal(flat[:4096].reshape(64, 64), matrix[:64, :64])
    np.testing.assert_array_equal(flat[4096:8192].reshape(64, 64), matrix[:64, 64:128])
    np.testing.assert_array_equal(from_blocks(flat, matrix.shape, 64), matrix)
    with pytest.raises(ConfigError, match="blocks"):
        to_blocks(np.zeros((65, 64), np.float32), 64)
    with pytest.raises(ConfigError, match="blocks"):
        from_blocks(np.zeros(100, np.float32), (64, 64), 64)


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 3000), chunk=st.integers(1, 600), k=st.integers(1, 64), seed=st.integers(0, 2**16),
       levels=st.integers(1, 5))
def test_selection_property(numel, chunk, k, seed, levels):
    k = min(k, chunk)
    rng = np.random.default_rng(seed)
    flat = (rng.integers(-levels, levels + 1, numel)).astype(np.float32)   # many ties
    chosen = create("sparsifier", {"id": "chunk_topk", "chunk": chunk, "k": k}).select(flat, CTX)
    np.testing.assert_array_equal(chosen, brute_force(flat, chunk, k))


def test_blocks_of_torch_tensors():
    import torch
    matrix = torch.arange(128 * 64, dtype=torch.float32).reshape(128, 64)
    flat = to_blocks(matrix, 64)
    assert isinstance(flat, torch.Tensor)
    np.testing.assert_array_equal(flat.numpy(), to_blocks(matrix.numpy(), 64))
    assert torch.equal(from_blocks(flat, (128, 64), 64), matrix)


def test_torch_tensors_select_the_same_positions_on_their_device():
    import torch
    rng = np.random.default_rng(7)
    for numel, chunk, k in ((4096 * 3 + 300, 4096, 64), (1000, 64, 8), (5, 4096, 64)):
        flat = rng.integers(-6, 7, numel).astype(np.float32)            # ties everywhere
        got = chunk_topk_positions(torch.from_numpy(flat), chunk, k)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
        np.testing.assert_array_equal(got.numpy(), chunk_topk_positions(flat, chunk, k))
    sparsifier = create("sparsifier", {"id": "chunk_topk", "k": 16})
    flat = rng.standard_normal(9000).astype(np.float32)
    np.testing.assert_array_equal(sparsifier.select(torch.from_numpy(flat), CTX).numpy(), sparsifier.select(flat, CTX))


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 6), chunk=st.sampled_from([256, 1000, 1024, 4096]), k=st.integers(1, 200),
       tail=st.integers(0, 900), seed=st.integers(0, 2**16), kind=st.sampled_from(["normal", "ties", "sparse", "spiked"]))
def test_the_cpp_kernel_selects_what_the_array_version_selects(rows, chunk, k, tail, seed, kind):
    """The C++ chunked Top-k (the NumPy path when built: a bound from every 8th key, the cut among
    the keys reaching it, else among all) against the array definition, with ties, zeros and
    -0.0, and rows whose sampled keys are the only large ones (the bound lets too few through)."""
    from deepreduce.backend import kernels
    from deepreduce.sparsify.chunked import array_chunk_topk_positions
    assert kernels.native() is not None   # built by make setup: the NumPy path below is the C++ kernel
    rng = np.random.default_rng(seed)
    n = rows * chunk + tail
    flat = {"normal": lambda: rng.standard_normal(n), "ties": lambda: rng.integers(-3, 4, n),
            "sparse": lambda: rng.laplace(size=n) * (rng.random(n) < 0.05),
            "spiked": lambda: np.where(np.arange(n) % 8 == 0, 100.0, rng.random(n))}[kind]().astype(np.float32)
    flat[rng.random(n) < 0.05] = -0.0
    k = min(k, chunk)
    np.testing.assert_array_equal(chunk_topk_positions(flat, chunk, k), array_chunk_topk_positions(flat, chunk, k))


def test_the_sparsifier_runs_the_kernel_on_the_pipelines_threads(kernel_threads):
    """A pipeline's ``threads`` option reaches the chunked Top-k kernel (it used to run on one
    thread whatever the option said), and the container does not depend on it."""
    flat = np.random.default_rng(4).standard_normal(1024 * 40 + 5).astype(np.float32)
    config = deepreduce.build("semisync_1bit").get_config()
    one = deepreduce.build(dict(config, threads=1)).encode(flat, "w", 0)
    seen = kernel_threads("chunk_topk")
    three = deepreduce.build(dict(config, threads=3)).encode(flat, "w", 0)
    assert seen == [("chunk_topk", 3)]
    np.testing.assert_array_equal(three, one)


def test_the_cpp_kernel_selects_the_same_rows_on_any_number_of_threads():
    """The kernel splits whole rows among its threads: 1, 2 and 3 threads, the same positions."""
    from deepreduce.backend import kernels
    module = kernels.native()
    flat = np.random.default_rng(3).integers(-4, 5, 1024 * 300 + 77).astype(np.float32)   # ties everywhere
    tail = chunks.tail_count(32, 77, 1024)
    one = module.chunk_topk(flat, 1024, 32, tail, 1)
    np.testing.assert_array_equal(one, chunk_topk_positions(flat, 1024, 32))
    for threads in (2, 3):
        np.testing.assert_array_equal(module.chunk_topk(flat, 1024, 32, tail, threads), one)
