"""Gradient reduction through DeepReduce containers and ``hvd.allgather``.

Every rank encodes its gradient with (name, step) into one container, the containers of all
ranks travel by Horovod's public ``allgather`` (they differ in size and are not summable, so
allreduce cannot carry them), and every rank splits the gathered bytes, decodes each
container, sums, and divides by the number of ranks for ``op=Average``. Every stage is a graph
op, so the same code runs eagerly and inside ``tf.function`` (where Horovod and the tape's
reduction code run only while the graph is traced). The steps every rank takes alike are the
framework-free :class:`~deepreduce.collective.protocol.ReductionProtocol`'s; this module and its parts
(:mod:`~deepreduce.tensorflow.routes`, :mod:`~deepreduce.tensorflow.sparse`) make them ops.

Each dense gradient travels by one of :class:`~deepreduce.tensorflow.routes.ContainerRoutes`'s
routes (containers; under the sparse all-reduce or ``auto`` one host op), the ``IndexedSlices``
ones as their touched entries (:class:`~deepreduce.tensorflow.sparse.SliceRoutes`: the step
engine's ``entries`` route, its phases as ops), a summable compressor's codes by the engine's
summable route (:class:`~deepreduce.tensorflow.summable.SummableRoutes`); every collective is
named (:func:`~deepreduce.tensorflow.collectives.gather`), which is how Horovod matches them
across ranks whatever order they are submitted in.

Before the first reduction of a set of gradients (when a ``tf.function`` is traced, or at the
first eager step) the ranks compare their gradient names, shapes, dtypes and compressor with
one small eager allgather (:func:`deepreduce.collective.agreement.agree`), so ranks running different
models or configs fail with the same CommunicationError instead of stalling. Under
``nonfinite: raise`` a NaN/Inf gradient travels as a flagged container, and a rank whose encode
raises sends the protocol's failure payload (``on_error`` of :meth:`TFPipeline.encode`); every
rank's check of the gathered bytes sees either, decodes nothing, and one op that runs after
every collective of the step (``ReductionProtocol.end_step``) restores the residuals and raises
the same error on every rank (inside ``tf.function`` TensorFlow re-raises it as
``tf.errors.UnknownError`` carrying its text). The gradients depend on that op, so nothing is
applied to the weights and the ranks stay in phase (Keras's ``iterations`` increment does not
wait for them, so in a compiled step it may still count the skipped step).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..collective import agreement, buckets, overlap
from ..collective.comm.horovod import HorovodCommunicator
from ..collective.step import StepEngine
from ..errors import ConfigError
from .collectives import import_horovod, resolve_op, tensor_key
from .pipeline import TFPipeline, build
from .routes import ContainerRoutes, graph_or_eager, host_allreduce, step_tensor
from .sparse import DeferredGathers, SliceRoutes, SliceTensors
from .summable import SummableRoutes

_AGREED = set()    # (process set, layout digest) pairs every rank has already compared


class Reducer:
    """Averages or sums a list of gradients across the ranks of one Horovod process set.

    With a deepreduce pipeline, each gradient travels as a container by ``hvd.allgather``.
    With ``pipeline=None`` it travels by ``hvd.allreduce`` with the given summable compressor,
    which also works with Keras 3 variables (Horovod's own wrappers call ``Variable.ref``, which
    Keras 3 removed): a compressor (GradiVeQ, any other) under ``hvd.Average``/``hvd.Sum`` on the
    engine's summable route (:class:`~deepreduce.tensorflow.summable.SummableRoutes`: a compress
    error on one rank makes every rank raise, in phase); Horovod's own casts (``Compression.none``,
    ``fp16``: nothing can fail), another op and ``IndexedSlices`` by Horovod's ``hvd.allreduce``.

    Holds no per-step state: the pipeline owns residuals, statistics and the step counter, and
    the reduction protocol (with the sparse all-reduce's owner residuals and the ``auto`` plan)
    is kept with the pipeline (the step engine in ``TFPipeline.protocols``), so a new tape each step (the Horovod
    idiom) keeps using the same state.

    ``background`` and ``bucket_cap_mb``: as for :func:`~deepreduce.tensorflow.DistributedGradientTape`.
    An error raised in a ``background`` worker is re-raised here (the first in tensor order, once
    every tensor's chain has ended). Buckets (:func:`deepreduce.collective.buckets.plan_backward`, as the
    torch optimizer's) are concatenated, travel as one container each and are split back.
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
        self._communicator = HorovodCommunicator(framework="tensorflow")
        if self.process_set is not self.hvd.global_process_set:
            self._communicator.process_set = self.process_set
        self._engine = self._protocol = None
        if self.pipeline is not None:   # one step engine per pipeline and process set, kept with the pipeline
            self.pipeline.core.collective_steps()
            key = (id(self.process_set), self.op == "average")
            if key not in self.pipeline.protocols:
                self.pipeline.protocols[key] = StepEngine(
                    self.pipeline.core, DeferredGathers(self._communicator), SliceTensors(),
                    functools.partial(host_allreduce, self.hvd, self.process_set), average=key[1], background=False)
            self._engine = self.pipeline.protocols[key]
            self._protocol = self._engine.protocol
        self._summable = None
        if self.pipeline is None and self.hvd_compression not in (self.hvd.Compression.none, self.hvd.Compression.fp16) \
                and self.hvd_op in (self.hvd.Average, self.hvd.Sum):
            self._summable = SummableRoutes(self.hvd_compression, self.hvd, self.process_set, self.hvd_op,
                                            self.predivide)
        self._containers = ContainerRoutes(self.pipeline, self._engine, self.hvd, self.process_set, self.op,
                                           self.predivide, self.workers)
        self._slices = SliceRoutes(self.pipeline, sparse_as_dense, self._containers)

    def compression_stats(self) -> dict:
        """The pipeline's running statistics (bytes, encode/decode time; with the sparse
        all-reduce the bytes each collective handed back, with ``auto`` the plan, how many plans
        were made and how often each tensor took each route), or the summable compressor's
        ``compression_stats()`` where it has one, with the summable route's figures (``steps``
        applied, ``nonfinite_propagated``, encode and communication seconds); empty for
        ``hvd.Compression.none``."""
        if self.pipeline is None:
            stats = getattr(self.hvd_compression, "compression_stats", None)
            out = stats() if callable(stats) else {}
            if self._summable is not None:
                out.update(self._summable.stats())
            return out
        out = self.pipeline.compression_stats()
        out.update(self._protocol.stats())
        if self._protocol.auto is not None:
            out["auto_routes"] = {name: dict(counts) for name, counts in self._engine.routes_by_name.items()}
        return out

    @property
    def size(self) -> int:
        return self.process_set.size()

    def _allreduce(self, grad, name: str) -> tf.Tensor:
        """The baseline: one ``hvd.allreduce`` with the summable compressor."""
        kwargs = {}
        if self.predivide != 1.0 and not isinstance(grad, tf.IndexedSlices):   # Horovod refuses it for slices
            kwargs.update(prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide)
        return self.hvd.allreduce(grad, op=self.hvd_op, compression=self.hvd_compression, name=tensor_key(name),
                                  process_set=self.process_set, **kwargs)

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
        slices = [i for i, g in enumerate(grads) if self._slices.native(g)]
        live = [i for i, g in enumerate(grads) if g is not None and i not in slices]
        # containers carry dense tensors (the sparsifier finds the non-zeros again), IndexedSlices
        # their touched rows' entries (the baseline: Horovod's allgather of their parts)
        dense = [tf.convert_to_tensor(grads[i]) for i in live]
        live_names = [names[i] for i in live]
        groups = [] if self.bucket_cap_mb is None else buckets.plan_backward(
            [d.shape.num_elements() if d.dtype == tf.float32 else None for d in dense], self.bucket_cap_mb,
            self.pipeline.core.min_numel)
        self._agree(grads, names, [(f"bucket{k}", sum(dense[j].shape.num_elements() for j in g))
                                   for k, g in enumerate(groups)])
        reports: list = []
        if self._summable is not None:
            reduced, sent_names = self._summable.reduce(dense, live_names, step), live_names
        elif self.pipeline is None:
            reduced, sent_names = [self._allreduce(g, names[i]) for g, i in zip(dense, live)], live_names
        elif not groups:
            reduced, sent_names = self._containers.reduce(dense, live_names, step, reports), live_names
        else:
            reduced, sent_names = self._reduce_buckets(dense, live_names, groups, step, reports)
        out: List[Optional[tf.Tensor]] = [None] * len(grads)
        for i, g in zip(live, reduced):
            out[i] = g
        if self.pipeline is None:
            for i in slices:
                out[i] = self._allreduce(grads[i], names[i])
        else:
            sparse = self._slices.reduce([grads[i] for i in slices], [names[i] for i in slices], step, reports)
            for i, g in zip(slices, sparse):
                out[i] = g
        if self.pipeline is not None:
            out = self._finish_step(out, reports, sent_names + [names[i] for i in slices], step)
        if own_counter:
            done = tf.nest.flatten([g for g in out if g is not None], expand_composites=True)
            with tf.control_dependencies(done):
                counter.assign_add(1)
        return out

    def _reduce_buckets(self, dense: List[tf.Tensor], names: List[str], groups: List[List[int]], step,
                        reports: list):
        """:meth:`ContainerRoutes.reduce` of each bucket's concatenated gradients (named
        ``bucket<k>.<first gradient's name>``) and of the other gradients; the reduced buckets
        are split back. Returns (the reduced gradients in ``dense``'s order, the containers' names)."""
        flats = [tf.concat([tf.reshape(dense[j], [-1]) for j in g], 0) for g in groups]
        inside = {j for g in groups for j in g}
        singles = [j for j in range(len(dense)) if j not in inside]
        sent_names = [f"bucket{k}.{names[g[0]]}" for k, g in enumerate(groups)] + [names[j] for j in singles]
        reduced = self._containers.reduce(flats + [dense[j] for j in singles], sent_names, step, reports)
        out: List[Optional[tf.Tensor]] = [None] * len(dense)
        for g, total in zip(groups, reduced):
            for j, part in zip(g, tf.split(total, [dense[j].shape.num_elements() for j in g])):
                out[j] = tf.reshape(part, dense[j].shape)
        for j, total in zip(singles, reduced[len(groups):]):
            out[j] = total
        return out, sent_names

    def _agree(self, grads: Sequence, names: Sequence[str], bucket_sizes: Sequence) -> None:
        """Compare every rank's gradients, compressor and buckets ((label, elements) pairs) once
        per layout (at trace time or the first eager step; an eager allgather, lifted out of any
        ``tf.function`` being traced)."""
        shapes = [(n, tf.TensorShape(g.shape), g.dtype.name) for g, n in zip(grads, names) if g is not None]
        layout = agreement.layout_of(self.pipeline if self.pipeline is not None else self.hvd_compression,
                                     [(n, [] if s.rank is None else s.as_list(), d) for n, s, d in shapes],
                                     bucket_sizes, "gradient")
        key = (id(self.process_set), layout.digest)
        with tf.init_scope():
            if key in _AGREED or not tf.executing_eagerly():   # a TF1 graph being built: no collective can run now
                return
            agreement.agree(layout, lambda payload: self._communicator.allgather(payload, "DeepReduce_agreement"),
                            "deepreduce.tensorflow")
        _AGREED.add(key)

    def _finish_step(self, reduced: list, reports: list, names: List[str], step) -> list:
        """The gradients, once one op that waits for every report has ended the step by the
        protocol's ``end_step``: kept the step's residuals, or restored them and raised on every
        rank where a rank sent a non-finite container or could not encode (the first failed
        tensor in ``names``); under ``auto``, planned after the first step (rank 0 prints the table)."""
        protocol, lock = self._protocol, self.pipeline.lock

        def finish(step_value, *reports):   # the reports: inputs only, so that it runs after them
            with lock:
                protocol.end_step(int(step_value), order=names)
            return np.int64(0)

        done = graph_or_eager(finish, [step_tensor(step)] + reports, tf.int64, "deepreduce_finish_step")
        with tf.control_dependencies([done]):
            return [None if g is None else tf.identity(g) for g in reduced]

