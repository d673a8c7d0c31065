"""DeepReduce = memory + sparsifier + index codec + value codec (+ reorder), one container out.

Encode: compensate with the error-feedback residual, select entries, let the index codec
choose and compress the positions, let the value codec compress the values, carry a
permutation when the value codec reorders and the index codec cannot follow, pack one
container. Decode reads everything it needs from the container header, so any rank decodes
any rank's payload.

``encode`` is made of stages that are public too (save_state, compensate, select,
pack_selection, settle, pack; entries_of on the decode side): a route that encodes otherwise
writes its encode from them beside itself (the sparse all-reduce's shards in
``deepreduce.collective.shards``, a sparse gradient's entries in
``deepreduce.collective.routes.entries``), so nothing here knows how a container travels.
Whether the C++ pipeline runs this config is decided here once (:meth:`Pipeline.native_reason`).
"""
from __future__ import annotations

import math
import struct
import time
import zlib
from typing import Optional, Sequence

import numpy as np

from . import registry
from .backend import arrays, kernels, native_pipeline, parallel
from .backend.deferred_checks import DeferredChecks
from .errors import (
    CommunicationError,
    ConfigError,
    ContainerError,
    DeepReduceError,
    NonFiniteGradientError,
    quote,
)
from .index import IndexCodec
from .index import bloom as bloom_codec
from .journal import StepJournal
from .memory import Compensated, Memory
from .sparsify import Sparsifier
from .stats import CompressionStats
from .values import ValueCodec
from .wire import bitpack, container
from .wire.own_containers import OwnContainers
from .wire.seeding import EncodeContext, config_digest

NONFINITE_POLICIES = ("propagate", "raise")
_STATEFUL_PARTS = ("sparsifier", "index", "value", "memory")
DEFAULT_MIN_NUMEL = 1000
#: What a decoder may raise on bad bytes that is not yet a DeepReduceError (re-raised as one).
_DECODE_ERRORS = (ValueError, IndexError, OverflowError, TypeError, KeyError, ArithmeticError,
                  RuntimeError, struct.error, zlib.error)


