"""Index reordering (spec §1.14): a permutation travels only when the value codec reorders and
the index codec yields a set (ascending); the decoder puts every value back at its own index."""
from __future__ import annotations

import numpy as np
import pytest

from deepreduce import registry
from deepreduce.errors import ContainerError
from deepreduce.index import IndexCodec, IndexEncoding
from deepreduce.memory import NoMemory
from deepreduce.pipeline import Pipeline
from deepreduce.sparsify.basic import TopK
from deepreduce.values import ValueCodec, ValueEncoding
from deepreduce.wire import bitpack, container


class AscendingSetIndex(IndexCodec):
    """Test double of a set codec (Bloom, Elias-Fano): decodes the indices ascending only."""

    id = "test_ascending"
    wire_id = 251
    keeps_order = False

    def encode(self, indices, values, dense, ctx):
        order = np.argsort(indices, kind="stable")
        indices = np.asarray(indices)[order]
        return IndexEncoding(b"", indices.astype("<u4").tobytes(), indices, np.asarray(values)[order])

    def decode(self, params, payload, count, numel):
        out = np.frombuffer(payload, dtype="<u4").astype(np.int64)
        if out.size != count or np.any(np.diff(out) <= 0):
            raise ContainerError("not an ascending index set")
        return out


class SortedExactValues(ValueCodec):
    """Test double of a curve fit that is exact: sends the values sorted descending, raw."""

    id = "test_sorted"
    wire_id = 252
    keeps_order = False

    def encode(self, values, ctx):
        order = np.argsort(-np.asarray(values), kind="stable")
        return ValueEncoding(b"", np.asarray(values, "<f4")[order].tobytes(), order)

    def decode(self, params, payload, count):
        return np.frombuffer(payload, dtype="<f4").astype(np.float32)


def pipeline(index, value, ratio=0.01):
    return Pipeline(TopK(ratio=ratio), index, value, NoMemory(), min_numel=0)


def expected_sparse(grad, ratio):
    flat = grad.ravel()
    out = np.zeros_like(flat)
    keep = TopK(ratio=ratio).select(flat, None)
    out[keep] = flat[keep]
    return out.reshape(grad.shape)


GRAD = np.random.default_rng(0).laplace(size=(64, 64, 3, 3)).astype(np.float32)


def test_set_index_with_reordering_values_carries_a_ceil_log2_n_bit_permutation():
    pipe = pipeline(AscendingSetIndex(), SortedExactValues())
    payload = pipe.encode(GRAD, "conv")
    c = container.unpack(payload)
    n = c.n
    assert n == 368 and c.permuted and c.perm_width == int(np.ceil(np.log2(n))) == 9
    assert len(c.perm_section) == bitpack.packed_size(n, 9)
    np.testing.assert_array_equal(pipe.decode(payload), expected_sparse(GRAD, 0.01))


@pytest.mark.parametrize("n", [1, 2, 3, 256, 257])
def test_permutation_width_edges(n):
    grad = np.zeros(4096, np.float32)
    grad[np.random.default_rng(n).choice(4096, n, replace=False)] = np.random.default_rng(1).normal(size=n)
    pipe = pipeline(AscendingSetIndex(), SortedExactValues(), ratio=n / 4096)
    c = container.unpack(pipe.encode(grad, "g"))
    assert c.n == n and c.perm_width == max(1, int(np.ceil(np.log2(max(n, 2)))))
    np.testing.assert_array_equal(pipe.decode(container.pack(c)), expected_sparse(grad, n / 4096))


def test_order_keeping_index_gets_permuted_indices_and_no_permutation():
    pipe = pipeline(registry.create("index", "raw"), SortedExactValues())
    payload = pipe.encode(GRAD, "conv")
    c = container.unpack(payload)
    assert not c.permuted and c.perm_section == b"" and c.perm_width == 0
    idx = np.frombuffer(c.index_section, "<u4")
    assert np.any(np.diff(idx.astype(np.int64)) < 0)    # indices travel in sorted-value order
    np.testing.assert_array_equal(pipe.decode(payload), expected_sparse(GRAD, 0.01))


@pytest.mark.parametrize("value", ["raw", "qsgd", "deflate", "sketchml"])
def test_order_keeping_values_need_no_permutation(value):
    pipe = pipeline(AscendingSetIndex(), registry.create("value", value))
    c = container.unpack(pipe.encode(GRAD, "conv"))
    assert not c.permuted and c.perm_section == b""


@pytest.mark.parametrize("value", ["polyfit", "dexp"])
def test_curve_fits_with_a_set_index_put_values_back_at_their_indices(value):
    codec = registry.create("value", value)
    pipe = pipeline(AscendingSetIndex(), codec)
    payload = pipe.encode(GRAD, "conv")
    c = container.unpack(payload)
    assert c.permuted
    out = pipe.decode(payload).ravel()
    # The same fit through an order-keeping index must give the same dense tensor.
    ref = pipeline(registry.create("index", "raw"), codec).decode(
        pipeline(registry.create("index", "raw"), codec).encode(GRAD, "conv")).ravel()
    np.testing.assert_array_equal(out, ref)
    target = expected_sparse(GRAD, 0.01).ravel()
    assert np.array_equal(np.flatnonzero(out), np.flatnonzero(target))
    # the fitted values keep the rank order of the originals: signs agree everywhere for polyfit
    if value == "polyfit":
        assert np.all(np.sign(out[target != 0]) == np.sign(target[target != 0]))


def _repacked(payload, **changes):
    c = container.unpack(payload)
    for key, value in changes.items():
        setattr(c, key, value)
    return container.pack(c)        # a valid CRC: only the permutation check can object


def test_corrupted_permutation_raises():
    pipe = pipeline(AscendingSetIndex(), SortedExactValues())
    payload = pipe.encode(GRAD, "conv")
    c = container.unpack(payload)
    perm = bitpack.unpack(c.perm_section, c.perm_width, c.n).astype(np.int64)
    dup = perm.copy()
    dup[0] = dup[1]
    with pytest.raises(ContainerError, match="permutation"):
        pipe.decode(_repacked(payload, perm_section=bitpack.pack(dup, c.perm_width)))
    big = perm.copy()
    big[5] = c.n + 3                                     # fits in 9 bits, beyond n
    with pytest.raises(ContainerError, match="permutation"):
        pipe.decode(_repacked(payload, perm_section=bitpack.pack(big, c.perm_width)))
    with pytest.raises(ContainerError):
        pipe.decode(_repacked(payload, perm_section=c.perm_section[:-1]))
    with pytest.raises(ContainerError):
        pipe.decode(_repacked(payload, perm_width=0))
    with pytest.raises(ContainerError):
        pipe.decode(_repacked(payload, perm_width=8))    # section length no longer matches
    swapped = perm.copy()
    swapped[[0, 1]] = swapped[[1, 0]]                    # still a permutation: decodes, wrongly placed
    out = pipe.decode(_repacked(payload, perm_section=bitpack.pack(swapped, c.perm_width)))
    assert not np.array_equal(out, pipe.decode(payload))
