"""Checkpointable compression state: Pipeline / memory / SIDCo / GradiVeQ state_dict round trips."""
import io

import numpy as np
import pytest
import torch

import deepreduce
from deepreduce.errors import ConfigError
from deepreduce.torch import GradiVeQ
from deepreduce.torch.checkpoint import to_numpy, to_torch

STATEFUL = {"sparsifier": {"id": "sidco", "ratio": 0.02, "stages": 2, "period": 2}, "memory": "residual",
            "index": {"id": "bloom", "policy": "p2", "fpr": 0.01}, "value": "raw"}
SHAPES = {"conv": (16, 8, 3, 3), "fc": (50, 40)}


def gradient(name, step):
    rng = np.random.default_rng([step, len(name)])
    return rng.standard_normal(SHAPES[name]).astype(np.float32)


def encode_step(pipe, step):
    return {name: pipe.encode(gradient(name, step), name=name, step=step).tobytes() for name in SHAPES}


def through_torch_save(state):
    """What a PyTorch checkpoint gives back: tensors through torch.save / torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(to_torch(state), buffer)
    buffer.seek(0)
    return to_numpy(torch.load(buffer, weights_only=True))


def test_pipeline_resumed_from_its_state_sends_identical_containers():
    pipe = deepreduce.build(STATEFUL)
    for step in range(5):
        encode_step(pipe, step)
    saved = through_torch_save(pipe.state_dict())
    assert set(saved["memory"]["residuals"]) == set(SHAPES) and set(saved["sparsifier"]["tensors"]) == set(SHAPES)
    expected = encode_step(pipe, 5)

    resumed = deepreduce.build(STATEFUL)
    resumed.load_state_dict(saved)
    assert encode_step(resumed, 5) == expected
    assert encode_step(deepreduce.build(STATEFUL), 5) != expected      # the state is what made them equal


def test_pipeline_refuses_a_checkpoint_of_another_config_or_shape():
    pipe = deepreduce.build(STATEFUL)
    encode_step(pipe, 0)
    state = pipe.state_dict()
    other = deepreduce.build(dict(STATEFUL, memory="none"))
    with pytest.raises(ConfigError, match="another config"):
        other.load_state_dict(state)
    with pytest.raises(ConfigError, match="keys"):
        pipe.load_state_dict({"memory": {}})
    broken = dict(state, memory={"residuals": {"fc": np.zeros((2, 2), np.float32)}})
    with pytest.raises(ConfigError, match="residual 'fc' must be a 1-D float array"):
        pipe.load_state_dict(broken)
    with pytest.raises(ConfigError, match="stage state of 'fc'"):
        pipe.load_state_dict(dict(state, sparsifier={"tensors": {"fc": {"stages": 1}}}))


def test_stateless_components_accept_only_empty_state():
    pipe = deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.1}, "index": "raw", "value": "raw",
                             "memory": "none"})
    assert pipe.state_dict()["memory"] == {} and pipe.state_dict()["sparsifier"] == {}
    with pytest.raises(ConfigError, match="keeps no state"):
        pipe.index.load_state_dict({"anything": 1})


def gradiveq_round(compressor, step):
    """One single-rank step over two conv gradients: compress, 'allreduce' (identity), decompress."""
    out = []
    for name, shape in (("a", (8, 4, 3, 3)), ("b", (8, 8, 3, 3))):
        g = torch.from_numpy(np.random.default_rng([step, shape[1]]).standard_normal(shape).astype(np.float32))
        code, ctx = compressor.compress(g, name=name)
        out.append(code.clone())
        compressor.decompress(code, ctx)
    return out


@pytest.mark.parametrize("saved_at", [2, 5])       # inside the sampling window; compressing
def test_gradiveq_resumed_from_its_state_sends_identical_codes(saved_at):
    args = dict(warmup=1, sample_iters=3, compress_iters=4, min_numel=64)
    compressor = GradiVeQ(**args)
    for step in range(saved_at):
        gradiveq_round(compressor, step)
    buffer = io.BytesIO()
    torch.save(compressor.state_dict(), buffer)
    buffer.seek(0)
    resumed = GradiVeQ(**args)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for step in range(saved_at, 8):
        for a, b in zip(gradiveq_round(resumed, step), gradiveq_round(compressor, step)):
            assert torch.equal(a, b)
    assert compressor.model("a") is not None
    assert compressor.state_dict()["tensors"]["a"]["t"] == 8
    with pytest.raises(ConfigError, match="checkpoint of GradiVeQ"):
        GradiVeQ(**dict(args, loss=0.05)).load_state_dict(compressor.state_dict())


def test_distributed_optimizer_resumed_from_its_state_dict_sends_identical_containers():
    """Real horovod.torch optimizer on one rank (tests/workers/torch_optimizer_checkpoint.py)."""
    import json
    import subprocess
    import sys

    from conftest import WORKERS, launch_env

    proc = subprocess.run([sys.executable, str(WORKERS / "torch_optimizer_checkpoint.py")], env=launch_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # one container per step: fc1.weight; the five tensors below min_numel are summed by Horovod's
    # all-reduce without a container (routes.dense.summed_dense)
    assert result == {"containers": 1, "identical": True, "without_state_identical": False}
