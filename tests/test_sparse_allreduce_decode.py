"""The sparse all-reduce's last phase: the returned shards are decoded already divided (averaging
without a pass over the tensor's zeros), and the shard bounds move by the sum's non-zeros read off
the owners' containers (not by a pass over every element). Both must give exactly what the
decode-then-divide and ``flatnonzero`` of the decoded sum gave."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepreduce
from deepreduce.backend import native_pipeline
from deepreduce.collective import shards
from deepreduce.collective.sparse_allreduce import SparseAllreduce
from deepreduce.errors import ContainerError

NATIVE = native_pipeline.module()
needs_native = pytest.mark.skipif(NATIVE is None, reason="the C++ pipeline is not built")


class _Ranks:
    """The communicator a SparseAllreduce needs to be built (its decode runs no collective)."""

    rank, size = 0, 3


def _containers(seed: int, numel: int, bounds, special: bool, value=None):
    """Shard containers of one flat tensor: sparse ones (Top-r, raw values) and, for the second
    shard, a dense one holding zeros; with ``special``, so many zeros that the selection holds
    some, -0.0, and values whose quotient underflows."""
    rng = np.random.default_rng(seed)
    grad = rng.laplace(size=numel).astype(np.float32)
    grad[rng.random(numel) < (0.9 if special else 0.3)] = 0.0   # 0.9: Top-20% selects zeros too
    if special:
        grad[::7] = np.float32(1e-45)      # the smallest subnormal: halved, it rounds to zero
        grad[1::11] = np.float32(-0.0)
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.2}, "index": {"id": "elias_fano"},
                             "value": value or {"id": "raw"}, "memory": {"id": "none"}, "min_numel": 1})
    payloads = shards.encode_shards(pipe, grad, "w", 0, bounds)
    if len(bounds) > 2:
        lo, hi = bounds[1], bounds[2]
        payloads[1] = shards.encode_dense(pipe, grad[lo:hi])
    return pipe, payloads


def _python_decode(pipe, payloads, bounds, divisor):
    out = np.full(bounds[-1], np.float32(7.0))    # every element must be written
    for j, payload in enumerate(payloads):
        pipe.decode(payload, expected_shape=(bounds[j + 1] - bounds[j],), out=out[bounds[j]:bounds[j + 1]])
    np.divide(out, divisor, out=out)
    return out


@needs_native
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), numel=st.integers(3, 400), divisor=st.integers(1, 9),
       special=st.booleans(), threads=st.sampled_from([1, 2, 4]))
def test_native_decode_divides_each_written_value_as_numpy_divides_the_decoded_sum(seed, numel, divisor,
                                                                                   special, threads):
    cut1, cut2 = sorted(np.random.default_rng(seed).integers(0, numel + 1, size=2))
    bounds = [0, int(cut1), int(cut2), numel]
    pipe, payloads = _containers(seed, numel, bounds, special)
    expected = _python_decode(pipe, payloads, bounds, divisor)
    out = np.full(numel, np.float32(7.0))
    native_pipeline.decode_shards(NATIVE, payloads, bounds, out, threads, divisor)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))   # bit for bit, -0.0 included


@needs_native
@pytest.mark.parametrize("divisor", [0.0, -2.0, float("nan"), float("inf")])
def test_native_decode_refuses_a_divisor_that_is_not_a_positive_finite_number(divisor):
    pipe, payloads = _containers(0, 40, [0, 20, 40], False)
    with pytest.raises(ValueError, match="divisor must be a positive finite number"):
        NATIVE.decode_shards(payloads, [0, 20, 40], np.zeros(40, np.float32), 1, divisor)
    with pytest.raises(ValueError, match="divisor must be a positive finite number") as refused:
        native_pipeline.decode_shards(NATIVE, payloads, [0, 20, 40], np.zeros(40, np.float32), 1, divisor)
    assert not isinstance(refused.value, ContainerError)   # the caller's mistake, not the bytes'


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), numel=st.integers(3, 400), special=st.booleans())
def test_the_sums_nonzeros_read_off_the_containers_are_flatnonzero_of_the_decoded_sum(seed, numel, special):
    cut1, cut2 = sorted(np.random.default_rng(seed + 1).integers(0, numel + 1, size=2))
    bounds = [0, int(cut1), int(cut2), numel]
    # 2-level QSGD rounds many selected values to zero: entries the sum does not count
    pipe, payloads = _containers(seed, numel, bounds, special, {"id": "qsgd", "levels": 1, "bucket_size": 16})
    decoded = _python_decode(pipe, payloads, bounds, 1)
    reducer = SparseAllreduce(pipe, _Ranks())
    found = reducer._summed_nonzeros(payloads, np.asarray(bounds))
    np.testing.assert_array_equal(found, np.flatnonzero(decoded))


def test_decode_into_a_new_array_is_divided_on_the_python_path_too(monkeypatch):
    bounds = [0, 30, 60, 90]
    pipe, payloads = _containers(3, 90, bounds, True)
    expected = _python_decode(pipe, payloads, bounds, 3)
    monkeypatch.setattr(native_pipeline, "module", lambda: None)
    reducer = SparseAllreduce(pipe, _Ranks())
    out = np.full(90, np.float32(7.0))
    reducer._decode_shards(payloads, np.asarray(bounds), out, 3)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_entries_a_value_codec_rounded_to_zero_do_not_count_as_the_sums_nonzeros():
    bounds = [0, 100, 200, 300]
    pipe, payloads = _containers(5, 300, bounds, False, {"id": "qsgd", "levels": 1, "bucket_size": 16})
    zeros = sum(int((pipe.entries_of(p, (100,))[1] == 0).sum()) for p in (payloads[0], payloads[2]))
    assert zeros > 0   # the containers do carry entries whose value is zero
    decoded = pipe.stats.tensors_decoded
    found = SparseAllreduce(pipe, _Ranks())._summed_nonzeros(payloads, np.asarray(bounds))
    assert pipe.stats.tensors_decoded == decoded   # read again after their decode: not counted twice
    np.testing.assert_array_equal(found, np.flatnonzero(_python_decode(pipe, payloads, bounds, 1)))
