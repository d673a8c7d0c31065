"""Sparse all-reduce: aggregation whose per-rank receive volume does not grow with the ranks.

Allgather of containers makes every rank receive and decode N of them. Here the index space of
a tensor is cut into N contiguous shards, one per rank (Ok-Topk's split-and-reduce, Li & Hoefler,
PPoPP'22; the owner-side residual is DeepSpeed's "server error"):

1. every rank compensates and selects once over the whole tensor (its pipeline's memory and
   sparsifier) and encodes the part of its selection that falls in shard ``j`` as its own
   container (:func:`deepreduce.collective.shards.encode_shards`), sent to rank ``j`` by one alltoall;
2. the owner adds the entries of the N containers of its shard into its owner residual (in
   rank order, entry by entry: no dense decode of the sum), re-selects there (``reselect="topk"``:
   the shard's top ``ratio``, so the result has about k entries; ``"none"``: every non-zero, the
   exact union), takes what it sends out of the residual, and encodes it; one allgather returns
   every shard to every rank. A step that raises on any rank puts back the values the owner
   step changed (journaled position by position, not as a copy of the shard).

Each rank receives about k entries in each phase (k/N from each rank, then k/N from each
owner) whatever N is, against k(N-1) for the allgather of whole containers. The shard
boundaries start even and are moved every ``repartition_every`` steps so that each shard holds
about the same number of the previous aggregate's non-zeros: every rank decoded the same
aggregate, so every rank computes the same boundaries without a message.

A chunked sparsifier (``chunk_topk``: a fixed k per chunk of C) changes two things, so that
both phases cost what a whole container of the same chunks costs. The bounds of a sparse tensor
are whole chunks, the chunks dealt out evenly (:func:`chunk_bounds`; the tail chunk in the last
non-empty shard) and never moved: every chunk holds the same k, so they are balanced already.
Each shard container then has the sparsifier's own geometry, and the chunk-local index codecs
write it as ``(C, k)`` rather than a count per chunk (``deepreduce.wire.chunks``). And the owner
re-selects the config's k in every chunk of its shard (the senders' budget), not a fraction of
the shard, so its container is the same size as each sender's and needs no ``ratio``.

A tensor below the config's ``min_numel`` is dense in both phases: its shards travel dense, and
the owner sends their sum as it is (as the allgather delivers it), keeping no owner residual.

A rank's owner residual covers its own shard only (:class:`OwnerResidual`: ``d/N`` floats, not ``d``; what FSDP's memory
budget needs). Owner-residual mass that a move leaves outside a rank's shard travels with that
rank's next contribution, so nothing is lost: the sum of what was delivered and of both
residuals over all ranks equals the sum of the gradients (tested).

When the config runs in the C++ pipeline (``Pipeline.native``), a tensor's shard
containers are encoded in one C++ call (``shards.encode_shards``) and each phase's received
containers are decoded in one more, where they lie in what the collective returned, so the cost
per container is a microsecond or two rather than a Python loop's tens (docs/scaling.md).

Batches: the shard exchanges of several tensors share one collective per phase (:meth:`send`,
:meth:`exchange`, :meth:`complete`; the step engine batches a step's tensors). Rank ``j``
receives from each rank one payload holding its shard containers of every tensor of the batch
behind a small table of varint lengths (:func:`fuse`, :func:`cut`), so a step costs two collectives rather
than two per tensor. A tensor's failure (its encode, or its owner step, on any rank) travels as
that tensor's failure payload inside the batch: the other tensors and every rank stay in phase.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ..backend import kernels, native_pipeline
from ..errors import CommunicationError, ConfigError, ContainerError, DeepReduceError, NonFiniteGradientError
from ..pipeline import Pipeline
from ..sparsify import count_for
from ..sparsify.chunked import chunk_topk_positions
from ..wire import varint
from . import agreement, failure, ports, shards

RESELECT = ("topk", "none")
# The step engine's route starts a tensor's (or bucket's) shard exchange during backward from this
# size: 16 MB of float32 (a DDP bucket of the default 25 MB), whose compressed bytes at Top-1% (about
# 340 kB a rank with raw indices and values) take a slow link long enough to be worth hiding; below it
# one collective's fixed cost (Horovod's negotiation cycle, the owner step's wait) is about what it
# would hide, and the smaller tensors share one exchange after backward
# (:mod:`deepreduce.collective.routes.sparse_allreduce`).
# Measured on the 2-core machine, where backward leaves no core idle to overlap with: starting the
# exchanges of 2.4M- and 1.0M-element tensors early cost a rank CPU at 4 and 8 ranks
# (docs/benchmarks.md, "Shard exchanges during backward").
EARLY_NUMEL = 1 << 22


class SparseAllreduce:
    """The sparse all-reduce of one pipeline's tensors over one communicator.

    ``reduce(grad, name, step)`` returns the float32 sum over the ranks (the caller averages);
    ``state_dict()`` holds the owner residuals and shard boundaries (the pipeline holds the
    per-rank residuals), so a resumed run sends the same bytes. ``ratio``: the re-selection's
    fraction of each shard (default: the sparsifier's ``ratio``; with a chunked sparsifier and no
    ``ratio`` given, its k in every chunk of the shard instead).
    """

    def __init__(self, pipeline: Pipeline, communicator, reselect: str = "topk",
                 ratio: Optional[float] = None, repartition_every: int = 8, early_numel: int = EARLY_NUMEL) -> None:
        if reselect not in RESELECT:
            raise ConfigError(f"sparse_allreduce: 'reselect' is {reselect!r}; allowed: {', '.join(RESELECT)}")
        # a chunked sparsifier's geometry: whole-chunk shards, and k per chunk at the owner
        per_chunk = getattr(pipeline.sparsifier, "per_chunk", None)
        self.chunk = int(pipeline.sparsifier.chunk) if isinstance(per_chunk, int) else None
        self.per_chunk = per_chunk if ratio is None and self.chunk is not None else None
        ratio = getattr(pipeline.sparsifier, "ratio", None) if ratio is None else ratio
        if reselect == "topk" and self.per_chunk is None and not (isinstance(ratio, float) and 0.0 < ratio <= 1.0):
            raise ConfigError("sparse_allreduce: reselect 'topk' needs a 'ratio' in (0, 1] (the sparsifier "
                              f"{pipeline.sparsifier.id!r} has none)")
        if isinstance(repartition_every, bool) or not isinstance(repartition_every, int) or repartition_every < 1:
            raise ConfigError(f"sparse_allreduce: 'repartition_every' must be a positive integer, got "
                              f"{repartition_every!r}")
        self.pipeline, self.communicator = pipeline, communicator
        self.reselect, self.ratio, self.repartition_every = reselect, ratio, repartition_every
        self.early_numel = int(early_numel)   # the step engine's route: a batch of its own from this size
        self._bounds: Dict[str, np.ndarray] = {}
        self._owner_residuals: Dict[str, OwnerResidual] = {}
        # both phases decode what they received in one C++ call when the config runs there
        self._native_decode = pipeline.native_reason() is None
        self.received_bytes = {"alltoall": 0, "allgather": 0}
        self.sent_bytes = 0   # what this rank handed to the collectives (its shards, then its owned shard)
        self.last_nonfinite = None   # (rank, NaN, Inf) of the last reduce's first flagged shard
        # start each phase's collective when it is ready (the step engine's route) rather than
        # when it is waited for (the blocking reduce(); a communicator without asynchronous calls)
        self.asynchronous = False
        # each tensor's owner residual and bounds from before the step, for a step every rank
        # raises in (under either nonfinite policy; kept while the pipeline journals its own)
        self._journal: Dict[str, tuple] = {}

    # ------------------------------------------------------------------ the step
    def reduce(self, grad: np.ndarray, name: str, step: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The sum over the ranks of ``grad`` (flat float32 NumPy, ``name`` and ``step`` alike on
        every rank), written into ``out`` when given: the phases below in one blocking call."""
        batch = self.send([self.encode(grad, name, step)])
        self.exchange(batch)
        return self.complete(batch, 0, out)[0]

    def encode(self, grad: np.ndarray, name: str, step: int) -> "Phase":
        """Phase one's encode: compensate, select and encode one container per shard
        (``phase.sent``); :meth:`send` starts the collective. May raise: then
        :meth:`encode_failed` makes the failure payload to go in its place."""
        flat = np.asarray(grad).reshape(-1)
        phase = self._phase(name, step, flat.shape[0])
        flat = self._align_owner_residual(name, flat, phase.lo, phase.hi)
        phase.sent = shards.encode_shards(self.pipeline, flat, name, step, phase.bounds)
        return phase

    def encode_failed(self, name: str, step: int, numel: int, error: BaseException) -> "Phase":
        """Phase one of a tensor whose encode raised ``error`` on this rank: the failure payload
        to every owner (the tensor's collectives go on, so every rank stays in phase)."""
        phase = self._phase(name, step, numel)
        phase.sent = [failure.payload(error)] * self.communicator.size
        return phase

    def send(self, phases: List["Phase"]) -> "Batch":
        """Start phase one's alltoall for ``phases`` (the same tensors in the same order on every
        rank): rank ``j`` receives, from each rank, the containers of shard ``j`` of every tensor
        (:func:`fuse`): one collective for the batch, whatever its number of tensors."""
        size = self.communicator.size
        payloads = [fuse([phase.sent[j] for phase in phases]) for j in range(size)]
        for phase in phases:
            phase.sent = None
        self.sent_bytes += sum(int(p.shape[0]) for p in payloads)
        batch = Batch(phases, f"{phases[0].name}")
        batch.pending = self._alltoall(payloads, f"deepreduce.sra1.{batch.name}")
        return batch

    def _alltoall(self, payloads, name: str):
        if self.asynchronous:
            return ports.start_alltoall(self.communicator, payloads, name)
        return ports.Pending(lambda: self.communicator.alltoall(payloads, name))

    def _allgather(self, payload, name: str):
        if self.asynchronous:
            return ports.start_allgather(self.communicator, payload, name)
        return ports.Pending(lambda: self.communicator.allgather(payload, name))

    def _phase(self, name: str, step: int, numel: int) -> "Phase":
        rank, size = self.communicator.rank, self.communicator.size
        bounds = self._bounds.get(name)
        if bounds is None:
            bounds = self._bounds[name] = (chunk_bounds(numel, size, self.chunk) if self._chunked(numel)
                                           else even_bounds(numel, size))
        if self.pipeline.journaling and name not in self._journal:   # the residual held now, its edits to come
            self._journal[name] = (self._owner_residuals.get(name), bounds.copy(), [])
        return Phase(name, step, numel, bounds, int(bounds[rank]), int(bounds[rank + 1]))

    def _chunked(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements is cut at chunk bounds (:func:`chunk_bounds`)
        rather than balanced ones: the sparsifier is chunked and the tensor is sparse (at least
        ``min_numel``)."""
        return self.chunk is not None and numel >= self.pipeline.min_numel

    def exchange(self, batch: "Batch") -> None:
        """Phase two, in one order on every rank: wait for this rank's shard containers of every
        tensor of ``batch``, decode-sum each tensor's, re-select with its owner residual, encode,
        and start one collective returning every owner's shards to every rank. A peer's failure
        payload is passed on in place of the shard, and so is this rank's own owner-step error
        (kept in ``phase.error``, raised by :meth:`complete`), so every rank hears of it."""
        received = batch.pending.wait()
        self.received_bytes["alltoall"] += sum(int(p.shape[0]) for p in received)
        count, size = len(batch.phases), self.communicator.size
        if len(received) != size:
            raise CommunicationError(f"sparse_allreduce of {batch.name!r}: {len(received)} alltoall parts for {size} ranks")
        try:
            per_rank = [cut(part, count, f"sparse_allreduce of {batch.name!r} from rank {r}")
                        for r, part in enumerate(received)]
        except CommunicationError as exc:   # this rank raises it; the peers hear of it in every shard
            for phase in batch.phases:
                phase.error = exc
            per_rank = [[failure.payload(exc)] * count] * size
        shards = [self._owner_shard(phase, [parts[i] for parts in per_rank]) for i, phase in enumerate(batch.phases)]
        payload = fuse(shards)
        self.sent_bytes += int(payload.shape[0])
        name = f"deepreduce.sra2.{batch.name}"
        if count == 1:   # one container: the communicators' allgather cuts its result by container
            batch.pending = self._allgather(payload, name)
        else:   # a fused payload is not one container: every rank is sent the same bytes by the alltoall
            batch.pending = self._alltoall([payload] * size, name)

    def _owner_shard(self, phase: "Phase", mine: List[np.ndarray]) -> np.ndarray:
        """This rank's shard of one tensor of the batch (or the failure payload it passes on)."""
        failed = None if phase.error is not None else failure.failed_rank(mine)
        if failed is not None:
            kind = NonFiniteGradientError if failed[1] == "nonfinite" else CommunicationError
            return failure.payload(kind(f"rank {failed[0]} could not encode its gradient ({failed[2]})"))
        try:
            if phase.error is not None:
                raise phase.error
            owner = self._owner_residual(phase.name, phase.lo, phase.hi, phase.numel)
            return self._owner_step(mine, owner, phase.hi - phase.lo, phase.name, phase.step, phase.numel)
        except Exception as exc:   # noqa: BLE001 (raised by complete; the peers hear of it)
            phase.error = exc
            kind = NonFiniteGradientError if isinstance(exc, NonFiniteGradientError) else CommunicationError
            rank = self.communicator.rank
            return failure.payload(kind(f"rank {rank} could not reduce its shard ({type(exc).__name__}: {exc})"))

    def complete(self, batch: "Batch", index: int = 0, out: Optional[np.ndarray] = None):
        """Phase three of tensor ``index`` of ``batch``: :meth:`arrived`, then :meth:`decode` into
        ``out`` (or a new array); returns (the sum, the first flagged shard's (rank, NaN, Inf) or None)."""
        shards, flagged = self.arrived(batch, index)
        return self.decode(batch, index, shards, flagged, out), flagged

    def arrived(self, batch: "Batch", index: int):
        """Wait for every owner's shards (once for the batch) and return tensor ``index``'s, with the
        first flagged one's (rank, NaN, Inf) or None. This rank's owner-step error, or a failure
        an owner passed on (its own, or a rank's encode), raises here."""
        phase = batch.phases[index]
        if batch.shards is None:
            gathered = batch.pending.wait()
            self.received_bytes["allgather"] += sum(int(p.shape[0]) for p in gathered)
            size, count = self.communicator.size, len(batch.phases)
            if len(gathered) != size:
                raise CommunicationError(f"sparse_allreduce of {batch.name!r}: {len(gathered)} shards for {size} ranks")
            batch.shards = [cut(part, count, f"sparse_allreduce of {batch.name!r} from rank {r}")
                            for r, part in enumerate(gathered)]
        if phase.error is not None:
            raise phase.error
        shards = [parts[index] for parts in batch.shards]
        failed = failure.failed_rank(shards)
        if failed is not None:   # an owner passed on what failed (its own step, or a rank's encode)
            kind = NonFiniteGradientError if failed[1] == "nonfinite" else CommunicationError
            raise kind(f"sparse_allreduce of {phase.name!r} at step {phase.step}: {failed[2].partition(': ')[2]}; "
                       "every rank skips this step")
        flagged = self.last_nonfinite = agreement.first_nonfinite(shards)
        return shards, flagged

    def decode(self, batch: "Batch", index: int, shards: List[np.ndarray], flagged, out: Optional[np.ndarray] = None,
               divisor: int = 1):
        """Write tensor ``index``'s ``shards`` (from :meth:`arrived`), divided by ``divisor``, into
        ``out`` (every element of it: no need to zero it first) or a new array, and move its shard
        bounds every ``repartition_every`` steps (the same on every rank: the same sum). Returns the
        flat result."""
        phase = batch.phases[index]
        target = np.zeros(phase.numel, np.float32) if out is None else out.reshape(-1)
        self._decode_shards(shards, phase.bounds, target, divisor)
        if flagged is None and (phase.step + 1) % self.repartition_every == 0:
            size = self.communicator.size
            # chunk bounds stay (bounds of a checkpoint written before they existed move onto them)
            moved = (chunk_bounds(phase.numel, size, self.chunk) if self._chunked(phase.numel)
                     else balanced_bounds(self._summed_nonzeros(shards, phase.bounds), phase.numel, size))
            if not np.array_equal(moved, phase.bounds):
                self._bounds[phase.name] = moved   # the next encode moves the owner residual with them
        return target

    def _summed_nonzeros(self, shards: List[np.ndarray], bounds: np.ndarray) -> np.ndarray:
        """Ascending positions of the sum's non-zero entries (as ``numpy.flatnonzero`` of the
        decoded sum: NaN counts, -0.0 and an entry its value codec rounded to zero do not), read
        off the owners' containers rather than by a pass over every element of the tensor."""
        found = []
        for j, payload in enumerate(shards):
            positions, values = self.pipeline.entries_of(payload, (int(bounds[j + 1] - bounds[j]),), count=False)
            found.append(np.asarray(positions, dtype=np.int64)[np.asarray(values) != 0] + int(bounds[j]))
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    # ------------------------------------------------------------------ commit or undo
    def commit(self) -> None:
        """The step was applied on every rank: forget the owner residuals saved for :meth:`undo`."""
        self._journal.clear()

    def undo(self) -> None:
        """The step was skipped on every rank: owner residuals and shard bounds as before it (the
        per-rank residuals are the pipeline's, restored by its own journal)."""
        for name, (owner, bounds, edits) in self._journal.items():
            for edited, positions, old in reversed(edits):   # the old values, last change first
                if positions is None:
                    edited.values[:] = old
                else:
                    edited.values[positions] = old
            if owner is None:
                self._owner_residuals.pop(name, None)
            else:
                self._owner_residuals[name] = owner
            self._bounds[name] = bounds
        self._journal.clear()

    def _native(self):
        """The C++ pipeline when it decodes this config's containers, else None."""
        return native_pipeline.module() if self._native_decode else None

    def _decode_shards(self, shards: List[np.ndarray], bounds: np.ndarray, target: np.ndarray, divisor: int) -> None:
        """Write shard ``j``'s container, divided by ``divisor``, into ``target[bounds[j]:bounds[j+1]]``
        (Pipeline.decode each)."""
        native = self._native()
        if native is not None and target.dtype == np.float32 and target.flags.c_contiguous and target.flags.writeable:
            start = time.perf_counter()
            native_pipeline.decode_shards(native, shards, bounds, target, self.pipeline.threads, divisor)
            self._count_decoded(len(shards), start)
            return
        for j, payload in enumerate(shards):
            self.pipeline.decode(payload, expected_shape=(int(bounds[j + 1] - bounds[j]),),
                                 out=target[int(bounds[j]):int(bounds[j + 1])])
        if divisor != 1:
            np.divide(target, divisor, out=target)

    def shard_entries(self, payloads: List[np.ndarray], m: int) -> list:
        """Each rank's container of this rank's ``m``-element shard as entries (ascending distinct
        positions, float32 values), in rank order, without a dense array of the shard: the first
        phase's decode, which ``cost_probe`` times. A corrupt container's error names its rank."""
        found = []
        for rank, payload in enumerate(payloads):
            try:
                found.append(self.pipeline.entries_of(payload, (m,)))
            except DeepReduceError as exc:   # named as decode_sum names it
                raise type(exc)(f"rank {rank}: {exc}") from exc
        return found

    def _count_decoded(self, containers: int, start: float) -> None:
        stats = self.pipeline.stats
        stats.tensors_decoded += containers
        stats.decode_seconds += time.perf_counter() - start

    def _owner_residual(self, name: str, lo: int, hi: int, numel: int) -> "OwnerResidual":
        """``name``'s owner residual over ``[lo, hi)`` (zeros the first time). Phase one's encode
        (:meth:`_align_owner_residual`) has moved it onto this step's shard already."""
        owner = self._owner_residuals.get(name)
        if owner is None or not owner.covers(lo, hi):
            owner = self._owner_residuals[name] = OwnerResidual(lo, np.zeros(hi - lo, np.float32), numel)
        return owner

    def _align_owner_residual(self, name: str, flat: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Move ``name``'s owner residual onto the shard ``[lo, hi)`` when its bounds moved (or
        a checkpoint was loaded): the part inside stays, the mass outside is added to (a copy
        of) ``flat``, sent on with this rank's contribution. Returns what to encode."""
        owner = self._owner_residuals.get(name)
        if owner is None or owner.covers(lo, hi):
            return flat
        kept = np.zeros(hi - lo, np.float32)
        start, stop = max(lo, owner.lo), min(hi, owner.hi)
        stranded = owner.values.copy()
        if start < stop:
            kept[start - lo:stop - lo] = owner.values[start - owner.lo:stop - owner.lo]
            stranded[start - owner.lo:stop - owner.lo] = 0.0
        self._owner_residuals[name] = OwnerResidual(lo, kept, flat.shape[0])
        if not stranded.any():
            return flat
        moved = flat.astype(np.float32, copy=True)
        moved[owner.lo:owner.hi] += stranded
        return moved

    def _owner_step(self, payloads: List[np.ndarray], owner: "OwnerResidual", m: int,
                    name: str, step: int, numel: int) -> np.ndarray:
        """Add each rank's entries of this rank's shard (``m`` elements of a tensor of ``numel``),
        in rank order, into its owner residual, re-select there, encode the selection and keep the
        rest: the residual is the owner's only dense array of the shard (no decoded copy of the
        sum), and each change to it is journaled as the old values at the positions it touches
        (:meth:`undo`). A warm-up step or a tensor below ``min_numel`` sends the sum dense."""
        if agreement.first_nonfinite(payloads) is not None:   # a rank sent NaN/Inf: the sum goes on flagged
            return self._flagged_sum(payloads, m)
        values = owner.values
        written = []
        for positions, added in self.shard_entries(payloads, m):
            old = values[positions]
            with np.errstate(over="ignore"):   # an overflow is handled below
                new = old + added
            if not np.isfinite(new).all():   # finite entries whose sum with the residual overflows float32
                for at, kept in reversed(written):
                    values[at] = kept
                if self.pipeline.nonfinite == "raise":
                    self.pipeline.decode_sum(payloads, expected_shape=(m,))   # the core's error, if the sum itself overflows
                    raise NonFiniteGradientError(f"sparse_allreduce of {name!r} at step {step}: the ranks' finite "
                                                 "entries and the owner residual overflow float32 when added "
                                                 "(pipeline option nonfinite='raise')")
                return self._flagged_sum(payloads, m)
            values[positions] = new
            written.append((positions, old))
        for positions, old in written:
            self._edit(name, owner, positions, old)
        if self.pipeline.warming_up(step) or numel < self.pipeline.min_numel:   # the shards came dense: so goes the sum
            self._edit(name, owner, None, values.copy())
            total = values.copy()
            values[:] = 0.0
            return shards.encode_dense(self.pipeline, total)
        if self.reselect == "none":
            chosen = kernels.nonzero(values, self.pipeline.threads)
        elif self.per_chunk is not None:   # the senders' k in every chunk of the shard
            chosen = chunk_topk_positions(values, self.chunk, self.per_chunk, self.pipeline.threads)
        else:
            chosen = kernels.topk_positions(values, count_for(self.ratio, m), self.pipeline.threads)
        payload, sent, received = shards.encode_owned(self.pipeline, values, chosen, f"{name}#owner", step)
        self._edit(name, owner, sent, values[sent])
        kernels.subtract_at(values, sent, received)
        return payload

    def _flagged_sum(self, payloads: List[np.ndarray], m: int) -> np.ndarray:
        """The shard's sum, sent dense and flagged: a rank sent NaN/Inf, or the sum overflows
        (``propagate``); every rank then sees the flag."""
        total = np.zeros(m, np.float32)
        for payload in payloads:   # decoded one by one: decode_sum refuses a non-finite sum under raise
            total += self.pipeline.decode(payload, expected_shape=(m,)).reshape(-1)
        return shards.encode_dense(self.pipeline, total, flagged=True)

    def _edit(self, name: str, owner: "OwnerResidual", positions: Optional[np.ndarray], old: np.ndarray) -> None:
        """Journal ``old``, the values of ``owner`` at ``positions`` (None: all of them), before they change."""
        entry = self._journal.get(name)
        if entry is not None:
            entry[2].append((owner, positions, old))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Owner residuals (each as a whole tensor's float32 array, zero outside the shard it
        covers) and shard boundaries, per tensor (copies)."""
        return {"owner_residuals": {n: self.owner_residual(n) for n in self._owner_residuals},
                "bounds": {n: b.copy() for n, b in self._bounds.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; errors name a malformed entry."""
        if not isinstance(state, dict) or set(state) != {"owner_residuals", "bounds"}:
            raise ConfigError("sparse_allreduce: checkpoint state must be {'owner_residuals': ..., 'bounds': ...}")
        residuals, bounds = {}, {}
        for name, r in state["owner_residuals"].items():
            r = np.asarray(r)
            if r.dtype != np.float32 or r.ndim != 1 or not np.isfinite(r).all():
                raise ConfigError(f"sparse_allreduce: owner residual of {name!r} must be a finite 1-D float32 array")
            residuals[name] = OwnerResidual(0, r.copy(), r.shape[0])   # moved onto the shard by the next encode
        for name, b in state["bounds"].items():
            b = np.asarray(b, dtype=np.int64)
            if b.ndim != 1 or b.shape[0] != self.communicator.size + 1 or b[0] != 0 or np.any(np.diff(b) < 0):
                raise ConfigError(f"sparse_allreduce: shard bounds of {name!r} must rise from 0 in "
                                  f"{self.communicator.size + 1} steps")
            bounds[name] = b.copy()
        self._owner_residuals, self._bounds = residuals, bounds

    def owner_residual(self, name: str) -> Optional[np.ndarray]:
        """The owner residual held for ``name`` as a whole tensor's float32 array (a new one,
        non-zero only inside the shard it covers), or None."""
        owner = self._owner_residuals.get(name)
        return None if owner is None else owner.whole()

    def state_bytes(self) -> int:
        """Bytes this object holds between steps: the owner residuals and the shard bounds."""
        return sum(o.values.nbytes for o in self._owner_residuals.values()) \
            + sum(b.nbytes for b in self._bounds.values())



class OwnerResidual:
    """One tensor's owner residual: ``values`` over the elements ``[lo, lo + len(values))`` of a
    tensor of ``numel`` (the shard it covers; the whole tensor after a checkpoint load)."""

    __slots__ = ("lo", "values", "numel")

    def __init__(self, lo: int, values: np.ndarray, numel: int) -> None:
        self.lo, self.values, self.numel = int(lo), values, int(numel)

    @property
    def hi(self) -> int:
        return self.lo + int(self.values.shape[0])

    def covers(self, lo: int, hi: int) -> bool:
        return self.lo == lo and self.hi == hi

    def copy(self) -> "OwnerResidual":
        return OwnerResidual(self.lo, self.values.copy(), self.numel)

    def whole(self) -> np.ndarray:
        out = np.zeros(self.numel, np.float32)
        out[self.lo:self.hi] = self.values
        return out

@dataclass
class Phase:
    """One tensor's sparse all-reduce between its phases: its shard bounds, this rank's shard
    ``[lo, hi)``, and the collective in flight (``pending``)."""

    name: str
    step: int
    numel: int
    bounds: np.ndarray
    lo: int
    hi: int
    sent: Optional[List[np.ndarray]] = None   # phase one's container per shard, until send()
    error: Optional[BaseException] = None     # this rank's owner step raised it (complete raises it)


@dataclass
class Batch:
    """The tensors whose shard exchanges share one collective per phase (:meth:`SparseAllreduce.send`):
    their phases in the order every rank sends them, the collective in flight (``pending``), and
    once phase three waited, each rank's shard containers cut per tensor (``shards``)."""

    phases: List[Phase]
    name: str
    pending: object = None
    shards: Optional[List[List[np.ndarray]]] = None


def fuse(containers: List[np.ndarray]) -> np.ndarray:
    """One payload for several containers bound to the same rank: the length of each container as
    an unsigned LEB128 varint (:mod:`deepreduce.wire.varint`: one byte below 128, two below 16,384;
    every peer receives this table once per tensor and phase, so its size grows with the ranks),
    then the containers end to end (any of them may be empty). One container is sent as it is (the
    payload of a batch of one is the container, as before batches)."""
    if len(containers) == 1:
        return containers[0]
    parts = [np.ascontiguousarray(c, dtype=np.uint8).reshape(-1) for c in containers]
    table = np.frombuffer(b"".join(varint.encode(p.shape[0]) for p in parts), dtype=np.uint8)
    return np.concatenate([table, *parts])


def cut(payload, count: int, where: str) -> List[np.ndarray]:
    """The ``count`` containers of a :func:`fuse` payload, as views of it; a table that does not
    describe the payload exactly is a CommunicationError naming ``where``."""
    if count == 1:
        return [payload]
    data = np.asarray(failure.on_host(payload), dtype=np.uint8).reshape(-1)
    head = bytes(data[:varint.MAX_BYTES * count])
    lengths, at = [], 0
    try:
        for _ in range(count):
            length, at = varint.decode(head, at, "container length")
            lengths.append(length)
    except ContainerError as exc:
        raise CommunicationError(f"{where}: {data.shape[0]} bytes do not hold the lengths of {count} containers "
                                 f"({exc})") from exc
    if sum(lengths) != data.shape[0] - at:
        raise CommunicationError(f"{where}: the lengths of {count} containers add up to {sum(lengths)} "
                                 f"bytes, {data.shape[0] - at} arrived")
    out = []
    for length in lengths:
        out.append(data[at:at + length])
        at += length
    return out


def even_bounds(numel: int, ranks: int) -> np.ndarray:
    """``ranks + 1`` boundaries cutting ``[0, numel)`` into shards of (nearly) equal length."""
    return (np.arange(ranks + 1, dtype=np.int64) * numel) // ranks


def chunk_bounds(numel: int, ranks: int, chunk: int) -> np.ndarray:
    """``ranks + 1`` boundaries at multiples of ``chunk`` (and ``numel``): the ``ceil(numel /
    chunk)`` chunks, the tail one included, dealt out so that shard ``j`` holds chunks
    ``[j c // ranks, (j + 1) c // ranks)``. With fewer chunks than ranks some shards are empty.
    A function of its arguments alone, so every rank computes the same."""
    count = -(-numel // chunk)
    return np.minimum((np.arange(ranks + 1, dtype=np.int64) * count) // ranks * chunk, numel).astype(np.int64)


def balanced_bounds(positions: np.ndarray, numel: int, ranks: int) -> np.ndarray:
    """Boundaries putting about the same number of ``positions`` (ascending) in every shard;
    even bounds when there are fewer positions than ranks."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.shape[0] < ranks:
        return even_bounds(numel, ranks)
    cuts = positions[(np.arange(1, ranks, dtype=np.int64) * positions.shape[0]) // ranks]
    return np.concatenate([[0], np.maximum.accumulate(cuts), [numel]]).astype(np.int64)
