"""Configs without a sparsifier warn once per pipeline and tensor name when fed a dense gradient."""
import warnings

import numpy as np
import pytest

import deepreduce
from deepreduce.sparsify import DENSE_WARNING_DENSITY, DenseGradientWarning

SPARSE_CONFIGS = ["configs/skcompress.yaml", "configs/bfp2_polyfit.yaml"]


def _gradient(density: float, size: int = 4000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(size).astype(np.float32)
    g[rng.permutation(size)[: int(round((1.0 - density) * size))]] = 0.0
    return g


@pytest.mark.parametrize("config", SPARSE_CONFIGS)
def test_dense_gradient_warns_once_per_name_with_density(config):
    pipe = deepreduce.build(config)
    dense = _gradient(0.75)
    with pytest.warns(DenseGradientWarning) as caught:
        pipe.encode(dense, name="fc.weight", step=0)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'fc.weight'" in message and "3000 of 4000" in message and "75.0%" in message
    assert issubclass(DenseGradientWarning, RuntimeWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the same name again: silent
        pipe.encode(dense, name="fc.weight", step=1)
    with pytest.warns(DenseGradientWarning, match="'fc.bias'"):
        pipe.encode(dense, name="fc.bias", step=1)
    with pytest.warns(DenseGradientWarning, match="'fc.weight'"):   # another pipeline warns again
        deepreduce.build(config).encode(dense, name="fc.weight", step=0)


def test_sparse_gradient_and_threshold_do_not_warn():
    pipe = deepreduce.build("configs/skcompress.yaml")
    exactly_at = _gradient(DENSE_WARNING_DENSITY)
    assert np.count_nonzero(exactly_at) == DENSE_WARNING_DENSITY * exactly_at.size
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.encode(_gradient(0.4), name="emb", step=0)
        pipe.encode(exactly_at, name="emb2", step=0)
        pipe.encode(np.zeros(4000, np.float32), name="zeros", step=0)


def test_torch_binding_warns_too():
    import torch

    pipe = deepreduce.build("configs/skcompress.yaml")
    flat = torch.from_numpy(_gradient(0.9))
    with pytest.warns(DenseGradientWarning, match="90.0%"):
        pipe.sparsifier.select(flat, pipe.context("emb", 0))
