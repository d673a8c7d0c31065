"""Gradient reduction through DeepReduce containers and ``hvd.allgather``.

Every rank encodes its gradient with (name, step) into one container, the containers of all
ranks travel by Horovod's public ``allgather`` (they differ in size and are not summable, so
allreduce cannot carry them), and every rank splits the gathered bytes, decodes each
container, sums, and divides by the number of ranks for ``op=Average``. Every stage is a graph
op, so the same code runs eagerly and inside ``tf.function`` (where Horovod and the tape's
reduction code run only while the graph is traced). Horovod itself is never patched.

Eagerly, each op runs when it is called, so one tensor after another would make every encode
wait for the previous tensor's allgather round trip. With ``background`` on (the default) the
eager chains run on a few worker threads instead (:mod:`deepreduce.dist.overlap`); the collectives
keep their names (:func:`tensor_key`), which is how Horovod matches them across ranks whatever
order they are submitted in. ``compression_stats()["encode_hidden_seconds"]`` sums the encode
time that ran while another tensor's collective or decode was in flight. Inside
``tf.function`` all encodes come first in program order (see ``Reducer._reduce_containers``).

Before the first reduction of a set of gradients (when a ``tf.function`` is traced, or at the
first eager step) the ranks compare their gradient names, shapes, dtypes and compressor with
one small eager allgather (:func:`deepreduce.dist.agreement.agree`), so ranks running different
models or configs fail with the same CommunicationError instead of stalling. Under
``nonfinite: raise`` a NaN/Inf gradient travels as a flagged container; one op that runs after
every collective of the step raises the same NonFiniteGradientError on every rank (inside
``tf.function`` TensorFlow re-raises it as ``tf.errors.UnknownError`` carrying its text) and
restores the residuals; the gradients depend on that op, so nothing is applied to the weights
and the next step starts clean (Keras's ``iterations`` increment does not wait for them, so in a
compiled step it may still count the skipped step). A rank whose encode raises sends the
protocol's failure payload instead (``on_error`` of :meth:`TFPipeline.encode`): every rank's check
of the gathered bytes sees it, decodes nothing, and the same op raises on every rank, under any
``nonfinite`` policy, so a caught error leaves the ranks in phase.
"""
from __future__ import annotations

import time
import weakref
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..dist import agreement, buckets, overlap
from ..dist.comm.horovod import HorovodCommunicator
from ..dist.protocol import ReductionProtocol
from ..errors import BackendUnavailableError, ConfigError
from ..wire import container
from .pipeline import TFPipeline, build
from .routes import HostRoutes, graph_or_eager, step_tensor, tensor_key
from .sparse import SliceRoutes

_AGREED = set()    # (process set, layout digest) pairs every rank has already compared
_REDUCTIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # TFPipeline -> _reduction_state's
_EAGER_GATHERS = {}   # (process set, tensor key) -> concrete function of one named allgather (Reducer._eager_gather)


def import_horovod():
    """``horovod.tensorflow``, or BackendUnavailableError saying how to build it."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as exc:
        raise BackendUnavailableError(
            f"deepreduce.tensorflow's distributed wrappers need horovod.tensorflow: {exc}. "
            "Run `make setup` to build the patched Horovod."
        ) from exc
    return hvd


def is_summable_compressor(compression) -> bool:
    """True for a Horovod-style compressor whose output an allreduce can sum.

    Horovod's own (``hvd.Compression.none``/``fp16``, classes with static methods) and any
    object with ``compress``/``decompress`` methods, such as :class:`deepreduce.tensorflow.GradiVeQ`.
    """
    return callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))


def resolve_op(op):
    """Horovod's reduce op -> ``"average"`` or ``"sum"`` (Adasum/Min/Max cannot be sent as containers)."""
    hvd = import_horovod()
    if op is None or op == hvd.Average:
        return "average"
    if op == hvd.Sum:
        return "sum"
    raise ConfigError(
        f"deepreduce reduces gradients with op=hvd.Average or op=hvd.Sum; got {op!r} "
        "(Adasum, Min, Max and Product need an allreduce of the raw gradient)"
    )


