"""GradiVeQ math and compressor: slicing, PCA, summability, schedule (single process)."""
import numpy as np
import pytest
import torch

from deepreduce.errors import ConfigError
from deepreduce.summable import gradiveq as gv
from deepreduce.torch.gradiveq import GradiVeQ


class Source:
    """Gradients whose (H, W, D, F)-order slices live near one low-dimensional subspace."""

    def __init__(self, rng, shape, rank=4, noise=1e-3):
        self.rng, self.rank, self.noise = rng, rank, noise
        self.plan = gv.slice_plan(shape, "torch", min_numel=0)
        self.basis = rng.normal(size=(rank, self.plan.slice_size))
        self.mean = rng.normal(size=(self.plan.n_slices, self.plan.slice_size)) * 0.1

    def draw(self, n):
        p, out = self.plan, []
        for _ in range(n):
            slices = self.mean + self.rng.normal(size=(p.n_slices, self.rank)) @ self.basis \
                + self.noise * self.rng.normal(size=(p.n_slices, p.slice_size))
            out.append(gv.from_slices(slices, np.zeros(0), p).astype(np.float32))
        return out


def correlated_gradients(rng, n, shape):
    return Source(rng, shape).draw(n)


def test_slice_plan_rules():
    p = gv.slice_plan((16, 16, 3, 3), "torch")          # 3 F D = 768 divides 2304
    assert (p.slice_size, p.n_slices) == (768, 3)
    p = gv.slice_plan((3, 3, 16, 16), "tf")
    assert (p.slice_size, p.n_slices) == (768, 3)
    p = gv.slice_plan((8, 4, 5, 5), "torch", min_numel=0)  # 96 does not divide 800; F D = 32 does
    assert (p.slice_size, p.n_slices) == (32, 25)
    p = gv.slice_plan((64, 64, 3, 3), "torch")           # F D = 4096 is the cap
    assert p.slice_size == 4096
    p = gv.slice_plan((128, 64, 3, 3), "torch")          # 128 * j <= 4096 with j | 64: j = 32
    assert p.slice_size == 4096 and p.n_slices == 18
    assert gv.slice_plan((100,), "torch") is None       # small / not a conv kernel
    assert gv.slice_plan((512, 2048), "torch") is None
    p = gv.slice_plan((1000, 3), "torch", slice_size=64)
    assert (p.n_slices, p.numel - p.sliced) == (46, 56)
    assert [g for g in gv.slice_plan((16, 16, 3, 3), "torch", reuse=2).groups] == [(0, 2), (2, 1)]
    with pytest.raises(ConfigError):
        gv.slice_plan((4,), "nchw")


@pytest.mark.parametrize("shape,layout,kw", [((16, 8, 3, 3), "torch", {}), ((3, 3, 8, 16), "tf", {}),
                                             ((1000, 3), "torch", {"slice_size": 64})])
def test_slicing_round_trip_and_order(shape, layout, kw):
    plan = gv.slice_plan(shape, layout, min_numel=0, **kw)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    slices, tail = gv.to_slices(x, plan)
    np.testing.assert_array_equal(gv.from_slices(slices, tail, plan), x)
    if len(shape) == 4 and layout == "torch":
        # the F filters' entries at one (h, w, depth) position are adjacent
        np.testing.assert_array_equal(slices.reshape(-1)[:shape[0]], x[:, 0, 0, 0])


def test_compressed_dim_rule():
    eig = np.array([50.0, 30.0, 15.0, 4.0, 1.0])
    assert gv.compressed_dim(eig, 0.01) == 5
    assert gv.compressed_dim(eig, 0.05) == 4   # 99% kept > 95%
    assert gv.compressed_dim(eig, 0.2) == 3    # eq. (6) is strict: 80% is not > 80%
    assert gv.compressed_dim(eig, 0.25) == 2
    assert gv.compressed_dim(np.zeros(3), 0.01) == 1


