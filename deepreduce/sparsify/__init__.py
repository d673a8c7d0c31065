"""Sparsifiers: which gradient entries travel. One module per algorithm; each registers itself."""
from ._base import Sparsifier, count_for

__all__ = ["Sparsifier", "count_for"]
