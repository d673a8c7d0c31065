"""Golden fixtures freeze the wire format.

``tests/golden/*.npz`` (format v2): same input, same bytes, same decoded tensor.
``tests/golden/v1/*.npz`` (format v1, written by the v1 code): still decode to the tensors the
v1 code decoded them to, so containers of older senders stay readable.
"""
import glob
import json
import math
import os

import numpy as np
import pytest

import deepreduce
from deepreduce.index import bloom
from deepreduce.wire import container

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = sorted(glob.glob(os.path.join(HERE, "golden", "*.npz")))
V1_FIXTURES = sorted(glob.glob(os.path.join(HERE, "golden", "v1", "*.npz")))
ROOT = os.path.dirname(HERE)


def _name(path):
    return os.path.basename(path)[:-4]


#: The configs shipped when format v1 was current: only they have v1 fixtures (written by the v1
#: code, never regenerated); a config added later has a v2 fixture only.
V1_CONFIGS = ("bf_naive", "bf_p0", "bf_p1", "bf_p2", "bfp0_qsgd", "bfp2_polyfit", "deflate", "dexp", "dgc",
              "elias_fano", "huffman", "none_raw", "polyfit", "qsgd", "rle", "sidco_exp", "sidco_gamma",
              "sidco_gpareto", "skcompress", "skcompress_topk", "sketchml", "threshold", "topk_raw")


def test_fixtures_exist_for_every_config():
    names = {_name(f) for f in FIXTURES}
    for path in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
        stem = os.path.splitext(os.path.basename(path))[0]
        assert f"config_{stem}" in names, f"no golden fixture for {path}: run tests/golden/make_golden.py"
    assert {_name(f) for f in V1_FIXTURES} >= {f"config_{stem}" for stem in V1_CONFIGS}


@pytest.mark.parametrize("path", FIXTURES, ids=_name)
def test_fixture_bytes_are_frozen(path):
    data = np.load(path)
    pipe = deepreduce.build(json.loads(str(data["config"])))
    payload = data["payload"]
    info = deepreduce.inspect(payload)
    assert info["format_version"] == 2
    assert bytes.fromhex(info["config_digest"]) == pipe._digest[:container.DIGEST_SIZE]
    decoded = pipe.decode(payload)
    np.testing.assert_array_equal(decoded, data["decoded"])
    again = pipe.encode(data["grad"], name=str(data["tensor_name"]), step=int(data["step"]))
    assert again.tobytes() == payload.tobytes(), "encoder output changed: the wire format moved"


@pytest.mark.parametrize("path", V1_FIXTURES, ids=_name)
def test_v1_fixture_decodes_to_the_v1_tensor(path):
    data = np.load(path)
    payload = data["payload"]
    c = container.unpack(payload)
    assert c.version == 1 and c.digest is None
    assert deepreduce.inspect(payload)["format_version"] == 1
    # any receiver decodes it, whatever its own config
    for config in (json.loads(str(data["config"])), os.path.join(ROOT, "configs", "topk_raw.yaml")):
        np.testing.assert_array_equal(deepreduce.build(config).decode(payload), data["decoded"])


@pytest.mark.parametrize("path", V1_FIXTURES, ids=_name)
def test_v2_volume_against_v1(path):
    """The v2 header is smaller, so every container shrinks, except that a Bloom filter of the
    blocked family needs more bits per index than a v1 filter of the same rate (docs/bloom.md):
    its section may grow by that ratio, nothing else may."""
    data = np.load(path)
    pipe = deepreduce.build(json.loads(str(data["config"])))
    v1 = container.unpack(data["payload"])
    v2 = container.unpack(pipe.encode(data["grad"], name=str(data["tensor_name"]), step=int(data["step"])))
    v1_rest = v1.nbytes - len(v1.index_section) - len(v1.value_section) - len(v1.perm_section)
    v2_rest = v2.nbytes - len(v2.index_section) - len(v2.value_section) - len(v2.perm_section)
    assert v2_rest < v1_rest
    if v2.index_id == bloom.BloomIndex.wire_id and not v2.dense:
        fpr = pipe.index.fpr
        lam, _ = bloom._keys_per_block(fpr)
        growth = (bloom.BLOCK_BITS / lam) / (math.log2(1 / fpr) / math.log(2))
        assert len(v2.index_section) <= len(v1.index_section) * growth + bloom.BLOCK_BYTES
        assert v2.nbytes <= v1.nbytes * growth
    else:
        assert len(v2.index_section) == len(v1.index_section) and v2.nbytes < v1.nbytes
