"""Measure a config's codec costs and PowerSGD's compute on this machine, for the cost model.

:func:`measure_codec_costs` runs the calls the sparse all-reduce makes (``shards.encode_shards``
and ``SparseAllreduce.shard_entries`` on the host path: one C++ call per tensor and phase where the
config runs in the C++ pipeline, the Python core's loop over the containers otherwise) on seeded
Laplace gradients of a few sizes (a new gradient for every timed encode, drawn before the clock
starts: a training step encodes a gradient it has not encoded before, and re-encoding one array
times it from the cache, 1.7x faster at a few million elements), cut into 1 and :data:`SHARDS`
containers, and at two selection
ratios (the config's and a quarter of it, which separates the per-element cost from the
per-entry cost, of the encode as of the decode), and fits the per-container, per-element and
per-entry constants of :class:`~deepreduce.collective.cost_model.CodecCosts` (:mod:`deepreduce.collective.linear_fit`).
:func:`measure_collective_costs` (run in the ranks) and :func:`measure_host_costs` measure a
rank's CPU beyond the codec (:class:`~deepreduce.collective.cost_model.HostCosts`). As in
``deepreduce bench-step``, decode times another pipeline's containers (a peer encoding the negated
gradient): a rank's own container is added from what its encode kept, so timing it would time
that shortcut.

``clock="cpu"`` (the default) times with the process's CPU clock: with one kernel thread it is
the figure least disturbed by other jobs on a shared machine; ``"wall"`` is right on a quiet one.
Re-run both functions on the machine that trains; the figures of a busy machine are inflated.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import numpy as np

from ..errors import ConfigError
from ..wire.container import unpack
from .cost_model import CodecCosts, HostCosts, PowerSGDCosts, check_nonnegative
from .linear_fit import fit_nonnegative
from .shards import encode_shards
from .sparse_allreduce import SparseAllreduce, even_bounds

DEFAULT_SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
#: The containers per call of the second row of every size (the first: one).
SHARDS = 32
#: The second ratio is the config's divided by this.
RATIO_SPLIT = 4
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _timer(clock: str) -> Callable[[], float]:
    if clock not in CLOCKS:
        raise ConfigError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    return CLOCKS[clock]


def _median_s(fn: Callable[[int], object], repeat: int, now: Callable[[], float]) -> float:
    """Median seconds of ``fn(i)`` for ``i`` in ``1..repeat``, after one untimed ``fn(0)``."""
    fn(0)
    samples = []
    for i in range(1, repeat + 1):
        start = now()
        fn(i)
        samples.append(now() - start)
    return max(statistics.median(samples), 1e-9)


def with_ratio(config: dict) -> dict:
    """``config`` with its sparsifier's selection given as a ``ratio`` (what the probe varies): a
    ``chunk_topk`` of ``k`` per chunk of ``C`` becomes ``ratio = k / C``, the same selection."""
    sparsifier = config.get("sparsifier")
    if not isinstance(sparsifier, dict) or sparsifier.get("id") != "chunk_topk" or not sparsifier.get("k"):
        return config
    from ..sparsify.chunked import ChunkTopK

    chunk = sparsifier.get("chunk", ChunkTopK.PARAMS["chunk"].default)
    return dict(config, sparsifier=dict(sparsifier, ratio=sparsifier["k"] / chunk, k=0))


def measure_codec_costs(config, name: str = "", sizes: Sequence[int] = DEFAULT_SIZES, repeat: int = 3,
                        seed: int = 0, threads: int = 1, clock: str = "cpu", note: str = "") -> CodecCosts:
    """Fit ``config``'s (a path, shipped name or dict) encode, decode and container-size costs.

    Its sparsifier must have a ``ratio`` (Top-r and the like; a ``chunk_topk``'s ``k`` counts as
    ``k / chunk``, :func:`with_ratio`). ``threads``: the kernels' threads
    (1: one rank per core). ``note`` is stored with the figures (say where they were taken).
    """
    from ..config import build, load_config

    raw = with_ratio(dict(load_config(config)))
    ratio = raw.get("sparsifier", {}).get("ratio")
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise ConfigError(f"measure_codec_costs: the config's sparsifier needs a ratio in (0, 1], got {ratio!r}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ConfigError(f"measure_codec_costs: repeat must be an integer >= 1, got {repeat!r}")
    if not sizes or any(isinstance(d, bool) or not isinstance(d, int) or d < 1000 for d in sizes):
        raise ConfigError(f"measure_codec_costs: sizes must be integers >= 1000, got {list(sizes)!r}")
    now = _timer(clock)
    name = name or (config if isinstance(config, str) else "config").rsplit("/", 1)[-1].removesuffix(".yaml")
    rng = np.random.default_rng(seed)
    rows = []   # (containers, numel, entries decoded, encode_s, decode_s, container bytes, one at the ratio)
    for part in (ratio, ratio / RATIO_SPLIT):
        variant = dict(raw, threads=threads, sparsifier=dict(raw["sparsifier"], ratio=part))
        pipe, peer = build(variant), build(variant)
        owner = SparseAllreduce(pipe, None, reselect="none")
        for numel in sizes:
            grads = [rng.laplace(size=numel).astype(np.float32) for _ in range(repeat + 1)]   # one per encode
            grad = grads[0]
            payload = encode_shards(peer, -grad, f"probe{numel}", 0, [0, numel])[0]
            entries = unpack(payload).n
            for shards in (1, SHARDS):
                bounds = even_bounds(numel, shards)
                encode_s = _median_s(lambda step: encode_shards(pipe, grads[step], f"probe{numel}", step, bounds),
                                     repeat, now)
                received = [payload] * shards   # as many containers as ranks, each of the whole tensor
                decode_s = _median_s(lambda _: owner.shard_entries(received, numel), repeat, now)
                rows.append((shards, numel, shards * entries, encode_s, decode_s, int(payload.shape[0]),
                             part == ratio and shards == 1))
    containers, numel, entries, encode, decode, nbytes, at_ratio = (list(col) for col in zip(*rows))
    encoded = [e / c for e, c in zip(entries, containers)]   # one encode selects the tensor's entries once
    encode_call, encode_element, encode_entry = fit_nonnegative([containers, numel, encoded], encode,
                                                                f"{name} encode seconds")
    # the model charges every received container its tensor's elements (a Bloom filter is queried
    # at each), so the element column counts them per container
    decoded = [c * d for c, d in zip(containers, numel)]
    decode_call, decode_element, decode_entry = fit_nonnegative([containers, decoded, entries], decode,
                                                                f"{name} decode seconds")
    own = [i for i, keep in enumerate(at_ratio) if keep]   # sizes at the config's own density
    header, entry = fit_nonnegative([[1.0] * len(own), [entries[i] for i in own]], [nbytes[i] for i in own],
                                    f"{name} container bytes")
    return CodecCosts(name=name, ratio=float(ratio), encode_call_s=encode_call, encode_element_s=encode_element,
                      encode_entry_s=encode_entry,
                      decode_call_s=decode_call, decode_element_s=decode_element, decode_entry_s=decode_entry,
                      header_bytes=header, entry_bytes=entry, note=note)


def measure_powersgd_costs(rank: int = 4, shape=(1024, 4608), repeat: int = 3, seed: int = 0,
                           clock: str = "cpu") -> PowerSGDCosts:
    """Time PowerSGD's pieces on a ``shape`` matrix with NumPy (float32): the ``M Q`` matmul per
    multiply-accumulate, ``np.linalg.qr`` of ``P`` per ``n r^2``, an add per element."""
    now = _timer(clock)
    rows, cols = shape
    rng = np.random.default_rng(seed)
    matrix = rng.standard_normal((rows, cols), dtype=np.float32)
    q = rng.standard_normal((cols, rank), dtype=np.float32)
    p = matrix @ q
    other = np.empty_like(matrix)
    mac_s = _median_s(lambda _: matrix @ q, repeat, now) / (rows * cols * rank)
    orth_s = _median_s(lambda _: np.linalg.qr(p), repeat, now) / (rows * rank * rank)
    element_s = _median_s(lambda _: np.add(matrix, matrix, out=other), repeat, now) / (rows * cols)
    return PowerSGDCosts(mac_s=mac_s, orth_s=orth_s, element_s=element_s)


# ---------------------------------------------------------------------------- a rank's host CPU beyond the codec
#: Elements of the array copied to time one float32 pass (:func:`measure_host_costs`): large enough
#: that the copy runs at memory speed, as the residual journal's and the decode's passes do.
COPY_ELEMENTS = 1 << 22
#: Payload bytes of the collective probe (:func:`measure_collective_costs`).
COLLECTIVE_BYTES = (1 << 10, 1 << 16, 1 << 19, 1 << 21)
#: Wall seconds the collective probe works to time the transport's background thread beside it.
BUSY_S = 0.5
#: Hand-overs timed together (one is a few microseconds).
HAND_OVERS = 100


def measure_host_costs(collective: dict, repeat: int = 9, clock: str = "cpu",
                       elements: int = COPY_ELEMENTS, note: str = "") -> HostCosts:
    """:class:`~deepreduce.collective.cost_model.HostCosts` of this process: one float32 pass timed
    as an ``np.copyto`` of ``elements`` float32 (the residual journal's copy, the decode's write
    over its output and the division by N run at this speed), one hand-over to
    :class:`~deepreduce.collective.worker.Worker` (the submit of a no-op and the wait for its
    result: what every item of a step costs beside its codec), and the collective figures
    ``collective`` (:func:`measure_collective_costs`' output, measured in the ranks at their N)."""
    from .worker import Worker

    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ConfigError(f"measure_host_costs: repeat must be an integer >= 1, got {repeat!r}")
    if not isinstance(collective, dict) or any(k not in collective for k in ("call_s", "byte_s", "background_per_s")):
        raise ConfigError("measure_host_costs: collective must be measure_collective_costs' output "
                          "(call_s, byte_s, background_per_s)")
    now = _timer(clock)
    source = np.random.default_rng(0).standard_normal(elements, dtype=np.float32)
    out = np.empty_like(source)
    copy_s = _median_s(lambda _: np.copyto(out, source), repeat, now) / elements
    worker = Worker("deepreduce-probe")
    try:
        hand_over_s = _median_s(lambda _: [worker.submit(_nothing).result() for _ in range(HAND_OVERS)], repeat,
                                now) / HAND_OVERS
    finally:
        worker.close()
    return HostCosts(copy_element_s=copy_s, hand_over_s=hand_over_s, call_s=float(collective["call_s"]),
                     byte_s=float(collective["byte_s"]), background_per_s=float(collective["background_per_s"]),
                     note=note)


def _nothing() -> None:
    return None


def measure_collective_costs(allgather: Callable, alltoall: Callable, rank: int, ranks: int,
                             sizes: Sequence[int] = COLLECTIVE_BYTES, repeat: int = 5, clock: str = "cpu",
                             busy_s: float = BUSY_S) -> dict:
    """A rank's CPU seconds in a transport's collectives (every rank calls it together):
    ``allgather(payload, name)`` and ``alltoall(payloads, name)`` (blocking, uint8 NumPy in, as the
    transport moves bytes: Horovod's ``hvd.allgather`` / ``hvd.alltoall``) of ``sizes`` payload
    bytes per rank, each timed with the process clock (every thread: the transport's own
    included) around the call; fitted as ``call_s + byte_s * bytes received from the other
    ranks`` (one fit for both collectives); and the CPU the transport's own threads take per CPU
    second of the caller's work between collectives (Horovod's background thread cycling and
    polling), timed for ``busy_s`` seconds. Returns ``{"call_s", "byte_s", "background_per_s",
    "ranks", "points": [[kind, bytes per rank, received bytes, seconds]]}``.

    Run it at the N and on the machine whose steps it predicts: with more ranks than cores a rank
    whose collective round waits for a peer off the cores polls, and the figures hold that polling
    (what oversubscription costs a rank beyond its own work)."""
    now = _timer(clock)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ConfigError(f"measure_collective_costs needs 2 or more ranks, got {ranks!r}")
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < ranks for s in sizes):
        raise ConfigError(f"measure_collective_costs: sizes must be integers >= ranks, got {list(sizes)!r}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ConfigError(f"measure_collective_costs: repeat must be an integer >= 1, got {repeat!r}")
    check_nonnegative(busy_s, "measure_collective_costs busy_s")
    barrier = np.zeros(1, dtype=np.uint8)
    points = []
    for nbytes in sizes:
        payload = np.full(nbytes, rank % 251, dtype=np.uint8)
        shards = [np.full(nbytes // ranks, 7, dtype=np.uint8)] * ranks
        for kind, call, received in (
                ("allgather", lambda i: allgather(payload, f"probe.ag.{nbytes}.{i}"), (ranks - 1) * nbytes),
                ("alltoall", lambda i: alltoall(shards, f"probe.a2a.{nbytes}.{i}"), (ranks - 1) * (nbytes // ranks))):
            allgather(barrier, f"probe.barrier.{kind}.{nbytes}")
            points.append([kind, nbytes, received, _median_s(call, repeat, now)])
    call_s, byte_s = fit_nonnegative([[1.0] * len(points), [p[2] for p in points]], [p[3] for p in points],
                                     "collective CPU seconds")
    allgather(barrier, "probe.barrier.busy")
    background = _background_per_s(busy_s)
    allgather(barrier, "probe.barrier.end")
    return {"call_s": call_s, "byte_s": byte_s, "background_per_s": background, "ranks": ranks, "points": points}


def _background_per_s(busy_s: float) -> float:
    """CPU seconds the process's other threads (the transport's) take per CPU second of this
    thread while it works (float32 copies for ``busy_s`` wall seconds) and issues no collective."""
    source = np.ones(1 << 20, dtype=np.float32)
    out = np.empty_like(source)
    start_process, start_thread, start_wall = time.process_time(), time.thread_time(), time.perf_counter()
    while time.perf_counter() - start_wall < busy_s:
        np.copyto(out, source)
    mine = time.thread_time() - start_thread
    return max(0.0, time.process_time() - start_process - mine) / max(mine, 1e-9)
