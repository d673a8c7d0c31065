"""The DCT-II helpers of DeMo's recipe: orthonormal, inverted, the same on NumPy and torch."""
import numpy as np
import pytest

from deepreduce.errors import ConfigError
from deepreduce.sparsify.chunked import chunk_topk_positions, to_blocks
from deepreduce.sparsify.dct import block_dct, block_idct, chunk_dct, chunk_idct, dct_matrix


def test_matrix_is_orthonormal_dct_ii():
    d = dct_matrix(8)
    np.testing.assert_allclose(d @ d.T, np.eye(8), atol=1e-12)
    x = np.arange(8.0)
    expected = [np.sqrt((1 if k == 0 else 2) / 8) * sum(x[i] * np.cos(np.pi * (2 * i + 1) * k / 16) for i in range(8))
                for k in range(8)]
    np.testing.assert_allclose(d @ x, expected, atol=1e-12)


def test_block_and_chunk_transforms_invert_and_keep_energy():
    rng = np.random.default_rng(0)
    flat = rng.standard_normal(64 * 64 * 3).astype(np.float32)
    for forward, inverse, arg in ((block_dct, block_idct, 64), (chunk_dct, chunk_idct, 64), (chunk_dct, chunk_idct, 100)):
        y = forward(flat, arg)
        assert y.dtype == np.float32 and y.shape == flat.shape
        np.testing.assert_allclose(np.linalg.norm(y), np.linalg.norm(flat), rtol=1e-5)
        np.testing.assert_allclose(inverse(y, arg), flat, atol=1e-5)
    ones = np.ones(64 * 64, np.float32)
    np.testing.assert_allclose(block_dct(ones)[0], 64.0, rtol=1e-6)        # all energy in the DC coefficient
    np.testing.assert_allclose(block_dct(ones)[1:], 0.0, atol=1e-4)
    with pytest.raises(ConfigError, match="blocks"):
        block_dct(np.ones(100, np.float32))
    with pytest.raises(ConfigError, match="chunk"):
        chunk_dct(np.ones(100, np.float32), 0)


def test_torch_matches_numpy():
    import torch
    flat = np.random.default_rng(1).standard_normal(64 * 64 * 2 + 50).astype(np.float32)
    for forward, inverse, arg, x in ((block_dct, block_idct, 64, flat[:8192]), (chunk_dct, chunk_idct, 64, flat)):
        y = forward(torch.from_numpy(x.copy()), arg)
        assert isinstance(y, torch.Tensor)
        np.testing.assert_allclose(y.numpy(), forward(x, arg), atol=1e-5)
        np.testing.assert_allclose(inverse(y, arg).numpy(), x, atol=1e-5)


def test_dct_concentrates_a_smooth_block():
    """A smooth block (what the DCT is for): Top-32 of 4,096 keeps almost everything after it."""
    i, j = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
    smooth = np.sin(i / 20.0) + np.cos(j / 15.0) + 0.01 * np.random.default_rng(2).standard_normal((64, 64))
    flat = to_blocks(smooth.astype(np.float32), 64)
    for x, low, high in ((flat, 0.0, 0.1), (block_dct(flat), 0.99, 1.0)):
        kept = x[chunk_topk_positions(x, 4096, 32)]
        assert low <= float(np.sum(kept ** 2) / np.sum(x ** 2)) <= high