class Pipeline:
    """One configured DeepReduce instance; holds per-tensor state (residuals) and statistics.

    Args:
        sparsifier, index, value, memory: built components (see ``deepreduce.build``).
        communicator: optional communicator component used by the training integrations.
        aggregation: optional aggregation component (``deepreduce.collective.aggregation``): how the
            integrations combine the ranks' containers (default: allgather).
        min_numel: tensors with fewer elements travel dense (float32) in the container.
        threads: threads of the C++ kernels (a positive int, or "auto": this host's usable CPUs
            divided by its ranks; see ``deepreduce.backend.parallel``); never changes a byte.
        nonfinite: ``"propagate"`` sends a tensor holding NaN/Inf dense and unchanged, so the
            receiver (and an AMP loss scaler) sees it; ``"raise"`` refuses it with
            NonFiniteGradientError (in the distributed integrations on every rank together,
            see :meth:`collective_steps`).
        max_numel: the most elements a received container may claim when ``decode`` is given
            no expected shape (the integrations always pass the parameter's shape); a receiver
            setting, it never changes a byte (docs/reliability.md).
        warmup: the number of first steps (``step < warmup``, the step the bindings pass and
            checkpoint) in which every tensor travels losslessly, see :meth:`warming_up`.
    """

    def __init__(self, sparsifier: Sparsifier, index: IndexCodec, value: ValueCodec, memory: Memory,
                 communicator=None, min_numel: int = DEFAULT_MIN_NUMEL, nonfinite: str = "propagate",
                 threads: parallel.ThreadsOption = parallel.AUTO,
                 max_numel: int = container.MAX_NUMEL, aggregation=None, warmup: int = 0) -> None:
        check_numel_option("pipeline", "min_numel", min_numel, 0)
        check_warmup("pipeline", warmup)
        check_numel_option("pipeline", "max_numel", max_numel, 1)
        if nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"pipeline: 'nonfinite' is {nonfinite!r}; allowed: {', '.join(NONFINITE_POLICIES)}")
        self.sparsifier = sparsifier
        self.index = index
        self.value = value
        self.value.reorder_is_free = bool(index.keeps_order)
        # a sparsifier class that defines fused_count has its selection done by the compensation pass
        self._fuses_selection = hasattr(type(sparsifier), "fused_count")
        self.memory = memory
        self.communicator = communicator
        self.aggregation = aggregation
        self.min_numel = min_numel
        self.max_numel = max_numel
        self.warmup = warmup
        self.nonfinite = nonfinite
        self.threads_option = parallel.check_threads(threads, "pipeline")
        self.threads = parallel.resolve_threads(self.threads_option)
        for component in (sparsifier, index, value):
            component.threads = self.threads
        self.stats = CompressionStats()
        wire_config = self.get_config()
        wire_config.pop("communicator", None)
        wire_config.pop("aggregation", None)   # how containers travel never changes their bytes
        wire_config.pop("threads")  # threads and the receiver's bound never change a byte
        wire_config.pop("max_numel")
        if not warmup:
            wire_config.pop("warmup")   # configs without a warm-up keep the digest they always had
        self._digest = config_digest(wire_config)
        self._wire_digest = self._digest[:container.DIGEST_SIZE]   # what each container carries
        self._decoders = {("index", index.wire_id): index, ("value", value.wire_id): value}
        self._journal = None     # a StepJournal once collective_steps() is on
        self._own = OwnContainers()   # this rank's last containers, added to sums without decoding
        self._native_reason = None     # why the C++ pipeline cannot run this config ("": it can), on first use
        self._native_settings = None   # the C++ pipeline's settings of this config, on first use

    # ------------------------------------------------------------------ config
    def get_config(self) -> dict:
        """The config dict that rebuilds an equal pipeline with ``deepreduce.build``."""
        config = {
            "sparsifier": self.sparsifier.get_config(),
            "index": self.index.get_config(),
            "value": self.value.get_config(),
            "memory": self.memory.get_config(),
            "min_numel": self.min_numel,
            "nonfinite": self.nonfinite,
            "threads": self.threads_option,
            "max_numel": self.max_numel,
            "warmup": self.warmup,
        }
        if self.communicator is not None:
            config["communicator"] = self.communicator.get_config()
        if self.aggregation is not None:
            config["aggregation"] = self.aggregation.get_config()
        return config

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and self.get_config() == other.get_config()

    def __repr__(self) -> str:
        return f"Pipeline({self.get_config()!r})"

    @property
    def config_digest(self) -> bytes:
        """16-byte digest of the wire config (no communicator): equal on ranks that agree."""
        return self._digest

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What this pipeline learned while encoding: error-feedback residuals and the
        components' adaptive state (e.g. SIDCo stage counts), keyed by component.

        Plain Python values and NumPy arrays; ``load_state_dict`` on a pipeline built from the
        same config makes its next containers byte-identical to this one's.
        """
        return {"config_digest": self._digest.hex(),
                **{kind: getattr(self, kind).state_dict() for kind in _STATEFUL_PARTS}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; refuses a checkpoint of another config."""
        expected = {"config_digest", *_STATEFUL_PARTS}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"pipeline checkpoint must have the keys {sorted(expected)}, got {got}")
        if state["config_digest"] != self._digest.hex():
            raise ConfigError("pipeline checkpoint was saved by a pipeline with another config "
                              f"(digest {quote(state['config_digest'])}, this pipeline {self._digest.hex()})")
        before = {kind: getattr(self, kind).state_dict() for kind in _STATEFUL_PARTS}
        try:
            for kind in _STATEFUL_PARTS:
                getattr(self, kind).load_state_dict(state[kind])
        except Exception:   # a part refused its state: none of the checkpoint is applied
            for kind in _STATEFUL_PARTS:
                getattr(self, kind).load_state_dict(before[kind])
            raise

    def warming_up(self, step: int) -> bool:
        """Whether ``step`` is one of the config's ``warmup`` first steps, which send every tensor
        losslessly: dense (a sparse gradient too), the residual emptied.

        The dense warm-up of DGC (Lin et al., 2018) and Ok-Topk (Li and Hoefler, 2022): early
        gradients change fast and an adaptive optimizer (Adam) builds its moment estimates from
        them, so a sparsifier's error feedback, which delays most entries by many steps, costs
        most there. Every rank passes the same step, so every rank switches at the same step.
        """
        return step < self.warmup

    def context(self, name: str, step: int) -> EncodeContext:
        """The seeding context for one (tensor, step): the same on every rank."""
        return EncodeContext(self._digest, name, step)

    # ------------------------------------------------------------------ steps decided by every rank
    def collective_steps(self, spare_buffers: bool = True) -> None:
        """Let the ranks decide together whether a step is applied (the distributed integrations
        turn this on; see :mod:`deepreduce.collective.agreement`).

        Under ``nonfinite: raise``, :meth:`encode` then packs a non-finite gradient in the
        flagged dense container instead of raising, so it reaches every rank and every rank
        raises the same error. Under either policy each step's changes to the residuals and
        learned state are kept until :meth:`commit_step` (the step was applied) or
        :meth:`undo_step` (every rank raised: a non-finite gradient under ``raise``, or an error
        caught on some rank under either policy), so a step that raises leaves every residual as
        it was before it: what a rank compressed away that step is not lost with the step.

        Keeping a residual costs no copy: the step writes its compensation into a second buffer
        (``Memory.step_buffers``). ``spare_buffers``: keep that buffer from step to step (no
        allocation per step, twice the residuals' memory: right where a step holds every residual
        at once, as the optimizer and the DDP hook do); False allocates it per step and frees the
        old residual at commit (FSDP's per-module steps and DiLoCo's rare outer steps, where
        persistent memory is what the user budgets).
        """
        self.memory.retain_spares = spare_buffers
        if self._journal is None:
            self._journal = StepJournal(self)

    @property
    def journaling(self) -> bool:
        """Whether a step's changes wait for :meth:`commit_step` or :meth:`undo_step`
        (:meth:`collective_steps` is on)."""
        return self._journal is not None

    def commit_step(self) -> None:
        """Every rank applied the step: its changes stay (no-op unless :meth:`collective_steps`).
        Its own containers are dropped: the step's sums are done, and holding them until the
        next step would keep a copy of every container between steps (memory FSDP budgets)."""
        self._own.clear()
        if self._journal is not None:
            self._journal.commit()

    def undo_step(self) -> None:
        """Every rank skipped the step: restore the residuals and learned state from before it."""
        self._own.clear()
        if self._journal is not None:
            self._journal.undo()

    # ------------------------------------------------------------------ encode
    def encode(self, grad, name: str = "", step: int = 0, select=None) -> np.ndarray:
        """Compress one gradient into a container (1-D uint8 array).

        ``select(compensated, ctx) -> ascending int64 positions`` replaces the sparsifier's own
        NumPy selection; framework bindings pass their native implementation of the same
        sparsifier (it must choose the same positions).

        With error feedback, the memory's residual absorbs the gradient in place and is what
        the sparsifier reads; after encoding, what the receiver reconstructs (the value codec's
        by-product) is taken out of it at the positions it lands on. The stages below, in order.
        """
        start = time.perf_counter()
        flat, shape = as_flat_float32(grad, name)
        on_torch = arrays.is_torch(flat)
        numel = flat.shape[0]
        sparse = numel >= self.min_numel and not self.warming_up(step)
        comp = self.compensate(flat, name, selecting=sparse and select is None)
        if not comp.finite:
            if self.nonfinite == "raise" and self._journal is None:
                xp = arrays.namespace(flat)
                nan, inf = int(xp.sum(xp.isnan(flat))), int(xp.sum(xp.isinf(flat)))
                raise NonFiniteGradientError(
                    f"gradient {name!r} at step {step} has {nan} NaN and {inf} Inf entries "
                    "(pipeline option nonfinite='raise')"
                )
            c = dense_container(flat, shape, nonfinite=True)
        elif not sparse:
            if self.memory.stateful and not all_finite(comp.flat):
                c = self._overflowed(comp, shape, name, step)
            else:
                c = dense_container(comp.flat, shape)
                self.settle(name)
        else:
            try:
                ctx = self.context(name, step)
                c, positions, received = self.pack_selection(comp.flat, self.select(comp, ctx, select), ctx, shape)
                self.settle(name, positions, received)
            except CompensationOverflow:
                c = self._overflowed(comp, shape, name, step)
        payload = self.pack([c], start, like=flat)[0]
        if sparse and comp.finite and not c.flags & container.FLAG_NONFINITE and not on_torch:
            self._own.remember(name, payload, shape, positions, received, ascending=not self.index.keeps_order)
        return payload

    def _overflowed(self, comp, shape, name: str, step: int) -> container.Container:
        """A finite gradient whose error-feedback compensation is not finite (a residual plus
        gradient beyond float32's range): nothing non-finite leaves unflagged. Under ``raise``
        outside a collective step it is refused; otherwise the compensated tensor travels dense
        and flagged (every rank then sees it, and skips the step under ``raise``), and the
        residual starts again from zero (a skipped step restores it)."""
        self.refuse_overflow(name, step)
        c = dense_container(comp.flat, shape, nonfinite=True)
        self.settle(name)   # comp.flat is the residual: zeroed once it is packed
        return c

    # ------------------------------------------------------------------ stages
    # What encode is made of, for the routes that encode otherwise (one container per shard of
    # a tensor, a sparse gradient's entries, the sparse all-reduce owner's re-selection):
    # save_state -> compensate -> select -> pack_selection (of the whole selection or of a slice
    # of it) -> settle the residual with what was sent -> pack. Each route writes its own
    # encode from these (deepreduce.collective.shards, deepreduce.collective.routes.entries).
    def save_state(self, name: str) -> None:
        """Keep ``name``'s residual and learned state as they are before a stage changes them,
        for :meth:`undo_step` (under :meth:`collective_steps`; otherwise nothing to keep)."""
        if self._journal is not None:
            self._journal.save(name)

    def compensate(self, flat, name: str, selecting: bool = False) -> Compensated:
        """Error feedback's first half: ``name``'s residual absorbs the flat float32 ``flat``
        (:meth:`save_state` first). ``selecting``: the sparsifier's own selection of this host
        array follows, so a sparsifier that fuses it into this pass (``fused_count``) selects here."""
        self.save_state(name)
        fused = selecting and self._fuses_selection and not arrays.is_torch(flat)
        return self.memory.accumulate(name, flat, self.sparsifier.fused_count(flat.shape[0]) if fused else 0,
                                      self.threads)

    def select(self, comp: Compensated, ctx: EncodeContext, select=None):
        """The ascending positions of ``comp.flat`` to send: ``select(flat, ctx)`` when given, the
        positions the compensation pass selected, or the sparsifier's choice."""
        if select is not None:
            return select(comp.flat, ctx)
        if comp.selected is not None:  # selected by the compensation pass (``fused_count``)
            return comp.selected
        return select_positions(self.sparsifier, comp.flat, ctx)

    def pack_selection(self, flat, positions, ctx: EncodeContext, shape=None, values=None):
        """``(container, the positions it sends, the values receivers reconstruct there)`` for
        the ascending ``positions`` of the flat float32 ``flat`` (a tensor of ``shape``, default
        flat), through the index and value codecs. A slice of a selection is packed as the
        tensor ``flat[lo:hi]`` with ``positions - lo``. ``values``: the values at ``positions``
        when ``flat`` does not hold them (a sparse gradient's entries; ``flat`` is then what the
        index codec may read). Nothing is settled or counted; the container is not yet packed
        (:meth:`pack`). CompensationOverflow when error feedback's values are not finite."""
        on_torch = arrays.is_torch(flat)
        shape = (flat.shape[0],) if shape is None else shape
        values = flat[positions] if values is None else values
        perm_width, perm_section = 0, b""
        if on_torch:
            index_encode, value_encode = _runner(self.index, flat), _runner(self.value, flat)
        else:   # NumPy: every codec's own encode
            index_encode, value_encode = self.index.encode, self.value.encode
        if self.memory.stateful and not all_finite(values):
            raise CompensationOverflow(f"{len(values)} selected values include NaN/Inf")
        if self.index.keeps_order:
            venc = value_encode(values, ctx)
            sent = positions
            if venc.order is not None:
                positions = positions[venc.order]
            ienc = index_encode(positions, values if venc.order is None else values[venc.order], flat, ctx)
        else:
            ienc = index_encode(positions, values, flat, ctx)
            if self.memory.stateful and not all_finite(ienc.values):   # false positives of a filter
                raise CompensationOverflow(f"{len(ienc.values)} values at the index codec's positions include NaN/Inf")
            venc = value_encode(ienc.values, ctx)
            sent = ienc.indices
            if venc.order is not None and len(ienc.indices):
                perm_width = bitpack.width_for(len(ienc.indices) - 1)
                perm_section = bitpack.pack(arrays.adapter(venc.order).to_numpy(venc.order), perm_width)
        received = self.value.reconstruct(venc, len(sent))
        c = container.Container(
            shape=shape, n=len(ienc.indices), index_id=self.index.wire_id, value_id=self.value.wire_id,
            flags=container.FLAG_PERMUTED if perm_width else 0, perm_width=perm_width,
            index_params=ienc.params, value_params=venc.params,
            index_section=ienc.payload, value_section=venc.payload, perm_section=perm_section,
        )
        return c, sent, received

    def settle(self, name: str, positions=None, received=None) -> None:
        """Error feedback's second half: take what the receivers reconstruct (``received`` at the
        distinct ``positions``) out of ``name``'s residual; no positions: all of it was sent."""
        self.memory.settle(name, positions, received, self.threads)

    def refuse_overflow(self, name: str, step: int) -> None:
        """Raise NonFiniteGradientError for a compensation that overflows float32 when the policy
        refuses it here (``nonfinite: raise`` outside :meth:`collective_steps`); otherwise the
        caller sends it dense and flagged (:func:`dense_container`)."""
        if self.nonfinite == "raise" and self._journal is None:
            raise NonFiniteGradientError(f"gradient {name!r} at step {step}: adding the error-feedback residual "
                                         "overflows float32 (pipeline option nonfinite='raise')")

    def pack(self, parts: Sequence[container.Container], start: Optional[float] = None, like=None) -> list:
        """The containers ``parts`` as bytes, each stamped with this config's digest (it names the
        sender's config; agreement compares configs up front). ``start`` (``time.perf_counter()``
        when their encode began): each is counted in :attr:`stats` with an equal share of the
        time since. ``like``: a torch tensor assembles them on its device."""
        payloads = []
        for c in parts:
            c.digest = self._wire_digest
            payloads.append(container.pack(c, like=like))
        if start is not None:
            seconds = (time.perf_counter() - start) / max(1, len(parts))
            for c, payload in zip(parts, payloads):
                self.count_encoded(payload.shape[0], c.numel, len(c.index_section), len(c.value_section),
                                   len(c.perm_section), seconds)
        return payloads

    def entries_of(self, payload, expected_shape: Sequence[int], count: bool = True):
        """The entries of one container, without a dense tensor: (ascending distinct flat
        positions, float32 values); a dense container's non-zeros. Checked as :meth:`decode`
        checks, counted in :attr:`stats` as one decode (``count``: a container read again, after
        its decode, is not)."""
        start = time.perf_counter()
        shape = tuple(int(n) for n in expected_shape)
        c = self._unpack(payload, shape)
        if c.dense:
            dense = np.frombuffer(c.value_section, dtype="<f4")
            _check_finite(c, dense, "dense section")
            positions = np.flatnonzero(dense)
            values = dense[positions]
        else:
            lookup = np.broadcast_to(np.float32(0), (c.numel,))   # shape and namespace only: no memory
            positions, values, _ = self._entries(c, lookup)
            positions, values = _distinct_in_bounds(np.asarray(positions, dtype=np.int64), np.asarray(values),
                                                    c.numel)
        if count:
            self.stats.tensors_decoded += 1
            self.stats.decode_seconds += time.perf_counter() - start
        return positions, values.astype(np.float32, copy=False)

    # ------------------------------------------------------------------ the C++ pipeline
    def native_reason(self) -> Optional[str]:
        """Why this config's stages cannot run in the C++ pipeline (csrc/pipeline), None when
        they can: the one rule every caller asks (the sparse all-reduce's encode and decode, the
        TensorFlow ops). Decided once: the components never change."""
        if self._native_reason is None:
            self._native_reason = _native_reason(self)
        return self._native_reason or None

    @property
    def native(self):
        """The C++ pipeline module (``deepreduce._pipeline``) when it runs this config and is
        available (built, and ``DEEPREDUCE_BACKEND`` is not ``numpy``), else None."""
        return native_pipeline.module() if self.native_reason() is None else None

    @property
    def native_settings(self) -> dict:
        """This config's settings as the C++ pipeline takes them (computed once; only asked
        when :meth:`native_reason` is None)."""
        if self._native_settings is None:
            self._native_settings = _native_settings(self)
        return self._native_settings

    # ------------------------------------------------------------------ decode
    def decode(self, payload, expected_shape: Optional[Sequence[int]] = None,
               out: Optional[np.ndarray] = None) -> np.ndarray:
        """Reconstruct the dense float32 tensor a container describes.

        ``expected_shape`` (optional) is checked against the header before anything is
        allocated, so a rank that sent a tensor of another shape under the same name is reported,
        not silently mis-summed; without it, a header claiming more than ``max_numel`` elements
        is refused. A container without the non-finite flag whose values are NaN/Inf is refused.
        ``out`` (optional): a C-contiguous float32 array of the tensor's size to write into
        (overwritten); otherwise a fresh array is returned.
        """
        start = time.perf_counter()
        c = self._unpack(payload, expected_shape, like=out)
        target = _output(out, c.numel)
        checks = DeferredChecks() if arrays.is_torch(target) else None
        self._decode_into(c, target, accumulate=out is None, checks=checks)  # a fresh buffer is all zeros
        if checks is not None:
            checks.settle()
        self.stats.tensors_decoded += 1
        self.stats.decode_seconds += time.perf_counter() - start
        return target.reshape(c.shape)

    def decode_sum(self, payloads: Sequence, expected_shape: Optional[Sequence[int]] = None,
                   out: Optional[np.ndarray] = None) -> np.ndarray:
        """Sum of the tensors in several containers (one per rank), checked for equal shapes.

        Every container is decoded straight into one float32 buffer (``out``, overwritten, or a
        fresh array): sparse containers are scatter-added, dense ones added in place, so no
        per-rank dense tensor is ever allocated. Into a torch ``out`` the containers' checks
        are read back together at the end (:mod:`deepreduce.backend.deferred_checks`), and a
        container that is a tensor on ``out``'s device is decoded from its own sections there.
        """
        if len(payloads) == 0:
            raise CommunicationError("no containers to decode")
        target = None
        host = not arrays.is_torch(out)   # this rank's own containers are kept for the host path
        checks = None if host else DeferredChecks()
        for rank, payload in enumerate(payloads):
            start = time.perf_counter()
            try:
                own = self._own.match(payload) if host else None
                if own is not None:   # this rank's container: what it decodes to is known
                    if not isinstance(expected_shape, tuple) or expected_shape != own.shape:   # else it fits
                        container.check_size(own.shape, own.positions.shape[0], expected_shape, self.max_numel)
                    if target is None:
                        target, expected_shape = _output(out, math.prod(own.shape)), own.shape
                    self._add_own(own, target, accumulate=rank > 0 or out is None,
                                  check_sum=rank > 0 and self.nonfinite == "raise")
                else:
                    c = self._unpack(payload, expected_shape, like=out)
                    if target is None:
                        target, expected_shape = _output(out, c.numel), c.shape
                    if checks is not None:
                        checks.context = f"rank {rank}: "
                    self._decode_into(c, target, accumulate=rank > 0 or out is None,
                                      check_sum=rank > 0 and self.nonfinite == "raise", checks=checks)
            except DeepReduceError as exc:
                if checks is not None:   # an earlier container's deferred failure is the first error
                    checks.settle()
                raise type(exc)(f"rank {rank}: {exc}") from exc
            self.stats.tensors_decoded += 1
            self.stats.decode_seconds += time.perf_counter() - start
        if checks is not None:
            start = time.perf_counter()
            checks.settle()
            self.stats.decode_seconds += time.perf_counter() - start
        return target.reshape(expected_shape)

    def _unpack(self, payload, expected_shape, like=None) -> container.Container:
        """The parsed container; its sections stay on ``like``'s device when the payload is a
        tensor there (:func:`deepreduce.wire.container.unpack`)."""
        return container.unpack(payload, expected_shape, self.max_numel,
                                sections_like=like if arrays.is_torch(like) else None)

    def _codec(self, kind: str, wire_id: int):
        key = (kind, wire_id)
        codec = self._decoders.get(key)
        if codec is None:
            codec = self._decoders[key] = registry.by_wire_id(kind, wire_id)()
            codec.threads = self.threads
        return codec

    def _decode_into(self, c: container.Container, out: np.ndarray, accumulate: bool,
                     check_sum: bool = False, checks: Optional[DeferredChecks] = None) -> None:
        """Add (``accumulate``) or write the container's tensor into the flat float32 ``out``
        (adding into a fresh all-zero buffer spares a pass that would zero it again).

        ``check_sum`` (decode_sum with ``nonfinite='raise'``): finite values whose sum overflows
        float32 raise NonFiniteGradientError (checked at the n positions written); with
        ``'propagate'`` the sum is Inf there, as a float32 allreduce would give.

        Validity checks cost O(n): index bounds, and distinct indices (strictly ascending where
        the index codec decodes to the ascending set, else on a sorted copy of the n indices).
        ``checks`` (torch ``out``): they are recorded there, read by the caller.
        """
        a = arrays.adapter(out)
        if c.dense:
            dense = a.from_section(c.value_section, "<f4", out)
            _check_finite(c, dense, "dense section", checks)
            if accumulate:
                out += dense
            else:
                out[...] = dense
            if check_sum:
                _expect_finite(out, _sum_overflow, checks)
            return
        indices, values, keeps_order = self._entries(c, out, checks)
        if not accumulate:
            out[...] = 0.0
        written = kernels.scatter_add(out, indices, values, not keeps_order, self.threads, checks)
        if check_sum:
            _expect_finite(out[written], _sum_overflow, checks)

    def _entries(self, c: container.Container, out, checks: Optional[DeferredChecks] = None):
        """(positions, values in index order, whether the index codec kept the sender's order) of
        a sparse container, decoded like ``out`` (NumPy, or torch on its device) and checked:
        counts, finiteness, the permutation. ``out.shape[0]`` is the tensor's element count."""
        on_torch = arrays.is_torch(out)
        a = arrays.adapter(out)
        index_codec, value_codec = self._codec("index", c.index_id), self._codec("value", c.value_id)
        numel = out.shape[0]   # the header's element count (decode_sum checked the shapes)
        try:
            if on_torch:
                indices = _decoded(index_codec, out, c.index_section,
                                   lambda section: index_codec.decode(c.index_params, section, c.n, numel))
                values = _decoded(value_codec, out, c.value_section,
                                  lambda section: value_codec.decode(c.value_params, section, c.n))
            else:
                indices = index_codec.decode(c.index_params, c.index_section, c.n, numel)
                values = value_codec.decode(c.value_params, c.value_section, c.n)
        except DeepReduceError:
            raise
        except _DECODE_ERRORS as exc:
            raise ContainerError(f"container sections could not be decoded: {type(exc).__name__}: {exc}") from exc
        if len(indices) != c.n or len(values) != c.n:
            raise ContainerError(
                f"container decoded to {len(indices)} indices and {len(values)} values, header says {c.n}"
            )
        _check_finite(c, values, "values", checks)
        if c.permuted:  # value j belongs to indices[perm[j]]: put the values in index order
            perm = bitpack.unpack(c.perm_section, c.perm_width, c.n).astype(np.int64)
            if c.n and (perm.max() >= c.n or np.bincount(perm, minlength=c.n).max() != 1):
                raise ContainerError("container permutation section is not a permutation")
            in_index_order = arrays.namespace(values).empty_like(values)
            in_index_order[a.from_numpy(perm, out)] = values
            values = in_index_order
        return indices, values, index_codec.keeps_order

    def _add_own(self, own, out: np.ndarray, accumulate: bool, check_sum: bool) -> None:
        """:meth:`_decode_into` for this rank's own container (see :mod:`deepreduce.wire.own_containers`)."""
        if not accumulate:
            out[...] = 0.0
        kernels.scatter_add(out, own.positions, own.values, own.ascending, self.threads)
        if check_sum and not all_finite(out[own.positions]):
            raise _sum_overflow()

    # ------------------------------------------------------------------ backends
    def backends(self, device=None) -> dict:
        """Where each component runs and which implementation: ``device=None`` for NumPy input
        (the host: "c++" or "numpy"), or a torch device for the torch device path ("torch on
        <device>", or "host: ..." for a component that falls back, see ``deepreduce.backend.arrays``)."""
        host_kernels = "host: c++" if kernels.native() is not None else "host: numpy"
        if device is None:
            parts = {"memory": host_kernels, "finiteness": host_kernels,
                     "sparsifier": f"host: {getattr(self.sparsifier, 'backend', 'numpy')}",
                     "index": f"host: {self.index.backend}", "value": f"host: {self.value.backend}",
                     "container": "host: python", "decode_accumulate": host_kernels}
            return parts
        on_device = f"torch on {device}"

        def codec(component):
            if component.array_api and str(device).split(":")[0] == "cpu" and \
                    getattr(component, "cpu_tensor_kernels", False):
                return f"{on_device} (c++ kernels on its memory)"
            return on_device if component.array_api else f"host: {component.backend} (compact data copied)"

        return {"memory": on_device, "finiteness": on_device,
                "sparsifier": on_device if self.sparsifier.array_api else "host (dense copy)",
                "index": codec(self.index), "value": codec(self.value),
                "container": f"{on_device} (header and CRC on the host)", "decode_accumulate": on_device}

    # ------------------------------------------------------------------ stats
    def count_encoded(self, nbytes: int, numel: int, index: int, value: int, perm: int, seconds: float) -> None:
        """Count one encoded container of ``nbytes`` (its sections' bytes given) in :attr:`stats`."""
        s = self.stats
        s.tensors_encoded += 1
        s.dense_bytes += 4 * numel
        s.wire_bytes += nbytes
        s.index_bytes += index
        s.value_bytes += value
        s.permutation_bytes += perm
        s.header_bytes += nbytes - index - value - perm
        s.encode_seconds += seconds


