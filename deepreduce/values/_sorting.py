"""The signed descending sort shared by the curve-fit value codecs (Fit-Poly, Fit-DExp).

The order is defined on float32 bit patterns so that every implementation agrees exactly:
values sort descending by signed value, ties keep input order (a stable sort), and +0.0 sorts
before -0.0. ``csrc/fit/fit.cpp`` (``dr_sort_desc``) computes the same permutation with a radix
sort.
"""
from __future__ import annotations

import numpy as np


def descending_key(values: np.ndarray) -> np.ndarray:
    """uint32 keys whose ascending order is the descending signed order of ``values``."""
    bits = np.ascontiguousarray(values, dtype="<f4").view(np.uint32)
    ascending = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))
    return ~ascending


def sort_descending(values: np.ndarray) -> np.ndarray:
    """Stable int64 permutation ``perm`` with ``values[perm]`` descending."""
    return np.argsort(descending_key(values), kind="stable").astype(np.int64, copy=False)
