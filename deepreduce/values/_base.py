"""The value codec contract: compress the transmitted float32 values."""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from ..params import Component
from ..seeding import EncodeContext


class ValueEncoding(NamedTuple):
    """What a value codec produced.

    ``order`` is None when decode returns the values in input order. Otherwise decoded value
    ``j`` belongs to input position ``order[j]`` (curve fits emit values sorted).
    """

    params: bytes
    payload: bytes
    order: Optional[np.ndarray] = None


class ValueCodec(Component):
    """Encodes a 1-D float32 array; decode returns float32 of the same length."""

    kind = "value"
    wire_id: int = -1
    keeps_order = True
    backend = "numpy"
    #: Set by the pipeline: True when its index codec keeps the value order, so a reordering
    #: (``ValueEncoding.order``) only permutes the indices and costs no permutation section.
    reorder_is_free = False

    def encode(self, values: np.ndarray, ctx: EncodeContext) -> ValueEncoding:
        raise NotImplementedError

    def decode(self, params: bytes, payload: bytes, count: int) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def describe_params(cls, params: bytes) -> dict:
        """The wire parameters as a dict, for ``deepreduce.inspect``."""
        return {"bytes": params.hex()} if params else {}
