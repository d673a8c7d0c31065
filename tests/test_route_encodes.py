"""Each route owns its encode: the small-tensor rule of the dense route, the summable route's
memory between steps, and the pipeline keeping only its stage API (no encode per route)."""
import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

import deepreduce
from deepreduce.collective.ports import NumpyTensors, Pending
from deepreduce.collective.routes.dense import count_summed_dense, summed_dense
from deepreduce.collective.routes.summable import Summable
from deepreduce.collective.step import Item
from deepreduce.pipeline import Pipeline


def cfg(sparsifier, **extra):
    return dict({"sparsifier": sparsifier, "index": "raw", "value": "raw", "memory": "none", "min_numel": 0}, **extra)


def test_only_small_tensors_under_nonfinite_propagate_skip_the_container():
    """The integrations sum these with the framework's all-reduce: same sum, same NaN reach."""
    pipe = deepreduce.build(dict(cfg({"id": "topk", "ratio": 0.01}), min_numel=1000))
    assert summed_dense(pipe, 999) and summed_dense(pipe, 0) and not summed_dense(pipe, 1000)
    strict = deepreduce.build(dict(cfg({"id": "topk", "ratio": 0.01}), min_numel=1000, nonfinite="raise"))
    assert not summed_dense(strict, 10)   # a container names the rank that sent a NaN
    count_summed_dense(pipe, 100)
    stats = pipe.stats
    assert (stats.tensors_encoded, stats.dense_bytes, stats.wire_bytes) == (1, 400, 400)


def test_the_pipeline_has_its_stages_and_no_encode_per_route():
    flavours = ("encode_entries", "decode_entries", "encode_shards", "encode_dense", "encode_selection",
                "summed_dense", "count_summed_dense")
    assert not [name for name in flavours if hasattr(Pipeline, name)]
    for stage in ("encode", "decode", "decode_sum", "compensate", "select", "pack_selection", "settle", "pack",
                  "native_reason"):
        assert callable(getattr(Pipeline, stage))


class Codes:
    """A summable compressor whose codes are float16 and ``scale`` times the gradient's size
    (0.5: fewer elements, as GradiVeQ's; 2: more)."""

    def __init__(self, scale):
        self.scale = scale

    def compress(self, tensor):
        flat = tensor.reshape(-1).astype(np.float16)
        if self.scale < 1:
            return flat[::int(1 / self.scale)].copy(), tensor.shape
        return np.concatenate([flat] * int(self.scale)), tensor.shape

    def decompress(self, codes, shape):
        return np.resize(codes.astype(np.float32), shape)


@pytest.mark.parametrize("scale", [0.5, 1, 2])
def test_the_summable_route_keeps_no_codes_between_steps(scale):
    """Only the codes' size and dtype stay after a step (for fp16 the codes are half a gradient);
    a rank whose next step fails still sends zeros of that size and dtype, then the flag."""
    sent = []

    def allreduce(tensor, item, average):
        sent.append(tensor)
        return Pending(lambda: tensor)

    engine = SimpleNamespace(compressor=Codes(scale), tensors=NumpyTensors(), average=False,
                             allreduce_averages=False, allreduce=allreduce)
    route = Summable(engine)
    grad = np.arange(1000, dtype=np.float32)
    item = Item("w", 0, grad.copy())
    started = route.start(engine, item)
    codes = weakref.ref(started[0][0])
    outcome = route.finish(engine, item, started)
    outcome.write(1)
    np.testing.assert_array_equal(item.target, engine.compressor.decompress(started[0][0], grad.shape))
    del started, outcome
    sent.clear()
    gc.collect()
    assert codes() is None   # nothing the route holds refers to them
    assert route._code_layout == {"w": (int(1000 * scale), "float16")}
    failed = route.fail(engine, Item("w", 1, grad.copy()), ValueError("encode broke"))
    payload = failed[2]
    assert payload.dtype == np.float16 and payload.shape == (int(1000 * scale) + 1,)
    assert not payload[:-1].any() and payload[-1] == 1.0
    first = Summable(engine).fail(engine, Item("v", 0, grad.copy()), ValueError("encode broke"))[2]
    assert first.dtype == np.float32 and first.shape == (1001,)   # the first step: the gradient's own
