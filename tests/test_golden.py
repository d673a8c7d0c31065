"""Golden fixtures freeze container format v1: same input, same bytes, same decoded tensor."""
import glob
import json
import os

import numpy as np
import pytest

import deepreduce

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = sorted(glob.glob(os.path.join(HERE, "golden", "*.npz")))
ROOT = os.path.dirname(HERE)


def test_fixtures_exist_for_every_config():
    names = {os.path.basename(f)[:-4] for f in FIXTURES}
    for path in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
        stem = os.path.splitext(os.path.basename(path))[0]
        assert f"config_{stem}" in names, f"no golden fixture for {path}: run tests/golden/make_golden.py"


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: os.path.basename(p)[:-4])
def test_fixture_bytes_are_frozen(path):
    data = np.load(path)
    config = json.loads(str(data["config"]))
    pipe = deepreduce.build(config)
    payload = data["payload"]
    assert deepreduce.inspect(payload)["format_version"] == 1
    decoded = pipe.decode(payload)
    again = pipe.encode(data["grad"], name=str(data["tensor_name"]), step=int(data["step"]))
    assert again.tobytes() == payload.tobytes(), "encoder output changed: the wire format moved"
    np.testing.assert_array_equal(pipe.decode(again), decoded)
