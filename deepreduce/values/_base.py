"""The value codec contract: compress the transmitted float32 values."""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from ..params import Component
from ..wire.seeding import EncodeContext


class ValueEncoding(NamedTuple):
    """What a value codec produced.

    ``order`` is None when decode returns the values in input order. Otherwise decoded value
    ``j`` belongs to input position ``order[j]`` (curve fits emit values sorted).

    ``reconstructed`` is what the receiver will decode for each input value, in input order
    (float32): the by-product of encoding that error feedback subtracts from its residual.
    Lossless codecs return their input; a lossy codec computes it from its own ``n`` values.
    None means "not computed": :meth:`ValueCodec.reconstruct` then decodes the payload.
    """

    params: bytes
    payload: bytes
    order: Optional[np.ndarray] = None
    reconstructed: Optional[np.ndarray] = None


def in_input_order(decoded: np.ndarray, order: Optional[np.ndarray]) -> np.ndarray:
    """Decoded values (in wire order) rearranged to the encoder's input order."""
    if order is None:
        return decoded
    out = np.empty(decoded.size, dtype=np.float32)
    out[order] = decoded
    return out


class ValueCodec(Component):
    """Encodes a 1-D float32 array; decode returns float32 of the same length."""

    kind = "value"
    threads = 1  # C++ kernel threads; the pipeline sets its resolved ``threads`` option
    wire_id: int = -1
    keeps_order = True
    backend = "numpy"
    #: Written against the array namespace (``deepreduce.backend.arrays``): torch tensors are encoded
    #: and decoded on their own device. Others run on the host for device tensors (a one-time
    #: warning names them).
    array_api = False
    #: Set by the pipeline: True when its index codec keeps the value order, so a reordering
    #: (``ValueEncoding.order``) only permutes the indices and costs no permutation section.
    reorder_is_free = False

    def encode(self, values: np.ndarray, ctx: EncodeContext) -> ValueEncoding:
        raise NotImplementedError

    def decode(self, params: bytes, payload: bytes, count: int) -> np.ndarray:
        raise NotImplementedError

    def reconstruct(self, encoding: ValueEncoding, count: int) -> np.ndarray:
        """The receiver's ``count`` values in input order, without decoding any dense tensor."""
        if encoding.reconstructed is not None:
            return encoding.reconstructed
        return in_input_order(self.decode(encoding.params, encoding.payload, count), encoding.order)

    @classmethod
    def describe_params(cls, params: bytes) -> dict:
        """The wire parameters as a dict, for ``deepreduce.inspect``."""
        return {"bytes": params.hex()} if params else {}
