"""Ranks agree before they communicate, and skip a non-finite step together.

Every distributed integration (the Horovod optimizers and tape, the DDP hook) uses this module
for two decisions that all ranks must take alike, so that a mistake is the same error on every
rank within seconds instead of a collective that waits forever.

**Agreement.** Before the first per-tensor collective, and again when the set of tensors
changes, every rank describes what it is about to send (:class:`Layout`): each tensor's name,
shape and dtype in order, and its compressor (a deepreduce config, identified by the 8-byte
config digest that every v2 container carries, or a summable compressor such as GradiVeQ,
identified by its class and settings). Round one is a single allgather of one fixed-size
record per rank, the layout's 8-byte digest, so it completes whatever the ranks disagree about
(even the number of tensors). If the digests differ, every rank has seen it, so every rank
enters round two, an allgather of the descriptions themselves, and raises the same
:class:`~deepreduce.CommunicationError` naming the first difference ("rank 1 has parameter
'fc2.weight' (10, 64) float32 that rank 0 lacks").

**Non-finite steps.** Under ``nonfinite: raise`` a rank whose gradient holds NaN/Inf does not
raise on its own (the others would then wait for its container): it sends the flagged dense
container the ``propagate`` policy sends, every rank reads the flags of every rank's container
(:func:`first_nonfinite`, one byte per container), and after every collective of the step has
completed, every rank raises the same :class:`~deepreduce.NonFiniteGradientError`
(:func:`nonfinite_error`); the integration applies nothing and undoes the step's changes to the
residuals (:meth:`deepreduce.Pipeline.undo_step`).

Records and descriptions travel as dense containers, so any communicator that gathers
containers gathers them (Horovod splits an allgather by container headers).
"""
from __future__ import annotations

import hashlib
import json
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..backend import arrays
from ..errors import CommunicationError, NonFiniteGradientError
from ..wire import container

Allgather = Callable[[np.ndarray], List[np.ndarray]]
"""Gathers one uint8 container from every rank; returns them in rank order (a communicator's allgather)."""

_FLAGS_BYTE = 5          # magic (4 bytes) + version (1): the flags byte of both container versions


