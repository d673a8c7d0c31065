"""What reducing one gradient bucket costs one rank: an alpha-beta link model, the collectives'
formulas, and the codecs' measured per-element costs.

A message of ``b`` bytes takes ``alpha + b / bandwidth`` seconds (Hockney's alpha-beta model:
``alpha`` the latency of one message, ``bandwidth`` bytes per second of one link). Links are full
duplex (a rank sends and receives at once at ``bandwidth``) and the network has no contention
beyond each rank's own link, the assumptions under which the textbook costs below hold (Thakur,
Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH", 2005):

* ring all-reduce of ``d`` bytes over ``N`` ranks: ``2(N-1) alpha + 2 (N-1)/N d / bandwidth``
  (a reduce-scatter then an allgather, each ``N-1`` steps of ``d/N`` bytes);
* ring allgather of ``p`` bytes from each rank: ``(N-1) alpha + (N-1) p / bandwidth`` (a rank
  receives every other rank's payload);
* alltoall by pairwise exchange: ``N-1`` rounds, in round ``j`` the rank sends ``s_j`` bytes to
  one peer while receiving ``r_j`` from another: ``sum_j (alpha + max(s_j, r_j) / bandwidth)``;
* sparse all-reduce (Ok-Topk, Li & Hoefler, PPoPP'22; the alltoall/owner/allgather pattern of
  Bagua's ByteGrad and DeepSpeed's 1-bit Adam): the bucket's index space is cut into ``N``
  shards of ``d/N`` elements with balanced selections; phase 1 alltoalls each rank's
  ``k/N``-entry shard containers to the shards' owners, the owner decode-sums its shard, re-selects
  about ``k/N`` entries and the re-selected shards are allgathered. A rank receives
  ``2 k (N-1)/N`` entries, Ok-Topk's lower bound, whatever ``N``.

Codec costs are linear fits measured on this machine (:mod:`deepreduce.collective.cost_probe`):
encoding a ``d``-element tensor into ``c`` containers holding ``k`` entries in all costs
``c encode_call_s + encode_element_s * d + encode_entry_s * k`` (one container per shard: the
per-call cost is counted per container; packing and settling the residual are per entry); decoding one
received container of a ``d``-element tensor holding ``n`` entries into the sum costs
``decode_call_s + decode_element_s * d + decode_entry_s * n`` (a Bloom filter is queried at every
position of the tensor, a raw or Elias-Fano index section is read entry by entry); a container
holds ``header_bytes + entry_bytes * n`` bytes. Every function is a pure function of its inputs.

A rank's host CPU beyond the codec (:class:`HostCosts`, measured by
:func:`deepreduce.collective.cost_probe.measure_host_costs` and
:func:`~deepreduce.collective.cost_probe.measure_collective_costs`), added where the inputs carry
it: each tensor's full passes over its elements outside the codec (:data:`COPY_PASSES`: the
residual journal's second buffer, the decode's first write over its output, the division by ``N``), one
hand-over to the step engine's worker, and the collective's CPU (per call, per received byte);
over a step, the transport's background thread (its CPU per second of the rank's work) and, with
more ranks than cores, the polling of ranks waiting in the collectives (:func:`step_cpu_s`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence, Tuple

from ..errors import ConfigError

#: Latency assumed for one message when none is given: 25 microseconds, a TCP message over
#: 10-100 Gbit/s Ethernet through an MPI/Gloo stack (RDMA fabrics are lower, about 2-5 us).
DEFAULT_ALPHA_S = 25e-6
BITS_PER_GBIT = 1e9
FLOAT32_BYTES = 4
FLOAT16_BYTES = 2
#: PyTorch's PowerSGD hook compresses a matrix only when its factors are this many times smaller.
POWERSGD_MIN_COMPRESSION_RATE = 2


def check_nonnegative(value, name: str) -> float:
    """``value`` as a float if it is a finite number >= 0, else ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_ranks(ranks) -> int:
    """``ranks`` if it is an integer >= 1, else ConfigError."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"ranks must be an integer >= 1, got {ranks!r}")
    return ranks


@dataclass(frozen=True)
class Link:
    """One rank's network link in the alpha-beta model.

    Attributes:
        alpha_s: seconds of latency per message (the per-step cost of a collective's algorithm).
        bandwidth: bytes per second the link carries in each direction (beta's inverse).
    """

    alpha_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        check_nonnegative(self.alpha_s, "link alpha_s")
        if check_nonnegative(self.bandwidth, "link bandwidth") == 0:
            raise ConfigError("link bandwidth must be > 0 bytes per second, got 0")

    @classmethod
    def from_gbit(cls, gbit: float, alpha_s: float = DEFAULT_ALPHA_S) -> "Link":
        """A link of ``gbit`` Gbit/s (10^9 bits per second) and ``alpha_s`` latency."""
        return cls(alpha_s=alpha_s, bandwidth=check_nonnegative(gbit, "link gbit") * BITS_PER_GBIT / 8)

    def seconds(self, messages: float, nbytes: float) -> float:
        """Time of ``messages`` latencies and ``nbytes`` bytes through the link."""
        return messages * self.alpha_s + nbytes / self.bandwidth

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Link":
        return cls(**_fields(data, ("alpha_s", "bandwidth"), "link"))


def fit_link(nbytes: Sequence[float], seconds: Sequence[float], ranks: int) -> Link:
    """The link whose ring all-reduce formula best fits timed all-reduces of ``nbytes`` bytes
    over ``ranks`` ranks (least squares on relative error, coefficients kept >= 0): a start-up
    probe times a few sizes and every rank plans with rank 0's fit."""
    from .linear_fit import fit_nonnegative

    check_ranks(ranks)
    if ranks < 2:
        raise ConfigError("fit_link needs ranks >= 2 (one rank moves no bytes)")
    steps = 2 * (ranks - 1)
    columns = [[float(steps)] * len(nbytes), [steps / ranks * float(b) for b in nbytes]]
    alpha, inverse_bandwidth = fit_nonnegative(columns, seconds, "fit_link seconds")
    if inverse_bandwidth <= 0:
        raise ConfigError("fit_link: the timings do not grow with the size; time larger all-reduces")
    return Link(alpha_s=alpha, bandwidth=1.0 / inverse_bandwidth)


# ---------------------------------------------------------------------------- collectives
def ring_allreduce_s(link: Link, ranks: int, nbytes: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` bytes: ``2(N-1) alpha + 2(N-1)/N nbytes / bw``."""
    n = check_ranks(ranks)
    return link.seconds(2 * (n - 1), 2 * (n - 1) / n * nbytes)


def allgather_s(link: Link, ranks: int, payload_bytes: float) -> float:
    """Seconds of a ring allgather of ``payload_bytes`` from every rank: ``(N-1)(alpha + p / bw)``."""
    n = check_ranks(ranks)
    return link.seconds(n - 1, (n - 1) * payload_bytes)


def alltoall_s(link: Link, sent: Sequence[float], received: Sequence[float]) -> float:
    """Seconds of a pairwise-exchange alltoall with uneven splits, for one rank.

    ``sent[j]`` / ``received[j]``: bytes to / from the ``j``-th other rank (one entry per peer,
    the rank itself excluded). Round ``j`` costs ``alpha + max(sent[j], received[j]) / bw``.
    """
    if len(sent) != len(received):
        raise ConfigError(f"alltoall: sent has {len(sent)} peers, received {len(received)}")
    return sum(link.seconds(1, max(s, r)) for s, r in zip(sent, received))


# ---------------------------------------------------------------------------- codecs
@dataclass(frozen=True)
class CodecCosts:
    """One deepreduce config's measured costs per rank (see the module docstring for the fits).

    Attributes:
        name: the config's name (e.g. ``topk_raw``).
        ratio: fraction of a tensor's elements the sparsifier selects (``k = ratio * d``).
        encode_call_s, encode_element_s: seconds per container encoded and per input element.
        encode_entry_s: seconds per entry encoded (packing it, settling its residual; 0 in
            figures saved before it was measured).
        decode_call_s, decode_element_s, decode_entry_s: seconds to decode one received
            container into the sum: per container, per element of its tensor, per entry.
        header_bytes, entry_bytes: a container's fixed bytes and bytes per entry.
        note: where and how the figures were measured (e.g. "2 cores, load average 7").
    """

    name: str
    ratio: float
    encode_call_s: float
    encode_element_s: float
    decode_call_s: float
    decode_element_s: float
    decode_entry_s: float
    header_bytes: float
    entry_bytes: float
    note: str = ""
    encode_entry_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"codec costs: name must be a non-empty string, got {self.name!r}")
        if not 0 < check_nonnegative(self.ratio, f"codec {self.name} ratio") <= 1:
            raise ConfigError(f"codec {self.name}: ratio must be in (0, 1], got {self.ratio!r}")
        for key in _COST_FIELDS:
            check_nonnegative(getattr(self, key), f"codec {self.name} {key}")
        if not isinstance(self.note, str):
            raise ConfigError(f"codec {self.name}: note must be a string, got {self.note!r}")

    def entries(self, numel: float) -> float:
        """Entries selected from ``numel`` elements: ``ratio * numel``, at least 1, at most all."""
        return min(float(numel), max(1.0, self.ratio * numel))

    def encode_s(self, numel: float) -> float:
        """Encoding one container of a ``numel``-element tensor at the config's ratio."""
        return self.encode_call_s + self.encode_element_s * numel + self.encode_entry_s * self.entries(numel)

    def decode_s(self, numel: float, entries: float) -> float:
        return self.decode_call_s + self.decode_element_s * numel + self.decode_entry_s * entries

    def container_bytes(self, entries: float) -> float:
        return self.header_bytes + self.entry_bytes * entries

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CodecCosts":
        return cls(**_fields(data, ("name", "ratio", *_COST_FIELDS, "note"), "codec costs",
                             optional=("note", "encode_entry_s")))


_COST_FIELDS = ("encode_call_s", "encode_element_s", "encode_entry_s", "decode_call_s", "decode_element_s",
                "decode_entry_s", "header_bytes", "entry_bytes")


@dataclass(frozen=True)
class PowerSGDCosts:
    """PowerSGD's compute per rank, per unit of work (measured by :mod:`deepreduce.collective.cost_probe`).

    Attributes:
        mac_s: seconds per multiply-accumulate of its skinny matmuls (``M Q``, ``M^T P``, ``P Q^T``).
        orth_s: seconds per ``n r^2`` unit of the orthogonalisation of ``P`` (n x r).
        element_s: seconds per matrix element of the error-feedback add and subtract.
    """

    mac_s: float
    orth_s: float
    element_s: float

    def __post_init__(self) -> None:
        for key in ("mac_s", "orth_s", "element_s"):
            check_nonnegative(getattr(self, key), f"powersgd {key}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PowerSGDCosts":
        return cls(**_fields(data, ("mac_s", "orth_s", "element_s"), "powersgd costs"))


# ---------------------------------------------------------------------------- one bucket's reduction
@dataclass(frozen=True)
class Cost:
    """One rank's cost of reducing one bucket one way: compute and link seconds, wire bytes.

    ``received_bytes`` counts what arrives from other ranks; ``sent_bytes`` what leaves this rank.
    """

    encode_s: float
    comm_s: float
    decode_s: float
    sent_bytes: float
    received_bytes: float
    host_s: float = 0.0   # host CPU beyond the codec (:func:`host_seconds`); 0 without HostCosts

    @property
    def total_s(self) -> float:
        return self.encode_s + self.comm_s + self.decode_s + self.host_s

    @property
    def cpu_s(self) -> float:
        """The rank's CPU seconds of this bucket: codec and host glue (the link's seconds are not CPU)."""
        return self.encode_s + self.decode_s + self.host_s


def dense_cost(link: Link, ranks: int, numel: float, itemsize: int = FLOAT32_BYTES) -> Cost:
    """Ring all-reduce of the bucket as ``itemsize``-byte floats (4: fp32, 2: fp16); casts and the
    reduction's additions are not modelled (they run at memory speed on the accelerator)."""
    n = check_ranks(ranks)
    moved = 2 * (n - 1) / n * numel * itemsize
    return Cost(0.0, ring_allreduce_s(link, n, numel * itemsize), 0.0, moved, moved)


def allgather_cost(link: Link, ranks: int, numel: float, codec: CodecCosts) -> Cost:
    """Today's aggregation: one container per rank, allgathered; every rank decodes the ``N-1``
    containers of the others (its own is added from what its encode kept)."""
    n = check_ranks(ranks)
    k = codec.entries(numel)
    payload = codec.container_bytes(k)
    return Cost(codec.encode_s(numel), allgather_s(link, n, payload), (n - 1) * codec.decode_s(numel, k),
                (n - 1) * payload, (n - 1) * payload)


def sparse_allreduce_cost(link: Link, ranks: int, numel: float, codec: CodecCosts, reselect: bool = True) -> Cost:
    """Alltoall of ``N`` shard containers, owner decode-sum and re-selection, allgather.

    Phase 1: one selection over the bucket, one container per shard (``k/N`` entries each,
    Ok-Topk's balanced boundaries assumed), ``N-1`` of them sent, ``N-1`` received and decoded.
    Phase 2: the owner encodes its ``d/N`` shard (re-selecting about ``k/N`` entries; with
    ``reselect=False`` the union of the ranks' selections is sent, at most ``min(d/N, k)``
    entries, the bound used here), the shards are allgathered and ``N-1`` decoded.
    """
    n = check_ranks(ranks)
    k = codec.entries(numel)
    shard = numel / n
    shard_entries = k / n
    union = shard_entries if reselect else min(shard, k)
    first, second = codec.container_bytes(shard_entries), codec.container_bytes(union)
    encode = codec.encode_element_s * numel + codec.encode_entry_s * k + n * codec.encode_call_s \
        + codec.encode_s(shard)
    comm = alltoall_s(link, [first] * (n - 1), [first] * (n - 1)) + allgather_s(link, n, second)
    decode = (n - 1) * (codec.decode_s(shard, shard_entries) + codec.decode_s(shard, union))
    moved = (n - 1) * (first + second)
    return Cost(encode, comm, decode, moved, moved)


def matrix_view(shape: Sequence[int]) -> Tuple[int, int]:
    """PowerSGD's 2-D view of a tensor: ``(shape[0], product of the rest)`` (1-D: ``(d, 1)``)."""
    dims = [int(x) for x in shape] or [1]
    return dims[0], math.prod(dims[1:])


def powersgd_cost(link: Link, ranks: int, shapes: Iterable[Sequence[int]], rank: int,
                  costs: PowerSGDCosts) -> Cost:
    """PowerSGD rank ``rank`` on a bucket of tensors of ``shapes`` (Vogels et al., NeurIPS'19, as
    PyTorch's hook runs it): each compressible matrix ``(n, m)`` sends ``P`` (n x r) and ``Q``
    (m x r), all ``P`` of the bucket in one all-reduce and all ``Q`` in a second; 1-D tensors and
    matrices whose factors are not ``POWERSGD_MIN_COMPRESSION_RATE`` times smaller go in a third,
    dense, all-reduce. Compute: ``3 n m r`` MACs (``M Q``, ``M^T P``, ``P Q^T``), an
    orthogonalisation of ``n r^2`` and ``2 n m`` elementwise error-feedback operations per matrix.
    """
    n_ranks = check_ranks(ranks)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"powersgd rank must be an integer >= 1, got {rank!r}")
    p_floats = q_floats = dense_floats = 0
    compute = 0.0
    for shape in shapes:
        rows, cols = matrix_view(shape)
        if len(shape) < 2 or (rows + cols) * rank * POWERSGD_MIN_COMPRESSION_RATE >= rows * cols:
            dense_floats += rows * cols
            continue
        p_floats += rows * rank
        q_floats += cols * rank
        compute += costs.mac_s * 3 * rows * cols * rank + costs.orth_s * rows * rank * rank \
            + costs.element_s * 2 * rows * cols
    comm = sum(ring_allreduce_s(link, n_ranks, FLOAT32_BYTES * floats)
               for floats in (p_floats, q_floats, dense_floats) if floats)
    moved = 2 * (n_ranks - 1) / n_ranks * FLOAT32_BYTES * (p_floats + q_floats + dense_floats)
    return Cost(compute, comm, 0.0, moved, moved)



# ---------------------------------------------------------------------------- a rank's host CPU beyond the codec
#: Full float32 passes over a tensor's elements that a route makes outside the codec, per step:
#: the coded routes write the step's compensation into a second buffer, keeping the old residual
#: for a skipped step (``Memory.step_buffers``: about a copy's memory traffic; measured 0.6 of an
#: ``np.copyto`` on top of the in-place pass), write the decoded sum over the whole output (the
#: first container's decode overwrites it)
#: and divide it by ``N``; the sparse all-reduce's owner residual is journaled entry by entry
#: (O(k), not a pass). ``fp16`` casts in and back; ``dense`` is summed in place by the collective.
COPY_PASSES = {"dense": 0, "fp16": 2, "allgather": 3, "sparse_allreduce": 3}
#: Collectives a route runs per bucket (the engine fuses the sparse all-reduce's collectives of a
#: whole step into one alltoall and one allgather: :func:`step_collectives`).
COLLECTIVES = {"dense": 1, "fp16": 1, "allgather": 1, "sparse_allreduce": 2}


@dataclass(frozen=True)
class HostCosts:
    """A rank's CPU beyond the codec on this machine and transport (measured, see the module docstring).

    Attributes:
        copy_element_s: seconds per element of one float32 pass (an ``np.copyto`` at memory speed).
        hand_over_s: seconds of one item's hand-over to the engine's worker thread and back.
        call_s, byte_s: a rank's CPU per collective call and per byte received from the other
            ranks (fitted on allgathers and alltoalls at the step's N: beyond the cores they
            include the polling of a rank whose collective waits for a peer off the cores).
        background_per_s: CPU seconds the transport's own threads take per CPU second of the
            rank's work (Horovod's background thread cycling and polling beside it).
        note: where and how the figures were measured.
    """

    copy_element_s: float
    hand_over_s: float
    call_s: float
    byte_s: float
    background_per_s: float
    note: str = ""

    def __post_init__(self) -> None:
        for key in _HOST_FIELDS:
            check_nonnegative(getattr(self, key), f"host costs {key}")
        if not isinstance(self.note, str):
            raise ConfigError(f"host costs: note must be a string, got {self.note!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "HostCosts":
        return cls(**_fields(data, (*_HOST_FIELDS, "note"), "host costs", optional=("note",)))


_HOST_FIELDS = ("copy_element_s", "hand_over_s", "call_s", "byte_s", "background_per_s")


def host_seconds(host: HostCosts, aggregation: str, numel: float, received_bytes: float, collectives: int) -> float:
    """One tensor's host CPU beyond the codec: :data:`COPY_PASSES` passes over ``numel`` elements,
    one hand-over to the worker, ``collectives`` collective calls and ``received_bytes`` through them."""
    if aggregation not in COPY_PASSES:
        raise ConfigError(f"host_seconds: unknown aggregation {aggregation!r}; known: {sorted(COPY_PASSES)}")
    return COPY_PASSES[aggregation] * numel * host.copy_element_s + host.hand_over_s \
        + collectives * host.call_s + received_bytes * host.byte_s


def step_collectives(aggregation: str, tensors: int) -> int:
    """Collective calls of one step of ``tensors`` tensors on one route: one per tensor, except
    the sparse all-reduce's two per step (every tensor's shards in one alltoall, then one allgather)."""
    if aggregation not in COLLECTIVES:
        raise ConfigError(f"step_collectives: unknown aggregation {aggregation!r}; known: {sorted(COLLECTIVES)}")
    return COLLECTIVES[aggregation] if aggregation == "sparse_allreduce" else COLLECTIVES[aggregation] * tensors


def step_cpu_s(costs: Sequence[Cost], aggregation: str, host: HostCosts, compute_s: float = 0.0) -> float:
    """A rank's CPU seconds of one step whose tensors cost ``costs`` on one route (each with its
    :func:`host_seconds`, whose per-tensor collectives are replaced here by the step's
    :func:`step_collectives`): the rank's own work (``compute_s`` of forward and backward, every
    tensor's codec and host CPU) times ``1 + background_per_s`` (the transport's thread beside
    it), plus the step's collective calls at ``call_s`` each.

    Oversubscription (more ranks than cores) enters through ``host``, which must be probed at the
    step's N on the machine that runs it (:func:`deepreduce.collective.cost_probe.measure_collective_costs`):
    there a rank's collectives poll while the peer each of their rounds waits for is off the
    cores, and the probe's ``call_s`` and ``background_per_s`` hold that polling. Its work is not
    multiplied by ``N / C``: the polling ranks and the working ones share the cores, so a rank's
    CPU over the step is ``C / N`` of its wall time, and that wall time is ``N / C`` times the
    rank's own work plus the collectives' waits: what is added is the waits, not the peers'
    work (docs/benchmarks.md)."""
    calls = step_collectives(aggregation, len(costs)) * host.call_s
    calls_per_tensor = COLLECTIVES[aggregation] * len(costs) * host.call_s   # what the costs' host_s hold
    own = check_nonnegative(compute_s, "step_cpu_s compute_s") + sum(c.cpu_s for c in costs) - calls_per_tensor
    return own * (1.0 + host.background_per_s) + calls


def _fields(data, keys: Sequence[str], what: str, optional: Sequence[str] = ()) -> dict:
    """``data``'s entries for ``keys``, refusing a non-dict, a missing or an unknown key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a dict, got {type(data).__name__}")
    missing = [k for k in keys if k not in data and k not in optional]
    unknown = sorted(set(map(str, data)) - set(keys))
    if missing or unknown:
        raise ConfigError(f"{what}: missing keys {missing}, unknown keys {unknown}")
    return {k: data[k] for k in keys if k in data}