def _distinct_in_bounds(indices: np.ndarray, values: np.ndarray, numel: int):
    """One container's entries sorted by position; ContainerError for a position out of
    ``[0, numel)`` or given twice (a corrupt container). Most index codecs give them ascending
    already: then nothing is sorted."""
    if np.any(indices[1:] <= indices[:-1]):
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], values[order]
    if indices.shape[0] and (indices[0] < 0 or indices[-1] >= numel or np.any(indices[1:] == indices[:-1])):
        raise ContainerError(f"container positions are out of [0, {numel}) or repeated")
    return indices, values


def _native_reason(core: Pipeline) -> str:
    """:meth:`Pipeline.native_reason` ("" when every stage has a C++ twin). Every ``nonfinite``
    policy runs there: a non-finite gradient travels flagged under both, an overflowing
    compensation raises under both, and the residual the C++ code updates in place is the
    pipeline's own, saved by its journal first."""
    if core.sparsifier.id not in native_pipeline.SPARSIFIERS:
        return f"sparsifier {core.sparsifier.id!r} (the C++ pipeline selects Top-r or by threshold)"
    for kind, ids in (("index codec", native_pipeline.INDEX_CODECS), ("value codec", native_pipeline.VALUE_CODECS),
                      ("memory", native_pipeline.MEMORIES)):
        component = getattr(core, kind.split()[0])
        if component.id not in ids:
            return f"{kind} {component.id!r} (the C++ pipeline has {', '.join(ids)})"
    if core.warmup:
        return f"warmup: {core.warmup} (the C++ pipeline has no dense warm-up steps)"
    return ""


