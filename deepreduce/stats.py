"""Counters of what compression did: bytes before and after, encode and decode time."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CompressionStats:
    """Running totals over every tensor a pipeline encoded or decoded."""

    tensors_encoded: int = 0
    tensors_decoded: int = 0
    dense_bytes: int = 0
    wire_bytes: int = 0
    index_bytes: int = 0
    value_bytes: int = 0
    permutation_bytes: int = 0
    header_bytes: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def relative_volume(self) -> float:
        """Bytes sent over dense float32 bytes (the papers' "relative data volume")."""
        return self.wire_bytes / self.dense_bytes if self.dense_bytes else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out["relative_volume"] = self.relative_volume
        return out

    def reset(self) -> None:
        for key, value in asdict(CompressionStats()).items():
            setattr(self, key, value)
