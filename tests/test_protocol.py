"""deepreduce.collective.protocol in one process: ``reduce_flat``, the one-call reduction TensorFlow's host
ops run, over a stand-in for two ranks that send the same array. The real multi-rank runs are in
test_tensorflow_protocol.py (auto, sparse all-reduce) and test_tensorflow_distributed.py."""
import numpy as np

import deepreduce
from deepreduce.collective.protocol import FINE, ReductionProtocol

AUTO = {"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw", "memory": "residual",
        "min_numel": 0, "aggregation": {"id": "auto", "bandwidth_gbit": 1.0}}


class TwinRanks:
    """Rank 0 of two ranks whose peer sends what this rank sends."""
    rank, size = 0, 2

    def allgather(self, payload, name):
        return [payload, payload]


def test_reduce_flat_takes_each_route_counts_it_and_sends_the_residual_with_a_dense_one(monkeypatch):
    protocol = ReductionProtocol(deepreduce.build(AUTO), TwinRanks())
    flat = np.array([0.5, -4.0, 1.0, 3.0, -0.25, 2.0, 0.0, -6.0], dtype=np.float32)
    total, found = protocol.reduce_flat(flat.copy(), "w", 0, allreduce=None)   # no plan yet: the allgather
    reference = deepreduce.build(AUTO)
    sent = reference.decode(reference.encode(flat.copy(), name="w", step=0), flat.shape)
    assert found == FINE and np.array_equal(total, sent)   # two equal containers, averaged

    seen = []

    def allreduce(array, route):   # both ranks send the same: the sum is twice this rank's array
        seen.append((array.dtype, route))
        return array.astype(np.float32) * 2

    monkeypatch.setattr(protocol.auto, "choice", lambda name: "fp16")
    total, found = protocol.reduce_flat(flat.copy(), "w", 1, allreduce)
    assert found == FINE and seen == [(np.float16, "fp16")]
    np.testing.assert_array_equal(total, flat + (flat - sent))   # the gradient plus what step 0 held back
    assert not protocol.core.memory.residual("w").any()   # the residual went with it
    assert protocol.routes_taken == {"w": {"allgather": 1, "fp16": 1}}