def _native_settings(core: Pipeline) -> dict:
    """:attr:`Pipeline.native_settings`: the encode settings of ``core`` (csrc/pipeline/pipeline.h
    EncodeConfig) as plain values, every key, with the defaults of the stages the config does not
    use (only asked when :func:`_native_reason` is "")."""
    out = dict(digest=core.config_digest, min_numel=core.min_numel, sparsifier=core.sparsifier.id,
               ratio=0.0, threshold=0.0, error_feedback=core.memory.id == "residual",
               index=core.index.id, policy="p0", keys_per_block=0.0, k=1, hash_seed=0,
               value=core.value.id, degree=5, segments=0, min_points=6, coef_bytes=4, threads=core.threads)
    if core.sparsifier.id == "topk":
        out["ratio"] = float(core.sparsifier.ratio)
    else:   # compared in float32, as threshold_positions does
        out["threshold"] = float(np.float32(core.sparsifier.threshold))
    if core.index.id == "bloom":
        lam, k = bloom_codec.filter_shape(core.index.fpr)
        out.update(policy=core.index.policy, keys_per_block=float(lam), k=k, hash_seed=core.index.hash_seed)
    if core.value.id == "polyfit":
        value = core.value
        out.update(degree=value.degree, segments=value.segments, min_points=value.min_points,
                   coef_bytes=value.coef_bytes)
    return out


