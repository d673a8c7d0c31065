"""The embedded default dataset: scikit-learn's handwritten digits, upscaled to 32x32.

The 1,797 8x8 images ship inside scikit-learn, so the main job needs no download. Each pixel
becomes a 4x4 block (nearest neighbour) to give the 32x32 input ResNet-20 was designed for, the
grey channel is repeated three times so the layer shapes match the paper's CIFAR-10 ResNet-20
(e.g. the 64x64x3x3 = 36,864-element convolutions), and pixels are standardised.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

TEST_FRACTION = 1 / 6


def load_digits_32(split_seed: int = 0) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: float32 NCHW images (N, 3, 32, 32), int64 labels.

    The split is a seeded permutation, identical on every rank and every run.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0                  # (N, 8, 8) in [0, 1]
    images = np.kron(images, np.ones((1, 4, 4), dtype=np.float32))    # (N, 32, 32)
    images = (images - images.mean()) / images.std()
    images = np.repeat(images[:, None, :, :], 3, axis=1)              # (N, 3, 32, 32)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(split_seed).permutation(len(labels))
    n_test = int(round(len(labels) * TEST_FRACTION))
    test, train = order[:n_test], order[n_test:]
    return images[train], labels[train], images[test], labels[test]


def shard(n: int, rank: int, size: int, epoch: int, seed: int = 0) -> np.ndarray:
    """This rank's sample indices for one epoch: a seeded shuffle split evenly across ranks.

    Every rank draws the same permutation and takes a disjoint, equal-length slice, so all
    ranks run the same number of steps (a rank with fewer steps would stall the collectives).
    """
    order = np.random.default_rng([seed, epoch]).permutation(n)
    per_rank = n // size
    return order[rank * per_rank:(rank + 1) * per_rank]
