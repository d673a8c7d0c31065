"""What a rank needs to add its own container into an all-gathered sum without decoding it.

Every rank decodes every rank's container, its own included. The sender already knows what its
container decodes to: the positions it sent and the values the receiver reconstructs there (the
value codec's by-product, which error feedback uses too, and which is bit-identical to what
``decode`` yields: tests/test_own_containers.py checks every shipped config). So ``decode_sum``
recognises this rank's container among the gathered ones by its bytes and scatter-adds the kept
``(positions, values)`` instead of parsing and decoding it again (for a Bloom filter, a query of
every position of the tensor).

Only the last container of each tensor name is kept (sparse ones: ``n`` positions and values,
plus a copy of the compact container bytes the match is checked against).
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np


class OwnContainer(NamedTuple):
    payload: bytes               # a private copy of the container's bytes
    shape: Tuple[int, ...]
    positions: np.ndarray        # int64, where the receiver adds ...
    values: np.ndarray           # ... these float32 values
    ascending: bool              # positions promised strictly ascending (as by a set codec's decode)


class OwnContainers:
    """The last sparse container this pipeline encoded for each tensor name, found by its bytes."""

    def __init__(self) -> None:
        self._by_key: Dict[Tuple[int, int], OwnContainer] = {}
        self._key_of_name: Dict[str, Tuple[int, int]] = {}

    @staticmethod
    def _key(payload: np.ndarray) -> Tuple[int, int]:
        # the container's own CRC (its last 4 bytes) and its length: no pass over the bytes
        return int(payload.shape[0]), int.from_bytes(payload[-4:].tobytes(), "little")

    def remember(self, name: str, payload: np.ndarray, shape, positions, values, ascending: bool) -> None:
        """Keep ``name``'s container (replacing its last one). ``ascending``: the index codec
        promises strictly ascending positions, as ``decode`` would rely on for its container
        (otherwise the scatter checks them, see ``deepreduce.backend.kernels.scatter_add``)."""
        old = self._key_of_name.pop(name, None)
        if old is not None:
            self._by_key.pop(old, None)
        positions = np.asarray(positions, dtype=np.int64)
        key = self._key(payload)
        self._by_key[key] = OwnContainer(payload.tobytes(), tuple(shape), positions,
                                         np.asarray(values, dtype=np.float32), ascending)
        self._key_of_name[name] = key

    def match(self, payload) -> Optional[OwnContainer]:
        """The kept container whose bytes equal ``payload`` (a 1-D uint8 NumPy array), or None."""
        if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1 \
                or payload.shape[0] < 4:
            return None
        own = self._by_key.get(self._key(payload))
        if own is None or payload.tobytes() != own.payload:   # one memcmp
            return None
        return own

    def clear(self) -> None:
        self._by_key.clear()
        self._key_of_name.clear()