def _digest64(data: bytes) -> int:
    """An 8-byte BLAKE2b digest as a signed int64 (it travels in int64 tensors)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def compressor_identity(compression) -> Tuple[str, str]:
    """(label, 16 hex digits) naming a compressor, equal on ranks that compress alike.

    A deepreduce pipeline (core, torch or TF; or anything with ``.core``) is identified by the
    first 8 bytes of its config digest, the digest its v2 containers carry; a summable compressor
    (GradiVeQ, Horovod's ``Compression.fp16``, ...) by its class and ``get_config()``; None
    (Horovod's uncompressed allreduce) by ``"none"``.
    """
    from ..pipeline import Pipeline

    core = getattr(compression, "core", compression)
    if isinstance(core, Pipeline):
        config = core.get_config()
        parts = ", ".join(f"{kind} {config[kind]['id']}" for kind in ("sparsifier", "index", "value", "memory"))
        label = f"deepreduce config ({parts}, nonfinite {config['nonfinite']})"
        digest = core.config_digest[:container.DIGEST_SIZE]
        if "aggregation" in config:   # not in the wire digest, but the ranks must agree on it
            label += f" aggregated by {config['aggregation']['id']}"
            digest = hashlib.blake2b(digest + repr(config["aggregation"]).encode(), digest_size=8).digest()
        return label, digest.hex()
    if compression is None:
        return "no compression", "0" * 16
    kind = compression if isinstance(compression, type) else type(compression)
    custom_repr = not isinstance(compression, type) and type(compression).__repr__ is not object.__repr__
    label = repr(compression) if custom_repr else kind.__qualname__
    config = getattr(compression, "get_config", lambda: {})()
    digest = _digest64(f"{kind.__qualname__}:{config!r}".encode())
    return label, (digest & (2 ** 64 - 1)).to_bytes(8, "little").hex()


class Layout:
    """What one rank is about to send: a compressor and named tensors in order.

    ``tensors``: (name, shape, dtype name) triples; ``noun`` names them in messages
    ("parameter", "gradient"). ``digest`` (a signed int64) is equal on ranks whose layouts are.
    """

    def __init__(self, compressor: Tuple[str, str], tensors: Sequence[Tuple[str, Sequence, str]],
                 noun: str = "tensor") -> None:
        self.noun = noun
        self.compressor = (str(compressor[0]), str(compressor[1]))
        self.tensors = [(str(n), [None if s is None else int(s) for s in shape], str(d)) for n, shape, d in tensors]
        self.description = json.dumps({"compressor": self.compressor, "tensors": self.tensors},
                                      separators=(",", ":")).encode("utf-8")
        self.digest = _digest64(self.description)
        self.compressor_digest = _digest64("\0".join(self.compressor).encode("utf-8"))


def layout_of(compression, tensors: Sequence[Tuple[str, Sequence, str]], buckets: Sequence[Tuple[str, int]] = (),
              noun: str = "tensor") -> Layout:
    """The :class:`Layout` a binding agrees on: ``compression`` (:func:`compressor_identity`), its
    ``tensors`` and then its gradient ``buckets`` ((label, elements) pairs, each entered as a
    tensor ``<label>`` of one dimension and dtype ``bucket``), so ranks that plan different buckets
    fail together like ranks with different tensors."""
    entries = list(tensors) + [(f"<{label}>", (int(numel),), "bucket") for label, numel in buckets]
    return Layout(compressor_identity(compression), entries, noun)


def wrap_bytes(data: bytes) -> np.ndarray:
    """Bytes as a dense container (padded to whole float32 entries), so communicators carry them."""
    data = data + b"\0" * (-len(data) % 4)
    return container.pack(container.Container(shape=(len(data) // 4,), n=len(data) // 4, index_id=0, value_id=0,
                                              flags=container.FLAG_DENSE, value_section=data))


def unwrap_bytes(payload) -> bytes:
    return bytes(container.unpack(payload).value_section).rstrip(b"\0")


def agree(layout: Layout, allgather: Allgather, where: str) -> None:
    """Round one (the digests), and round two where they differ; see the module docstring.

    Raises CommunicationError, the same on every rank, when any rank's layout differs.
    """
    record = np.array([layout.digest], dtype="<i8").tobytes()
    digests = [unwrap_bytes(part) for part in allgather(wrap_bytes(record))]
    if any(d != digests[0] for d in digests):
        raise CommunicationError(f"{where}: {explain(layout, allgather)}; every rank must train the same "
                                 "model with the same compression")


def explain(layout: Layout, allgather: Allgather) -> str:
    """Round two: gather every rank's description and name the first difference.

    Every rank must call it (every rank that saw differing digests does).
    """
    described = []
    for rank, part in enumerate(allgather(wrap_bytes(layout.description))):
        try:
            entry = json.loads(unwrap_bytes(part).decode("utf-8"))
            entry = {"compressor": [str(v) for v in entry["compressor"]],
                     "tensors": [(str(n), list(s), str(d)) for n, s, d in entry["tensors"]]}
        except (ValueError, KeyError, TypeError) as exc:
            return f"rank {rank} sent an unreadable description of its {layout.noun}s ({exc})"
        described.append(entry)
    return first_difference(described, layout.noun)


def _shape(shape) -> str:
    return str(tuple(shape))


def first_difference(described: Sequence[dict], noun: str = "tensor") -> str:
    """The first way in which a rank's description differs from rank 0's (the lowest such rank).

    ``described``: per rank, ``{"compressor": (label, digest), "tensors": [(name, shape, dtype)]}``.
    """
    base = described[0]
    for rank, other in enumerate(described[1:], start=1):
        if other["compressor"] != base["compressor"]:
            (label0, digest0), (label, digest) = base["compressor"], other["compressor"]
            return f"rank 0 uses {label0} (digest {digest0}), rank {rank} uses {label} (digest {digest})"
        mine, theirs = _entries(base), _entries(other)
        if mine == theirs:
            continue
        counts = f" (rank 0 has {len(mine)} {noun}s, rank {rank} has {len(theirs)})"
        names0, names = {t[0] for t in mine}, {t[0] for t in theirs}
        for position in range(max(len(mine), len(theirs))):
            a = mine[position] if position < len(mine) else None
            b = theirs[position] if position < len(theirs) else None
            if a == b:
                continue
            if b is not None and b[0] not in names0:
                return f"rank {rank} has {noun} {b[0]!r} {_shape(b[1])} {b[2]} that rank 0 lacks{counts}"
            if a is not None and a[0] not in names:
                return f"rank 0 has {noun} {a[0]!r} {_shape(a[1])} {a[2]} that rank {rank} lacks{counts}"
            if a[0] == b[0]:
                return (f"{noun} {a[0]!r} is {_shape(a[1])} {a[2]} on rank 0 and {_shape(b[1])} {b[2]} "
                        f"on rank {rank}")
            return (f"the {noun}s are in another order: position {position} holds {a[0]!r} on rank 0 and "
                    f"{b[0]!r} on rank {rank}")
    return "the ranks' descriptions differ in a way that does not survive their encoding"


def _entries(described: dict) -> List[tuple]:
    return [(name, tuple(shape), dtype) for name, shape, dtype in described["tensors"]]


# ---------------------------------------------------------------------- non-finite steps
def first_nonfinite(payloads: Sequence) -> Optional[Tuple[int, int, int]]:
    """(rank, NaN count, Inf count) of the first rank whose container carries the non-finite
    flag, or None. Reads one header byte per container, all of them in one host transfer when
    they are torch tensors (the DDP hook's gathered slots: one device synchronisation, not one
    per container); only a flagged container is copied and parsed."""
    ranks = [rank for rank, payload in enumerate(payloads) if len(payload) > _FLAGS_BYTE]
    for rank, flags in zip(ranks, _flag_bytes([payloads[rank] for rank in ranks])):
        if int(flags) & container.FLAG_NONFINITE:
            payload = payloads[rank]
            if arrays.is_torch(payload):
                payload = np.frombuffer(arrays.head_bytes(payload, len(payload)), dtype=np.uint8)
            values = np.frombuffer(container.unpack(payload).value_section, dtype="<f4")
            return rank, int(np.isnan(values).sum()), int(np.isinf(values).sum())
    return None


def _flag_bytes(payloads: Sequence) -> Sequence[int]:
    """The flags byte of each container: torch tensors' gathered into one array and copied to
    the host at once; bytes and NumPy arrays read where they are."""
    if not payloads or not arrays.is_torch(payloads[0]):
        return [payload[_FLAGS_BYTE] for payload in payloads]
    flags = arrays.namespace(*payloads).concat([payload[_FLAGS_BYTE:_FLAGS_BYTE + 1] for payload in payloads])
    return arrays.adapter(flags).to_numpy(flags).tolist()


def nonfinite_error(name: str, step: int, rank: int, nan: int, inf: int, more: int = 0) -> NonFiniteGradientError:
    """The error every rank raises for a step skipped under ``nonfinite: raise``."""
    others = f" (and {more} more gradient(s))" if more else ""
    return NonFiniteGradientError(
        f"gradient {name!r} at step {step} has {nan} NaN and {inf} Inf entries on rank {rank}{others} "
        "(pipeline option nonfinite='raise'); every rank skipped this step: nothing was applied and the "
        "error-feedback residuals are as before it"
    )