def test_pca_loss_summability_and_determinism():
    rng = np.random.default_rng(0)
    shape = (16, 8, 3, 3)
    plan = gv.slice_plan(shape, "torch", min_numel=0)
    source = Source(rng, shape)
    history = source.draw(40)
    slices = [gv.to_slices(g, plan)[0] for g in history]
    samples = [np.stack([s[0] for s in slices])]
    mean = np.mean(slices, axis=0)
    model = gv.train(plan, samples, mean, 0.01)
    again = gv.train(plan, [samples[0].copy()], mean.copy(), 0.01)
    np.testing.assert_array_equal(model.groups[0].u, again.groups[0].u)
    assert 4 <= model.dims[0] <= 6 and model.code_size < plan.numel / 10

    ranks = source.draw(4)
    codes = [gv.compress(model, *gv.to_slices(g, plan)) for g in ranks]
    # compression commutes with aggregation
    summed = sum(g.astype(np.float64) for g in ranks).astype(np.float32)
    np.testing.assert_allclose(gv.compress(model, *gv.to_slices(summed, plan)), np.sum(codes, axis=0), atol=1e-4)
    # decompressing the summed codes equals the sum of the ranks' decompressions
    whole = gv.decompress(model, np.sum(codes, axis=0))[0]
    shares = sum(gv.decompress(model, c, parts=4)[0].astype(np.float64) for c in codes)
    np.testing.assert_allclose(whole, shares, atol=1e-4)
    # and averaging works the same way (an affine map commutes with a mean)
    mean_code = np.mean(codes, axis=0)
    np.testing.assert_allclose(gv.decompress(model, mean_code)[0],
                               np.mean([gv.decompress(model, c)[0] for c in codes], axis=0), atol=1e-5)
    # the reconstruction of a new gradient from the same distribution is accurate
    g = source.draw(1)[0]
    rec = gv.from_slices(*gv.decompress(model, gv.compress(model, *gv.to_slices(g, plan))), plan)
    assert gv.relative_loss(g, rec) < 0.01


def test_schedule():
    s = gv.Schedule(warmup=3, sample_iters=2, compress_iters=4)
    assert [s.phase(t) for t in range(12)] == ["warmup"] * 3 + ["sample"] * 2 + ["compress"] * 4 + ["sample"] * 2 + ["compress"]
    assert [t for t in range(12) if s.last_sample(t)] == [4, 10]
    with pytest.raises(ConfigError):
        gv.Schedule(sample_iters=1)


def simulate(comp, grads_per_rank, name=None):
    """One step of an N-rank average-allreduce: every rank's compressor sees the same output."""
    outs = []
    sent = [comp[r].compress(torch.from_numpy(g), name=name) for r, g in enumerate(grads_per_rank)]
    reduced = torch.stack([t for t, _ in sent]).mean(0)
    for r, (_, ctx) in enumerate(sent):
        outs.append(comp[r].decompress(reduced.clone(), ctx))
    return outs, sent


@pytest.mark.parametrize("named", [True, False])
def test_compressor_schedule_identical_models_and_accuracy(named):
    rng = np.random.default_rng(1)
    shape, n = (16, 8, 3, 3), 2
    comps = [GradiVeQ(warmup=2, sample_iters=20, compress_iters=5, min_numel=0) for _ in range(n)]
    history = correlated_gradients(rng, 2 + 20 + 5, shape)
    bias = np.ones(16, np.float32)
    for t, g in enumerate(history):
        per_rank = [g + np.float32(1e-3) * rng.normal(size=shape).astype(np.float32) for _ in range(n)]
        outs, sent = simulate(comps, per_rank, name="conv" if named else None)
        small, _ = simulate(comps, [bias, bias], name="bias" if named else None)
        exact = np.mean(per_rank, axis=0)
        if t < 22:
            assert sent[0][0].shape == shape
            np.testing.assert_array_equal(outs[0].numpy(), exact)
        else:
            assert sent[0][0].numel() < np.prod(shape) / 10
            assert gv.relative_loss(exact, outs[0].numpy()) < 0.01
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        np.testing.assert_array_equal(small[0].numpy(), bias)
    key = "conv" if named else (shape, torch.float32, 0)
    np.testing.assert_array_equal(comps[0].model(key).groups[0].u, comps[1].model(key).groups[0].u)
    stats = comps[0].compression_stats()
    assert stats["compressed"] == 5 and stats["trainings"] == 1 and stats["ratio"] > 1


def test_compressor_decompress_of_summed_codes_equals_sum_of_decompressions():
    rng = np.random.default_rng(2)
    shape = (16, 8, 3, 3)
    comp = GradiVeQ(warmup=0, sample_iters=10, compress_iters=3, min_numel=0)
    source = Source(rng, shape)
    for g in source.draw(10):
        t, ctx = comp.compress(torch.from_numpy(g), name="w")
        comp.decompress(t, ctx)
    grads = source.draw(3)
    sent = [comp.compress(torch.from_numpy(g), name="w") for g in grads]
    assert all(c.mode == "pca" for _, c in sent)
    whole = comp.decompress(sum(t for t, _ in sent), sent[0][1])
    shares = sum(comp.decompress(t, c, parts=3) for t, c in sent)
    torch.testing.assert_close(whole, shares, atol=1e-4, rtol=1e-5)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="loss"):
        GradiVeQ(loss=1.5)
    with pytest.raises(ConfigError, match="reuse"):
        GradiVeQ(reuse=-1)
    with pytest.raises(ConfigError, match="layout"):
        GradiVeQ(layout="nhwc")
