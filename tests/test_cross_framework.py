"""One wire format: the NumPy core, the PyTorch binding and the TensorFlow binding write the
same bytes for the same gradient, name and step, and each decodes the other two's bytes to the
same array.

Covered automatically: every config in configs/, and every registered index and value codec
(with default parameters, behind Top-r) -- so a codec added later is tested without editing
this file. The TensorFlow side encodes inside ``tf.function`` with a tensor step (the graph
path training uses, including custom ops where built); two steps per tensor exercise the
error-feedback memory and step-seeded randomness.
"""
import glob
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import deepreduce  # noqa: E402
import deepreduce.tensorflow as drtf  # noqa: E402
import deepreduce.torch as drtorch  # noqa: E402
from deepreduce import registry  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def _codec_sweep():
    registry.load_builtin_components()
    out = []
    for kind in ("index", "value"):
        for codec_id in registry.ids(kind):
            config = {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "raw"},
                      "value": {"id": "raw"}, "memory": {"id": "residual"}}
            config[kind] = {"id": codec_id}
            out.append(pytest.param(config, id=f"{kind}-{codec_id}"))
    return out


CASES = [pytest.param(p, id=os.path.basename(p)) for p in CONFIG_FILES] + _codec_sweep()


def gradients():
    """(name, array) pairs: a conv-sized tensor, a mostly-zero one, a small dense one, one with NaN."""
    rng = np.random.default_rng(2024)
    conv = (rng.standard_normal((64, 64, 3, 3)) * 0.01).astype(np.float32)   # 36,864 entries
    sparse = np.zeros((50, 40), np.float32)
    pos = rng.choice(sparse.size, 150, replace=False)
    sparse.ravel()[pos] = rng.standard_normal(150).astype(np.float32)
    small = rng.standard_normal((10, 3)).astype(np.float32)
    nan = rng.standard_normal(2000).astype(np.float32)
    nan[17] = np.nan
    return [("conv", conv), ("embed", sparse), ("bias", small), ("nan", nan)]


def encode_all(config, steps=(0, 1)):
    """Bytes from each binding for every (gradient, step), and the three pipelines."""
    core, torch_pipe, tf_pipe = deepreduce.build(config), drtorch.build(config), drtf.build(config)
    step_var = tf.Variable(0, dtype=tf.int64)
    tf_encoders = {}

    def tf_encode(name, g):
        if name not in tf_encoders:
            tf_encoders[name] = tf.function(lambda x: tf_pipe.encode(x, name=name, step=step_var),
                                            input_signature=[tf.TensorSpec(g.shape, tf.float32)])
        return tf_encoders[name](tf.constant(g)).numpy()

    payloads = []
    for step in steps:
        step_var.assign(step)
        for name, g in gradients():
            g = g * np.float32(1 + step)
            payloads.append((name, step, g, {
                "numpy": core.encode(g, name=name, step=step),
                "torch": torch_pipe.encode(torch.from_numpy(g), name=name, step=step).numpy(),
                "tensorflow": tf_encode(name, g),
            }))
    return payloads, {"numpy": core, "torch": torch_pipe, "tensorflow": tf_pipe}


class Decoders:
    """Decode with each binding; the TF side through one traced graph per tensor shape."""

    def __init__(self, pipes):
        self.pipes = pipes
        self.tf_graphs = {}

    def __call__(self, binding, payload, shape):
        pipe = self.pipes[binding]
        if binding == "numpy":
            return pipe.decode(payload, shape)
        if binding == "torch":
            return pipe.decode(torch.from_numpy(payload.copy()), shape).numpy()
        if shape not in self.tf_graphs:
            self.tf_graphs[shape] = tf.function(lambda b: pipe.decode(b, shape),
                                                input_signature=[tf.TensorSpec([None], tf.uint8)])
        return self.tf_graphs[shape](tf.constant(payload)).numpy()


@pytest.mark.parametrize("config", CASES)
def test_containers_byte_identical_and_cross_decodable(config):
    payloads, pipes = encode_all(config)
    decode_with = Decoders(pipes)
    for name, step, g, by_binding in payloads:
        reference = by_binding["numpy"]
        assert reference.dtype == np.uint8 and reference.ndim == 1
        for binding, payload in by_binding.items():
            assert payload.dtype == np.uint8
            assert np.array_equal(payload, reference), f"{binding} bytes differ for {name!r} step {step}"
        expected = pipes["numpy"].decode(reference, g.shape)
        for producer, payload in by_binding.items():
            for consumer in pipes:
                got = decode_with(consumer, payload, g.shape)
                assert got.dtype == np.float32 and got.shape == g.shape
                np.testing.assert_array_equal(got, expected, err_msg=f"{consumer} decoding {producer}'s {name!r}")


def test_sweep_covers_every_registered_codec():
    ids = {p.id for p in _codec_sweep()}
    for kind in ("index", "value"):
        for codec_id in registry.ids(kind):
            assert f"{kind}-{codec_id}" in ids
    assert CONFIG_FILES, "configs/ holds no YAML config"
