"""Sparsifiers: which gradient entries travel. One module per algorithm; each registers itself."""
from ._base import Sparsifier, count_for
from .basic import DENSE_WARNING_DENSITY, DenseGradientWarning

__all__ = ["DENSE_WARNING_DENSITY", "DenseGradientWarning", "Sparsifier", "count_for"]