class Reducer(HostRoutes, SliceRoutes):
    """Averages or sums a list of gradients across the ranks of one Horovod process set.

    With a deepreduce pipeline, each gradient travels as a container by ``hvd.allgather``.
    With ``pipeline=None`` it travels by ``hvd.allreduce`` with the given summable compressor
    (``hvd.Compression.none``/``fp16``, the uncompressed baseline, or GradiVeQ), which also
    works with Keras 3 variables (Horovod's own wrappers call ``Variable.ref``, which Keras 3
    removed).

    Holds no per-step state: the pipeline owns residuals, statistics and the step counter, and
    the reduction protocol (with the sparse all-reduce's owner residuals and the ``auto`` plan)
    is kept with the pipeline (:func:`_reduction_state`), so a new tape each step (the Horovod
    idiom) keeps using the same state. ``IndexedSlices`` gradients travel as their touched
    entries (:class:`~deepreduce.tensorflow.sparse.SliceRoutes`); under the sparse all-reduce or
    ``auto`` every gradient is reduced by one host op (:class:`~deepreduce.tensorflow.routes.HostRoutes`).

    ``background`` (eager containers only): ``True`` runs each tensor's encode -> allgather ->
    decode on one of :data:`deepreduce.dist.overlap.DEFAULT_WORKERS` threads, a positive int on that
    many, ``False`` (or 1) one tensor after another on the caller's thread. The containers and
    the reduced gradients are the same either way; an error raised in a worker is re-raised here
    (the first in tensor order, once every tensor's chain has ended).

    ``bucket_cap_mb`` (containers only; default None, one container per gradient): the float32
    gradients of at least the config's ``min_numel`` elements, in reverse order (backward's),
    are concatenated into buckets of at most that many MiB and each bucket travels as one
    container (:mod:`deepreduce.dist.buckets`, as the torch optimizer's ``bucket_cap_mb``); the
    reduced bucket is split back into the gradients.
    """

    def __init__(self, pipeline: Optional[TFPipeline], op=None, process_set=None,
                 gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                 hvd_compression=None, background=True, bucket_cap_mb=None) -> None:
        self.hvd = import_horovod()
        self.workers = overlap.check_workers(background, "deepreduce.tensorflow")
        self.bucket_cap_mb = buckets.check_bucket_cap_for(bucket_cap_mb, pipeline is None, "deepreduce.tensorflow")
        self.pipeline = None if pipeline is None else build(pipeline)
        self.hvd_compression = hvd_compression if hvd_compression is not None else self.hvd.Compression.none
        if self.pipeline is not None:
            self.op = resolve_op(op)
            self.hvd_op = self.hvd.Average if self.op == "average" else self.hvd.Sum
        else:
            self.hvd_op = self.hvd.Average if op is None else op
            self.op = "average" if self.hvd_op == self.hvd.Average else "other"
        self.process_set = process_set if process_set is not None else self.hvd.global_process_set
        if gradient_predivide_factor != 1.0 and self.op != "average":
            raise ConfigError("gradient_predivide_factor is only supported with op=hvd.Average")
        if not gradient_predivide_factor > 0:
            raise ConfigError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
        self.predivide = float(gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        if self.pipeline is not None:
            self.pipeline.core.collective_steps()
        self._communicator = HorovodCommunicator(framework="tensorflow")
        if self.process_set is not self.hvd.global_process_set:
            self._communicator.process_set = self.process_set
        self._protocol = self._auto = None
        if self.pipeline is not None:
            state = _reduction_state(self.pipeline, self._communicator, self.process_set, self.op == "average")
            self._protocol, self._auto, self._routes = state

    def compression_stats(self) -> dict:
        """The pipeline's running statistics (bytes, encode/decode time; with the sparse
        all-reduce the bytes each collective handed back, with ``auto`` the plan, how many plans
        were made and how often each tensor took each route), or the summable compressor's
        ``compression_stats()`` where it has one; empty for Horovod's compressors."""
        if self.pipeline is not None:
            out = self.pipeline.compression_stats()
            if self._protocol.sparse is not None:
                out.update(aggregation=self.pipeline.core.aggregation.id,
                           received_bytes=dict(self._protocol.sparse.received_bytes))
            if self._auto is not None:
                out.update(self._auto.stats(), auto_routes={n: dict(c) for n, c in self._routes.items()})
            return out
        stats = getattr(self.hvd_compression, "compression_stats", None)
        return stats() if callable(stats) else {}

    @property
    def size(self) -> int:
        return self.process_set.size()

    def _process_set_kwargs(self) -> dict:
        if self.process_set is self.hvd.global_process_set:
            return {}
        return {"process_set": self.process_set}

    def _allreduce(self, grad, name: str) -> tf.Tensor:
        """The baseline: one ``hvd.allreduce`` with the summable compressor."""
        kwargs = self._process_set_kwargs()
        if self.predivide != 1.0 and not isinstance(grad, tf.IndexedSlices):   # Horovod refuses it for slices
            kwargs.update(prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide)
        return self.hvd.allreduce(grad, op=self.hvd_op, compression=self.hvd_compression,
                                  name=tensor_key(name), **kwargs)

    def _encode(self, grad: tf.Tensor, name: str, step) -> tf.Tensor:
        """This rank's container of ``grad`` (divided first by ``gradient_predivide_factor``), or
        the protocol's failure payload where the encode raised (the rank stays in phase)."""
        if self.predivide != 1.0:
            grad = grad * tf.cast(1.0 / self.predivide, grad.dtype)
        return self.pipeline.encode(grad, name=name, step=step, on_error=self._protocol.failure_payload)

    def _eager_gather(self, name: str):
        """A traced ``tf.function`` running one ``hvd.allgather`` named ``tensor_key(name)``, made once per
        tensor and process set.

        An eager op carries no node name, and Horovod takes the kernel's: every eager allgather
        gets the same one, so eager collectives meet across ranks by order alone, and a second
        one while the first is in flight fails ("a tensor with the same name as another tensor
        that is currently being processed", even with different ``name=``). Inside a function
        the op has its graph name, so concurrent gathers of different tensors are told apart and
        every rank's gather of a tensor meets the same name whatever order they run in (Horovod's
        own tape, too, runs its eager reductions as a ``tf.function``).
        """
        key = (id(self.process_set), tensor_key(name))
        gather = _EAGER_GATHERS.get(key)
        if gather is None:
            hvd, kwargs = self.hvd, self._process_set_kwargs()

            def allgather(payload):
                return hvd.allgather(payload, name=key[1], **kwargs)

            # traced here, once; calling the concrete function never retraces (nor warns that it did)
            gather = _EAGER_GATHERS.setdefault(key, tf.function(allgather, autograph=False).get_concrete_function(
                tf.TensorSpec([None], tf.uint8)))
        return gather

    def _gather(self, name: str, payload: tf.Tensor) -> tf.Tensor:
        """Every rank's payload of ``name``, concatenated (``hvd.allgather`` named ``tensor_key(name)``)."""
        if tf.executing_eagerly():
            return self._eager_gather(name)(payload)
        return self.hvd.allgather(payload, name=tensor_key(name), **self._process_set_kwargs())

    def _check_op(self, name: str, gathered: tf.Tensor, step) -> tf.Tensor:
        """:meth:`_check` of a gathered tensor, as an op (eagerly: now)."""
        return graph_or_eager(lambda buf, step_value: self._check(name, buf, int(step_value)),
                               [gathered, step_tensor(step)], tf.int64, "deepreduce_check")

    @staticmethod
    def _unless_skipped(found: tf.Tensor, decode, nothing):
        """``decode()`` unless the report says some rank failed or sent a non-finite container
        (``nothing()`` then: ``_finish_step`` raises on every rank once the step's collectives ran)."""
        skip = tf.not_equal(found[0], -1)
        if tf.executing_eagerly():
            return nothing() if bool(skip) else decode()
        return tf.cond(skip, nothing, decode, name="deepreduce_decode_unless_skipped")

    def _gather_decode(self, grad: tf.Tensor, name: str, payload: tf.Tensor, step):
        """(the average or sum over ranks of ``grad``, its report: see :meth:`_check`)."""
        gathered = self._gather(name, payload)
        size = self.size
        shape = grad.shape if grad.shape.is_fully_defined() else None
        found = self._check_op(name, gathered, step)
        total = self._unless_skipped(found, lambda: self.pipeline.decode_sum(gathered, shape, count=size),
                                     lambda: tf.zeros(tf.shape(grad), tf.float32))
        if shape is None:
            total = tf.reshape(total, tf.shape(grad))
        if self.op == "average":
            total = total * (self.predivide / size)
        return (tf.cast(total, grad.dtype) if grad.dtype != tf.float32 else total), found

    def _reduce_containers(self, grads: List[tf.Tensor], names: List[str], step, reports: list) -> List[tf.Tensor]:
        """Every gradient through encode -> ``hvd.allgather`` -> decode_sum; each tensor's report
        (:meth:`_check`) is appended to ``reports``.

        Eagerly, each tensor's chain runs as one task of :func:`deepreduce.dist.overlap.run_in_order`:
        on ``background`` worker threads, so encodes proceed while other tensors' collectives and
        decodes are in flight, or one after another on this thread; the encode times and their
        overlap go to the pipeline's statistics. Inside ``tf.function`` every encode comes first
        in program order, then each tensor's allgather and decode: TensorFlow chains stateful
        ops that take no resource (the encode and decode ops) in program order, so the
        per-tensor order would make each encode wait for the previous tensor's decode; this
        order lets tensor i's allgather (a stateless op) run while tensor i+1 encodes.
        """
        if self._protocol.sparse is not None:
            return self._reduce_host(grads, names, step, reports)
        if tf.executing_eagerly():
            def chain(i):
                start = time.perf_counter()
                payload = self._encode(grads[i], names[i], step)
                encoded = time.perf_counter()
                return self._gather_decode(grads[i], names[i], payload, step), (start, encoded), \
                    (encoded, time.perf_counter())

            done = overlap.run_in_order(chain, range(len(grads)), self.workers)
            encodes = [d[1] for d in done]
            self.pipeline.eager_encode_seconds += sum(end - start for start, end in encodes)
            self.pipeline.encode_hidden_seconds += overlap.covered_seconds(encodes, [d[2] for d in done])
            results = [d[0] for d in done]
        else:
            payloads = [self._encode(g, n, step) for g, n in zip(grads, names)]
            results = [self._gather_decode(g, n, p, step) for g, n, p in zip(grads, names, payloads)]
        reports.extend(found for _, found in results)
        return [total for total, _ in results]

    def reduce(self, grads: Sequence, names: Sequence[str], step=None) -> List[Optional[tf.Tensor]]:
        """Reduce a list of gradients (None entries stay None).

        ``step``: an int, an integer tensor or variable (e.g. ``optimizer.iterations``); when
        None, the pipeline's own counter is read and then advanced by one.
        """
        own_counter = step is None and self.pipeline is not None
        if own_counter:
            counter = self.pipeline.iterations
            step = tf.identity(counter.read_value())
        elif step is not None and hasattr(step, "dtype") and not isinstance(step, tf.Tensor):
            step = tf.convert_to_tensor(step)  # a (Keras) variable: read it once, before the update
        slices = [i for i, g in enumerate(grads) if self._native_slices(g)]
        live = [i for i, g in enumerate(grads) if g is not None and i not in slices]
        # containers carry dense tensors (the sparsifier finds the non-zeros again), IndexedSlices
        # their touched rows' entries (the baseline: Horovod's allgather of their parts)
        dense = [tf.convert_to_tensor(grads[i]) for i in live]
        live_names = [names[i] for i in live]
        groups = self._bucket_plan(dense)
        self._agree(grads, names, [(f"<bucket{k}>", [sum(_numel(dense[j]) for j in g)], "bucket")
                                   for k, g in enumerate(groups)])
        reports: list = []
        if self.pipeline is None:
            reduced, sent_names = [self._allreduce(g, names[i]) for g, i in zip(dense, live)], live_names
        elif not groups:
            reduced, sent_names = self._reduce_containers(dense, live_names, step, reports), live_names
        else:
            reduced, sent_names = self._reduce_buckets(dense, live_names, groups, step, reports)
        out: List[Optional[tf.Tensor]] = [None] * len(grads)
        for i, g in zip(live, reduced):
            out[i] = g
        for i in slices:
            out[i] = self._allreduce(grads[i], names[i]) if self.pipeline is None else \
                self._reduce_slices(grads[i], names[i], step, reports)
        if self.pipeline is not None:
            out = self._finish_step(out, reports, sent_names + [names[i] for i in slices], step)
        if own_counter:
            done = tf.nest.flatten([g for g in out if g is not None], expand_composites=True)
            with tf.control_dependencies(done):
                counter.assign_add(1)
        return out

    def _bucket_plan(self, dense: List[tf.Tensor]) -> List[List[int]]:
        """Positions in ``dense`` of each bucket's gradients (see the class docstring); [] without
        ``bucket_cap_mb``. Only float32 gradients of a static size of at least ``min_numel``."""
        if self.bucket_cap_mb is None or self.pipeline is None:
            return []
        eligible = [j for j in reversed(range(len(dense)))
                    if dense[j].dtype == tf.float32 and _numel(dense[j]) is not None
                    and _numel(dense[j]) >= self.pipeline.core.min_numel]
        return [[eligible[i] for i in members]
                for members in buckets.plan([_numel(dense[j]) for j in eligible], self.bucket_cap_mb * buckets.MIB)]

    def _reduce_buckets(self, dense: List[tf.Tensor], names: List[str], groups: List[List[int]], step,
                        reports: list):
        """:meth:`_reduce_containers` of each bucket's concatenated gradients (named
        ``bucket<k>.<first gradient's name>``) and of the other gradients; the reduced buckets
        are split back. Returns (the reduced gradients in ``dense``'s order, the containers' names)."""
        flats = [tf.concat([tf.reshape(dense[j], [-1]) for j in g], 0) for g in groups]
        bucket_names = [f"bucket{k}.{names[g[0]]}" for k, g in enumerate(groups)]
        inside = {j for g in groups for j in g}
        singles = [j for j in range(len(dense)) if j not in inside]
        sent_names = bucket_names + [names[j] for j in singles]
        reduced = self._reduce_containers(flats + [dense[j] for j in singles], sent_names, step, reports)
        out: List[Optional[tf.Tensor]] = [None] * len(dense)
        for g, total in zip(groups, reduced):
            for j, part in zip(g, tf.split(total, [_numel(dense[j]) for j in g])):
                out[j] = tf.reshape(part, dense[j].shape)
        for j, total in zip(singles, reduced[len(groups):]):
            out[j] = total
        return out, sent_names

    def _agree(self, grads: Sequence, names: Sequence[str], extra: Sequence = ()) -> None:
        """Compare every rank's gradients, compressor and buckets (``extra`` layout entries) once
        per layout (at trace time or the first eager step; an eager allgather, lifted out of any
        ``tf.function`` being traced)."""
        tensors = []
        for g, n in zip(grads, names):
            if g is not None:
                shape = tf.TensorShape(g.shape)
                tensors.append((n, [] if shape.rank is None else shape.as_list(), g.dtype.name))
        tensors += list(extra)
        compressor = self.pipeline if self.pipeline is not None else self.hvd_compression
        layout = agreement.Layout(agreement.compressor_identity(compressor), tensors, "gradient")
        key = (id(self.process_set), layout.digest)
        if key in _AGREED:
            return
        with tf.init_scope():
            if not tf.executing_eagerly():
                return   # a TF1 graph being built: no collective can run now
            agreement.agree(layout, lambda payload: self._communicator.allgather(payload, "DeepReduce_agreement"),
                            "deepreduce.tensorflow")
        _AGREED.add(key)

    def _check(self, name: str, gathered: np.ndarray, step: int) -> np.ndarray:
        """This tensor's :meth:`ReductionProtocol.report` on the gathered bytes, as an int64 array."""
        with self.pipeline.lock:
            return np.array(self._protocol.report(container.split(gathered), name, step), dtype=np.int64)

    def _finish_step(self, reduced: list, reports: list, names: List[str], step) -> list:
        """The gradients, once one op that waits for every report has kept the step's residuals,
        or restored them and raised on every rank where a rank sent a non-finite container or
        could not encode (the protocol's ``end_step``; the first failed tensor in ``names``), and,
        under ``auto``, planned after the first step (rank 0 prints the table)."""
        protocol, lock = self._protocol, self.pipeline.lock

        def finish(step_value, *reports):   # the reports: inputs only, so that it runs after them
            with lock:
                protocol.end_step(int(step_value), order=names)
            if self._auto is not None:   # collective: every rank ends the same steps
                table = self._auto.end_step(int(step_value))
                if table is not None and self._communicator.rank == 0:
                    print(f"deepreduce auto aggregation, after step {int(step_value)}:\n{table}", flush=True)
            return np.int64(0)

        done = graph_or_eager(finish, [step_tensor(step)] + reports, tf.int64, "deepreduce_finish_step")
        with tf.control_dependencies([done]):
            return [None if g is None else tf.identity(g) for g in reduced]


def _reduction_state(pipeline: TFPipeline, communicator, process_set, average: bool):
    """(protocol, auto planner or None, route counts) of one pipeline over one
    process set: made once and kept with the pipeline, so the sparse all-reduce's owner residuals
    and the ``auto`` plan survive the per-step tape (Horovod's idiom)."""
    by_key = _REDUCTIONS.setdefault(pipeline, {})
    key = (id(process_set), average)
    if key not in by_key:
        protocol = ReductionProtocol(pipeline.core, communicator, average=average)
        aggregation = pipeline.core.aggregation
        auto = None if aggregation is None else aggregation.planner(pipeline.core, communicator)
        by_key[key] = (protocol, auto, {})
    return by_key[key]


def _numel(tensor: tf.Tensor) -> Optional[int]:
    """Elements of a tensor of static shape, None when its shape is not fully known."""
    shape = tf.TensorShape(tensor.shape)
    return shape.num_elements() if shape.is_fully_defined() else None