def check_numel_option(owner: str, key: str, value, low: int) -> int:
    """``value`` if it is an integer element count in ``[low, 2**60]``, else ConfigError (no tensor
    has more elements: ``container.MAX_TENSOR_NUMEL``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= container.MAX_TENSOR_NUMEL:
        raise ConfigError(f"{owner}: {key!r} must be an integer in [{low}, 2**60] (no tensor has more "
                          f"than 2**60 elements), got {quote(value)}")
    return value


def check_warmup(owner: str, value) -> int:
    """``value`` if it is a step count in ``[0, 2**62]`` (the warm-up's length), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2 ** 62:
        raise ConfigError(f"{owner}: 'warmup' must be a whole number of steps in [0, 2**62], got {quote(value)}")
    return value


def _check_finite(c: container.Container, values: np.ndarray, what: str,
                  checks: Optional[DeferredChecks] = None) -> None:
    """Finite in, finite out: a container without the NONFINITE flag must decode to finite values
    (one pass over the ``n`` values, :func:`all_finite`; recorded in ``checks`` when given)."""
    if not c.nonfinite and len(values):
        _expect_finite(values, lambda: ContainerError(
            f"container {what} hold NaN/Inf but its header does not carry the non-finite flag"), checks)


def _expect_finite(values, error, checks: Optional[DeferredChecks]) -> None:
    """Raise ``error()`` unless every entry of ``values`` is finite; with ``checks`` (torch
    values) the check is recorded there instead of read now."""
    if checks is None:
        if not all_finite(values):
            raise error()
        return
    checks.expect(arrays.adapter(values).finite_flag(values), error)


def _sum_overflow() -> NonFiniteGradientError:
    return NonFiniteGradientError("the sum of the ranks' tensors is not finite: finite float32 values "
                                  "overflow when added (pipeline option nonfinite='raise')")


def all_finite(x) -> bool:
    """Whether every entry of a float array (NumPy, or torch on its device) is finite. torch: one
    float64 sum, NaN/Inf exactly when an entry is (float32 magnitudes cannot overflow it), without
    a boolean tensor; NumPy float32: the finiteness pass of :func:`kernels.scan` (C++ when built),
    other NumPy: ``isfinite(x).all()``, several times faster than a float64 sum."""
    if arrays.is_torch(x):
        return arrays.adapter(x).all_finite(x)
    if x.dtype == np.float32:
        return kernels.scan(x.reshape(-1))[0]
    return bool(np.isfinite(x).all())


def dtype_error(name: str, dtype) -> DeepReduceError:
    """The one error every binding raises for a gradient that is not floating point (NumPy,
    torch and TensorFlow dtypes are named alike: ``int64``, not ``torch.int64``)."""
    dtype = str(getattr(dtype, "name", dtype)).replace("torch.", "")
    return DeepReduceError(f"gradient {name!r} has dtype {dtype}; deepreduce compresses floating-point tensors")


FLOAT32_MAX = float(np.finfo(np.float32).max)


def to_float32(arr, name: str):
    """``arr`` (a float NumPy array or torch tensor) as float32; a wider float holding finite
    values beyond float32's range raises NonFiniteGradientError saying they overflow (they would
    arrive as Inf)."""
    torch_input = arrays.is_torch(arr)
    if torch_input:
        if arr.dtype == arrays.namespace(arr).float32:
            return arr
        out, wide = arr.float(), arr.dtype.itemsize > 4
    else:
        if arr.dtype == np.float32:
            return arr
        with np.errstate(over="ignore"):
            out = arr.astype(np.float32)
        wide = arr.dtype.itemsize > 4
    if wide and len(out.reshape(-1)) and not all_finite(out):
        xp = arrays.namespace(arr)
        overflow = xp.isinf(out) & xp.isfinite(arr)
        count = int(xp.sum(xp.astype(overflow, xp.int64)))
        if count:
            largest = float(xp.max(xp.abs(arr[overflow])))
            raise NonFiniteGradientError(
                f"gradient {name!r} ({str(arr.dtype).replace('torch.', '')}) has {count} finite values beyond "
                f"float32's range (largest magnitude {largest:.4g} > {FLOAT32_MAX:.4g}): they would "
                "overflow to Inf on the float32 wire; scale the gradient"
            )
    return out


class CompensationOverflow(NonFiniteGradientError):
    """The compensated values to be sent are not finite although the gradient is (a residual
    plus gradient beyond float32's range); :meth:`Pipeline.encode` sends such a tensor flagged."""


def select_positions(sparsifier: Sparsifier, flat, ctx: EncodeContext):
    """The positions ``sparsifier`` keeps in the 1-D float ``flat`` (NumPy or a tensor), in
    ``flat``'s framework and device: a sparsifier written on the array namespace runs there; any
    other runs on a host copy (warned once, see ``deepreduce.backend.arrays.host_fallback``)."""
    if sparsifier.array_api or not arrays.is_torch(flat):
        return sparsifier.select(flat, ctx)
    a = arrays.adapter(flat)
    arrays.host_fallback(f"sparsifier {sparsifier.id!r} (a dense copy goes to the host)")
    chosen = sparsifier.select(a.to_numpy(flat), ctx)
    return a.from_numpy(np.asarray(chosen, dtype=np.int64), like=flat)


def _runner(component, like):
    """``component.encode`` for data like ``like``: the component itself for NumPy input or when
    it is written against the array namespace (``array_api``); otherwise, for torch tensors,
    its host path on NumPy copies of its (compact) inputs, with results moved back to the device
    and a one-time warning naming it. The index codec is handed the dense gradient too (Bloom
    reads it; Bloom runs on the device)."""
    if not arrays.is_torch(like) or component.array_api:
        return component.encode
    a = arrays.adapter(like)

    def host(x):
        return None if x is None else a.to_numpy(x)

    def device(x):
        return None if x is None else a.from_numpy(np.asarray(x), like)

    def encode(*args):
        arrays.host_fallback(f"{component.kind} codec {component.id!r}")
        *data, ctx = args
        result = component.encode(*(host(x) for x in data), ctx)
        if component.kind == "index":
            return result._replace(indices=device(result.indices), values=device(result.values))
        received = component.reconstruct(result, len(data[0]))
        return result._replace(order=device(result.order), reconstructed=device(received))

    return encode


def _decoded(codec, out, section, decode):
    """What ``decode(section)`` returns, in ``out``'s framework: for a torch ``out`` an
    ``array_api`` codec decodes the section uploaded to the device, any other decodes it on the
    host (one-time warning) and its n entries move to the device."""
    if not arrays.is_torch(out):
        return decode(section)
    a = arrays.adapter(out)
    if codec.array_api:
        return decode(a.from_section(section, "<u1", out))
    arrays.host_fallback(f"{codec.kind} codec {codec.id!r} (decode)")
    return a.from_numpy(np.asarray(decode(arrays.head_bytes(section, len(section)))), out)


def as_flat_float32(grad, name: str):
    """A gradient as a flat float32 array and its shape; rejects non-float input by name.

    A torch tensor stays a torch tensor on its device (the torch device path); a float32
    contiguous one is not copied.
    """
    if type(grad) is np.ndarray and grad.dtype == np.float32 and grad.flags.c_contiguous:
        return grad.reshape(-1), grad.shape   # what the general path below returns for it
    if arrays.is_torch(grad):
        if not grad.dtype.is_floating_point:
            raise dtype_error(name, grad.dtype)
        return to_float32(grad.detach(), name).contiguous().reshape(-1), tuple(int(s) for s in grad.shape)
    arr = np.asarray(grad)
    if arr.dtype.kind != "f":   # NumPy's floating kinds: float16 to longdouble
        raise dtype_error(name, arr.dtype)
    return np.ascontiguousarray(to_float32(arr, name)).ravel(), arr.shape


def _output(out: Optional[np.ndarray], numel: int) -> np.ndarray:
    """The flat float32 buffer a decode writes: ``out`` (checked, used in place) or fresh zeros
    (pages the OS hands out zeroed; only those the scatter touches are ever written).

    A torch ``out`` (float32, contiguous) is decoded into on its own device.
    """
    if out is None:
        return np.zeros(numel, dtype=np.float32)
    if arrays.is_torch(out):
        if out.dtype != arrays.namespace(out).float32 or not out.is_contiguous():
            raise DeepReduceError("decode: a torch out= must be a contiguous float32 tensor")
        if out.numel() != numel:
            raise CommunicationError(f"decode: out= has {out.numel()} elements, the container's tensor {numel}")
        return out.detach().reshape(-1)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise DeepReduceError("decode: out= must be a writeable C-contiguous float32 NumPy array")
    if out.size != numel:
        raise CommunicationError(f"decode: out= has {out.size} elements, the container's tensor {numel}")
    return out.reshape(-1)


def dense_container(flat, shape, nonfinite: bool = False) -> container.Container:
    """A dense container of the flat float32 ``flat`` (a tensor of ``shape``); ``nonfinite``:
    flagged as holding NaN/Inf (how ``propagate`` sends such a tensor, and an overflow)."""
    flags = container.FLAG_DENSE | (container.FLAG_NONFINITE if nonfinite else 0)
    return container.Container(
        shape=shape, n=flat.shape[0], index_id=0, value_id=0, flags=flags,
        value_section=arrays.adapter(flat).as_bytes(arrays.namespace(flat).asarray(flat, copy=True)),
    )   # a copy: a torch section is a view, and the residual behind ``flat`` is reset after packing
