"""GradiVeQ for TensorFlow: the same algorithm as the torch adapter (one definition, deepreduce.summable.gradiveq).

Two "ranks" in one process: each compresses its gradient, the codes are summed (what an
allreduce does) and each decompresses the sum. The TF adapter must give the torch adapter's
results at every step of the schedule (warm-up, sampling, training, compressed steps).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import deepreduce  # noqa: E402
import deepreduce.tensorflow as drtf  # noqa: E402
from deepreduce.summable import gradiveq as gv  # noqa: E402
from deepreduce.torch import GradiVeQ as TorchGradiVeQ  # noqa: E402

SCHEDULE = dict(warmup=1, sample_iters=4, compress_iters=3)
SHAPE = (3, 3, 16, 32)     # a TF conv kernel (H, W, D, F): K = 3 F D = 1536, 3 slices


def gradient(step, rank):
    """Every slice in one 2-D subspace plus noise, so PCA keeps few directions."""
    rng = np.random.default_rng([step, rank])
    basis = np.random.default_rng(7).standard_normal((2, 1536))
    slices = rng.standard_normal((3, 2)) @ basis + 0.01 * rng.standard_normal((3, 1536))
    return slices.reshape(SHAPE).astype(np.float32)


def run_two_ranks(compressors, to_tensor, to_numpy, steps, **compress_kwargs):
    out = []
    for step in range(steps):
        pairs = [c.compress(to_tensor(gradient(step, r)), **compress_kwargs) for r, c in enumerate(compressors)]
        total = pairs[0][0] + pairs[1][0]
        out.append([to_numpy(c.decompress(total, ctx)) for c, (_, ctx) in zip(compressors, pairs)])
    return out


def test_tf_adapter_equals_the_torch_adapter_at_every_step():
    steps = 1 + 4 + 3 + 1    # warm-up, sampling window, compressed steps, then sampling again
    tf_side = [drtf.GradiVeQ(**SCHEDULE), drtf.GradiVeQ(**SCHEDULE)]
    torch_side = [TorchGradiVeQ(layout="tf", **SCHEDULE), TorchGradiVeQ(layout="tf", **SCHEDULE)]
    got = run_two_ranks(tf_side, tf.constant, lambda t: t.numpy(), steps)
    want = run_two_ranks(torch_side, torch.from_numpy, lambda t: t.numpy(), steps, name="w")
    for step, (g, w) in enumerate(zip(got, want)):
        assert g[0].shape == SHAPE and g[0].dtype == np.float32
        np.testing.assert_array_equal(g[0], g[1])   # both ranks see the same aggregate
        # float32 products in another order (numpy vs torch matmul): rounding only
        np.testing.assert_allclose(g[0], w[0], rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
    tf_stats, torch_stats = tf_side[0].compression_stats(), torch_side[0].compression_stats()
    for key in ("compressed", "uncompressed", "dense_elements", "sent_elements", "trainings"):
        assert tf_stats[key] == torch_stats[key], key
    assert tf_stats["compressed"] == 3 and tf_stats["ratio"] > 1
    assert list(tf_stats["dims"].values()) == list(torch_stats["dims"].values())
    # compressed steps reconstruct the aggregate within the trained loss
    total = gradient(6, 0) + gradient(6, 1)
    assert gv.relative_loss(total, got[6][0]) < 0.05


def test_same_shaped_tensors_in_one_traced_step_keep_separate_states():
    gvq = drtf.GradiVeQ(warmup=0, sample_iters=2, compress_iters=2, slice_size=64, min_numel=64)

    @tf.function
    def reduce_both(x, y):
        cx, kx = gvq.compress(x)
        cy, ky = gvq.compress(y)
        return gvq.decompress(cx, kx), gvq.decompress(cy, ky)

    rng = np.random.default_rng(0)
    for step in range(3):
        x, y = (rng.standard_normal((8, 64)).astype(np.float32) for _ in range(2))
        rx, ry = reduce_both(tf.constant(x), tf.constant(y))
    stats = gvq.compression_stats()
    assert stats["trainings"] == 2 and len(stats["dims"]) == 2     # one model per tensor
    assert stats["compressed"] == 2 and stats["uncompressed"] == 4
    # the third step sent codes: the reconstruction is the core's decompress of the core's code
    for key, array, result in zip(sorted(gvq._states), (x, y), (rx, ry)):
        model = gvq.model(key)
        expected = gv.from_slices(*gv.decompress(model, gv.compress(model, *gv.to_slices(array, model.plan))),
                                  model.plan)
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_integer_and_small_tensors_pass_through():
    gvq = drtf.GradiVeQ()
    ints = tf.constant([1, 2, 3])
    code, ctx = gvq.compress(ints)
    assert code is ints and gvq.decompress(code, ctx) is code
    small = tf.constant(np.ones((4, 4), np.float32))
    code, ctx = gvq.compress(small)
    np.testing.assert_array_equal(gvq.decompress(code, ctx).numpy(), small.numpy())
    assert gvq.compression_stats()["uncompressed"] == 1


def test_bad_arguments_raise_config_errors():
    with pytest.raises(deepreduce.ConfigError, match="loss"):
        drtf.GradiVeQ(loss=2.0)
    with pytest.raises(deepreduce.ConfigError, match="layout"):
        drtf.GradiVeQ(layout="nchw")
    with pytest.raises(deepreduce.ConfigError, match="sample_iters"):
        drtf.GradiVeQ(sample_iters=1)
