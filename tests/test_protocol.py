"""The step engine in one process over the NumPy tensor port (what TensorFlow's host op runs),
over a stand-in for two ranks that send the same array. The real multi-rank runs are in
test_tensorflow_protocol.py (auto, sparse all-reduce), test_tensorflow_distributed.py and
test_multirank.py (every route, both nonfinite policies)."""
import numpy as np

import deepreduce
from deepreduce.collective.ports import NumpyTensors, Pending
from deepreduce.collective.step import Item, StepEngine

AUTO = {"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw", "memory": "residual",
        "min_numel": 0, "aggregation": {"id": "auto", "bandwidth_gbit": 1.0}}


class TwinRanks:
    """Rank 0 of two ranks whose peer sends what this rank sends."""
    rank, size = 0, 2

    def allgather(self, payload, name):
        return [payload, payload]

    def alltoall(self, payloads, name):   # the peer sends this rank what this rank sends it
        return [payloads[0], payloads[0]]


def test_the_engine_takes_each_route_counts_it_and_sends_the_residual_with_a_dense_one(monkeypatch):
    seen = []

    def allreduce(array, name, average):   # both ranks send the same: the sum is twice this rank's array
        seen.append((array.dtype, average))
        array *= 2
        return Pending(lambda: array)

    engine = StepEngine(deepreduce.build(AUTO), TwinRanks(), NumpyTensors(), allreduce, background=False)
    flat = np.array([0.5, -4.0, 1.0, 3.0, -0.25, 2.0, 0.0, -6.0], dtype=np.float32)
    out = np.zeros_like(flat)
    engine.submit(Item("w", 0, flat.copy(), target=out))   # no plan yet: the allgather
    engine.finish(0, ["w"])
    reference = deepreduce.build(AUTO)
    sent = reference.decode(reference.encode(flat.copy(), name="w", step=0), flat.shape)
    assert np.array_equal(out, sent)   # two equal containers, averaged

    monkeypatch.setattr(engine.auto, "choice", lambda name: "fp16")
    engine.submit(Item("w", 1, flat.copy(), target=out))
    engine.finish(1, ["w"])
    assert [dtype for dtype, _ in seen] == [np.float16] and seen[0][1] is False   # summed, averaged by the engine
    np.testing.assert_allclose(out, flat + (flat - sent), rtol=1e-3)   # the gradient plus what step 0 held back
    assert not engine.core.memory.residual("w").any()   # the residual went with it
    assert engine.routes_by_name == {"w": {"allgather": 1, "fp16": 1}}
    assert engine.stats()["routes_taken"] == {"allgather": 1, "fp16": 1} and engine.stats()["steps"] == 2


def test_auto_plans_with_host_costs_probed_at_run_time():
    """The first plan's inputs carry the rank's host CPU (a float32 pass, the hand-over to the
    worker, each collective call and received byte, timed through the communicator at this N),
    so a route's extra collectives and passes count in its predicted time."""
    from deepreduce.collective.cost_model import HostCosts

    engine = StepEngine(deepreduce.build(AUTO), TwinRanks(), NumpyTensors(), None, background=False)
    flat = np.linspace(-1.0, 1.0, 64, dtype=np.float32)
    engine.submit(Item("w", 0, flat.copy()))
    engine.finish(0, ["w"])
    host = engine.auto.inputs.host
    assert isinstance(host, HostCosts) and host.note == "measured by the auto aggregation at run time"
    assert host.copy_element_s > 0 and host.hand_over_s > 0
    (bucket,) = engine.auto.plan.buckets
    assert all(cost.host_s > 0 for _, cost in bucket.costs)   # every alternative's predicted time holds them
    # host_costs: false plans from the codec and the link alone (a stated link decides)
    config = dict(AUTO, aggregation=dict(AUTO["aggregation"], host_costs=False))
    engine = StepEngine(deepreduce.build(config), TwinRanks(), NumpyTensors(), None, background=False)
    engine.submit(Item("w", 0, flat.copy()))
    engine.finish(0, ["w"])
    assert engine.auto.inputs.host is None
    assert all(cost.host_s == 0 for _, cost in engine.auto.plan.buckets[0].costs)
