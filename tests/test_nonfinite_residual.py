"""Nothing non-finite enters or leaves unflagged through error feedback: a checkpoint's residual
must be finite, and a finite gradient whose residual-compensated values overflow float32 travels
dense and flagged (or is refused under ``nonfinite: raise``), so the sender's own container is
what every peer decodes."""
import numpy as np
import pytest

import deepreduce
from deepreduce.errors import ConfigError, NonFiniteGradientError

BIG = np.float32(3e38)


def pipeline(nonfinite="propagate", min_numel=0):
    return deepreduce.build({"sparsifier": {"id": "topk", "ratio": 0.1}, "index": "raw", "value": "raw",
                             "memory": "residual", "min_numel": min_numel, "nonfinite": nonfinite})


def test_a_checkpoint_residual_must_be_finite():
    pipe = pipeline()
    for bad in (np.nan, np.inf, 1e39):
        residual = np.zeros(100, np.float64)
        residual[7] = bad
        with pytest.raises(ConfigError, match="residual 'w' holds NaN/Inf"):
            pipe.memory.load_state_dict({"residuals": {"w": residual}})


@pytest.mark.parametrize("min_numel", [0, 1000])   # the sparse path, and a tensor sent dense
def test_an_overflowing_compensation_travels_flagged_and_the_sender_decodes_what_peers_do(min_numel):
    sender, peer = pipeline(min_numel=min_numel), pipeline(min_numel=min_numel)
    residual = np.zeros(100, np.float32)
    residual[:20] = BIG
    sender.memory.load_state_dict({"residuals": {"w": residual}})
    grad = np.full(100, 1e-3, np.float32)
    grad[:20] = BIG                                   # finite, but residual + gradient is +inf
    payload = sender.encode(grad, name="w", step=0)
    info = deepreduce.inspect(payload)
    assert info["nonfinite"] and info["dense"]
    mine = sender.decode_sum([payload], expected_shape=(100,))
    theirs = peer.decode_sum([payload], expected_shape=(100,))
    np.testing.assert_array_equal(mine, theirs)
    assert np.isinf(mine[:20]).all()
    assert not sender.memory.residual("w").any()     # the residual starts again from zero
    follow = sender.encode(np.full(100, 1e-3, np.float32), name="w", step=1)
    assert not deepreduce.inspect(follow)["nonfinite"]


def test_an_overflowing_compensation_is_refused_under_raise():
    pipe = pipeline(nonfinite="raise")
    residual = np.zeros(100, np.float32)
    residual[3] = BIG
    pipe.memory.load_state_dict({"residuals": {"w": residual}})
    grad = np.zeros(100, np.float32)
    grad[3] = BIG
    with pytest.raises(NonFiniteGradientError, match="overflows float32"):
        pipe.encode(grad, name="w", step=4)
