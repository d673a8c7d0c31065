"""The TensorFlow custom-op library: loaded once, with an error that says how to rebuild it.

``scripts/build_tf_ops.sh`` compiles every ``csrc/*/tf_*.cpp`` (``REGISTER_OP`` + ``OpKernel``)
together with the pure C++ sources of the same folders (the functions the pybind11 extension
wraps too) into ``deepreduce/tensorflow/_deepreduce_ops.so``, against the installed TensorFlow
with ``tf.sysconfig`` flags. ``make setup`` runs it.

:func:`load` returns the op module (cached); :func:`available` tells whether it loads.
If the library is missing or was built against another TensorFlow (an upgrade changes the
ABI), :func:`load` raises :class:`~deepreduce.BackendUnavailableError` naming the rebuild
command. The TF pipeline itself never needs the ops: without them it runs every codec through
``tf.numpy_function`` over the NumPy core (same bytes, see :mod:`.pipeline`).
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Optional

import numpy as np
import tensorflow as tf

from .._native import forced_numpy
from ..errors import BackendUnavailableError, CommunicationError
from .pipeline import numpy_op

LIBRARY_NAME = "_deepreduce_ops.so"
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)
REBUILD_HINT = (
    "rebuild the TensorFlow custom ops against the installed TensorFlow with "
    "`bash scripts/build_tf_ops.sh` (or `make setup`) from the deepreduce project root"
)

_lock = threading.Lock()
_state = {"module": None, "error": None, "warned": False}


def load():
    """The loaded op module (``tf.load_op_library``), loaded at most once per process."""
    with _lock:
        if _state["module"] is not None:
            return _state["module"]
        if _state["error"] is not None:
            raise BackendUnavailableError(_state["error"])
        if not os.path.isfile(LIBRARY_PATH):
            _state["error"] = f"TensorFlow custom ops {LIBRARY_PATH} are not built; {REBUILD_HINT}"
            raise BackendUnavailableError(_state["error"])
        try:
            _state["module"] = tf.load_op_library(LIBRARY_PATH)
        except (tf.errors.NotFoundError, tf.errors.OpError, OSError) as exc:
            _state["error"] = (
                f"TensorFlow custom ops {LIBRARY_PATH} could not be loaded into TensorFlow "
                f"{tf.__version__} ({str(exc).strip()}); they were probably built against another "
                f"TensorFlow version; {REBUILD_HINT}"
            )
            raise BackendUnavailableError(_state["error"]) from exc
        return _state["module"]


def available() -> bool:
    """Whether the custom ops load (and ``DEEPREDUCE_BACKEND=numpy`` does not force NumPy)."""
    if forced_numpy():
        return False
    try:
        load()
    except BackendUnavailableError:
        return False
    return True


def _warn_once(message: str) -> None:
    if not _state["warned"]:
        _state["warned"] = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def accelerator_for(core, lock=None) -> Optional["OpsEncoder"]:
    """The custom-op encoder for ``core``'s codecs, or None when the numpy_function path is used.

    None when no codec of the config has a TF op (only the Bloom index codec and the polyfit
    value codec do), when ``DEEPREDUCE_BACKEND=numpy``, or when the library does not load
    (then one warning says how to rebuild it; the numpy_function path gives the same bytes).
    """
    if not OpsEncoder.routes(core):
        return None
    if forced_numpy():
        return None
    try:
        module = load()
    except BackendUnavailableError as exc:
        _warn_once(f"{exc}; using tf.numpy_function over the NumPy core instead (same bytes, slower)")
        return None
    return OpsEncoder(core, module, lock)


OPS_INDEX_CODECS = ("bloom",)
OPS_VALUE_CODECS = ("polyfit",)


class _Given:
    """A stand-in component that returns an encoding the custom ops already computed.

    The core pipeline then assembles the container from it exactly as from the real codec
    (same params, sections, permutation, error-feedback update and statistics).
    """

    def __init__(self, real, result) -> None:
        self._real = real
        self._result = result

    def __getattr__(self, attr):
        return getattr(self._real, attr)

    def select(self, flat, ctx):
        return self._result

    def encode(self, *args):
        return self._result


def _int64(value: int) -> int:
    """A uint64 as the int64 with the same bits (TF ops carry seeds in int64 tensors)."""
    return value - (1 << 64) if value >= (1 << 63) else value


class OpsEncoder:
    """Encodes with the Bloom build/query/select and polyfit kernels running as TF custom ops.

    Graph, per tensor (all ops, so it runs at every step inside ``tf.function``)::

        numpy_function prepare  error feedback + sparsifier (NumPy core), Bloom sizes and seeds
        DeepReduceBloomBuild    filter bytes of the selected indices        (custom op, bloom.h)
        DeepReduceBloomQuery    positives of the filter                     (custom op, bloom.h)
        DeepReduceBloomSelect   the policy's positives                      (custom op, bloom.h)
        tf.gather               their values from the compensated gradient
        DeepReduceFitEncode     polyfit permutation + payload               (custom op, fit.h)
        numpy_function finish   the core pipeline packs the container from these encodings,
                                updates the residual and the statistics

    Tensors the core sends dense (below ``min_numel``, or holding NaN/Inf) take a
    ``tf.cond`` branch that calls the core's encode directly. The container bytes are the
    core's: the custom ops wrap the same C++ functions as the Python extension.

    :meth:`decode_sum` is the receiving side: a parse stage, ``DeepReduceBloomQuery`` +
    ``DeepReduceBloomSelect`` and ``DeepReduceFitDecode`` per container, and an assemble
    stage in which the core finishes the decode with every check of its decoders.
    """

    def __init__(self, core, module, lock=None) -> None:
        self.core = core
        self.ops = module
        self.lock = lock if lock is not None else threading.RLock()
        self.bloom, self.fit = self.routed_codecs(core)

    @staticmethod
    def routed_codecs(core):
        """(bloom index via ops, polyfit values via ops) for a core pipeline.

        The fit op sees the values the value codec would see: the Bloom policy's values, or the
        sparsifier's when the index codec keeps their order; any other index codec (one that
        may change the values it passes on) keeps the fit in the numpy_function stage.
        """
        bloom = core.index.id in OPS_INDEX_CODECS
        fit = core.value.id in OPS_VALUE_CODECS and (bloom or core.index.keeps_order)
        return bloom, fit

    @classmethod
    def routes(cls, core) -> bool:
        return any(cls.routed_codecs(core))

    # ---------------------------------------------------------------- numpy stages
    def _prepare(self, name: str):
        from ..index import bloom as bloom_codec
        from ..pipeline import _as_float32

        core = self.core

        def prepare(grad, step):
            with self.lock:
                return _prepare(grad, step)

        def _prepare(grad, step):
            flat, _ = _as_float32(grad, name)
            empty = (np.int64(0), np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32),
                     np.zeros(6, np.int64))
            if flat.size < core.min_numel or not np.isfinite(flat).all():
                return empty
            compensated = np.ascontiguousarray(core.memory.compensate(name, flat), dtype=np.float32)
            ctx = core.context(name, int(step))
            indices = np.asarray(core.sparsifier.select(compensated, ctx), dtype=np.int64)
            values = compensated[indices]
            meta = np.zeros(6, np.int64)
            if self.bloom:
                index = core.index
                order = np.argsort(indices, kind="stable")
                indices, values = indices[order], values[order]
                blocks, k = bloom_codec.filter_params(int(indices.size), index.fpr)
                draw_seed = ctx.seed_for(f"bloom-{index.policy}") if index.policy in bloom_codec.DRAWING else 0
                d = int(flat.size)
                limit = indices.size if index.policy in ("naive", "leftmost") else d
                meta[:] = [blocks, k, _int64(index.hash_seed), _int64(draw_seed), d, limit]
            return np.int64(1), compensated, indices, values.astype(np.float32), meta

        return prepare

    def _finish(self, name: str):
        import copy
        import struct

        from ..index import bloom as bloom_codec
        from ..index._base import IndexEncoding
        from ..values._base import ValueEncoding

        core = self.core

        def finish(grad, indices, chosen, sent, bits, meta, perm, vpayload, step):
            view = copy.copy(core)   # shares memory, statistics and decoders with the core
            view.sparsifier = _Given(core.sparsifier, indices)
            if self.bloom:
                index = core.index
                blocks, k, seed, draw_seed = (int(v) & ((1 << 64) - 1) for v in meta[:4])
                params = bloom_codec.pack_params(index.policy, k, blocks, seed, draw_seed)
                view.index = _Given(index, IndexEncoding(params, bits.tobytes(), chosen.astype(np.int64),
                                                         sent.astype(np.float32)))
            if self.fit:
                value = core.value
                view.value = _Given(value, ValueEncoding(struct.pack("<BB", value.degree, value.coef_bytes),
                                                         vpayload.tobytes(), perm.astype(np.int64)))
            with self.lock:
                return view.encode(grad, name=name, step=int(step))

        return finish

    # ---------------------------------------------------------------- graph
    def _encode_graph(self, tensor: tf.Tensor, name: str, step: tf.Tensor) -> tf.Tensor:
        core = self.core
        ops = self.ops
        flag, compensated, indices, values, meta = numpy_op(
            self._prepare(name), [tensor, step], (tf.int64, tf.float32, tf.int64, tf.float32, tf.int64),
            name="deepreduce_prepare")

        def sparse():
            chosen, sent, bits = indices, values, tf.zeros([0], tf.uint8)
            if self.bloom:
                blocks, k, seed, draw_seed, d, limit = (meta[i] for i in range(6))
                bits = ops.deep_reduce_bloom_build(indices, blocks, k, seed)
                positives = ops.deep_reduce_bloom_query(bits, blocks, k, seed, d, limit)
                chosen = ops.deep_reduce_bloom_select(positives, tf.size(indices, out_type=tf.int64), blocks, k, seed,
                                                      draw_seed, policy=core.index.policy)
                if core.index.policy != "naive":
                    sent = tf.gather(compensated, chosen)
            perm, vpayload = tf.zeros([0], tf.int64), tf.zeros([0], tf.uint8)
            if self.fit:
                v = core.value
                perm, vpayload = ops.deep_reduce_fit_encode(sent, degree=v.degree, max_segments=v.segments,
                                                            min_points=v.min_points, coef_bytes=v.coef_bytes)
            return numpy_op(self._finish(name), [tensor, indices, chosen, sent, bits, meta, perm, vpayload, step],
                            tf.uint8, name="deepreduce_finish")

        def dense():
            def encode_dense(g, s):
                with self.lock:
                    return core.encode(g, name=name, step=int(s))

            return numpy_op(encode_dense, [tensor, step], tf.uint8, name="deepreduce_encode")

        out = tf.cond(tf.equal(flag, 1), sparse, dense)
        out.set_shape([None])
        return out

    def encode(self, tensor: tf.Tensor, name: str, step: tf.Tensor) -> tf.Tensor:
        """Encode one tensor; a tensor whose static size is below ``min_numel`` goes dense at once."""
        numel = tensor.shape.num_elements()
        if numel is not None and numel < self.core.min_numel:
            core = self.core

            def encode_dense(g, s):
                with self.lock:
                    return core.encode(g, name=name, step=int(s))

            out = numpy_op(encode_dense, [tensor, step], tf.uint8, name="deepreduce_encode")
            out.set_shape([None])
            return out
        return self._encode_graph(tensor, name, step)

    # ---------------------------------------------------------------- decode
    @property
    def routes_decode(self) -> bool:
        """Whether graph decode runs custom ops (Bloom positives/selection, polyfit values)."""
        return self.bloom or self.core.value.id in OPS_VALUE_CODECS

    def _parse(self, count: int, shape=None):
        """numpy stage: split the containers; per container the Bloom filter with its sizes and
        seeds, and the polyfit section with its count, where the ops can decode them."""
        import struct

        from .. import container
        from ..index import bloom as bloom_codec
        from ..values import polyfit as polyfit_codec

        core = self.core
        policy = core.index.policy if self.bloom else None
        fit = core.value.id in OPS_VALUE_CODECS
        fit_params = struct.pack("<BB", core.value.degree, core.value.coef_bytes) if fit else None

        def parse(buf):
            parts = container.split(buf)
            if len(parts) != count:
                raise CommunicationError(f"allgather returned {len(parts)} containers for {count} ranks")
            out = []
            for part in parts:
                c = container.unpack(part, shape, core.max_numel)   # bounded before the ops scan numel
                meta = np.zeros(8, np.int64)   # routed, blocks, k, seed, draw seed, numel, n, limit
                bits = np.zeros(0, np.uint8)
                vmeta = np.zeros(2, np.int64)  # routed, n
                vpay = np.zeros(0, np.uint8)
                if not c.dense and policy is not None and c.index_id == bloom_codec.BloomIndex.wire_id:
                    p = bloom_codec.unpack_params(c.index_params)
                    # a container of another policy or hash family (foreign config, format v1)
                    # is decoded by the core itself
                    if (p.family == "blocked" and p.policy == policy and len(c.index_section) == p.filter_bytes
                            and p.size > 0):
                        limit = c.n if p.policy in ("naive", "leftmost", "p0") else c.numel
                        meta[:] = [1, p.size, p.k, _int64(p.seed), _int64(p.draw_seed), c.numel, c.n, limit]
                        bits = np.frombuffer(c.index_section, dtype=np.uint8)
                if (not c.dense and fit and c.value_id == polyfit_codec.PolyFit.wire_id
                        and c.value_params == fit_params):
                    vmeta[:] = [1, c.n]
                    vpay = np.frombuffer(c.value_section, dtype=np.uint8)
                out += [bits, meta, vpay, vmeta]
            return out

        return parse

    def _assemble(self, shape, count: int, summed: bool):
        """numpy stage: the core decodes (and sums) the containers with what the ops produced."""
        import copy

        from .. import container
        from ..index import bloom as bloom_codec
        from ..values import polyfit as polyfit_codec

        core = self.core
        policy = core.index.policy if self.bloom else None
        bloom_key = ("index", bloom_codec.BloomIndex.wire_id)
        fit_key = ("value", polyfit_codec.PolyFit.wire_id)

        def assemble(buf, *results):
            parts = container.split(buf)
            # per codec, one entry per container whose section the core will decode (sparse,
            # that codec's wire id), in order; None where the ops did not handle it
            bloom_queue, fit_queue = [], []
            for i, part in enumerate(parts[:count]):
                chosen, npos, meta, values, vmeta = results[5 * i:5 * i + 5]
                if part.size <= 7 or part[5] & container.FLAG_DENSE:
                    continue
                if part[6] == bloom_key[1]:
                    bloom_queue.append((chosen, int(npos)) if meta[0] == 1 else (None, 0))
                if part[7] == fit_key[1]:
                    fit_queue.append(values if vmeta[0] == 1 else None)
            view = copy.copy(core)
            view._decoders = dict(core._decoders)
            if policy is not None:
                view._decoders[bloom_key] = _GivenBloomDecode(core._codec(*bloom_key), bloom_queue, policy)
            view._decoders[fit_key] = _GivenValues(core._codec(*fit_key), fit_queue)
            with self.lock:
                if summed:
                    return np.ascontiguousarray(view.decode_sum(parts, shape), dtype=np.float32)
                return np.ascontiguousarray(view.decode(parts[0], shape), dtype=np.float32)

        return assemble

    def decode_sum(self, gathered: tf.Tensor, shape, count: int, summed: bool = True) -> tf.Tensor:
        """Split, decode and sum ``count`` containers; Bloom query + policy selection and
        polyfit decode run as custom ops, the core assembles (with all its checks)."""
        ops = self.ops
        core = self.core
        dtypes = [tf.uint8, tf.int64, tf.uint8, tf.int64] * count
        parsed = numpy_op(self._parse(count, shape), [gathered], dtypes, name="deepreduce_parse")
        results = []
        for i in range(count):
            bits, meta, vpay, vmeta = parsed[4 * i:4 * i + 4]
            chosen, npos = tf.zeros([0], tf.int64), tf.constant(0, tf.int64)
            if self.bloom:
                blocks, k, seed, draw_seed, numel, n, limit = (meta[j] for j in range(1, 8))
                k = tf.maximum(k, 1)   # unrouted containers carry blocks = 0: the ops then return nothing
                positives = ops.deep_reduce_bloom_query(bits, blocks, k, seed, numel, limit)
                npos = tf.size(positives, out_type=tf.int64)
                chosen = ops.deep_reduce_bloom_select(positives, tf.minimum(n, npos), blocks, k, seed, draw_seed,
                                                      policy=core.index.policy)
            values = tf.zeros([0], tf.float32)
            if core.value.id in OPS_VALUE_CODECS:
                v = core.value
                values = tf.cond(
                    tf.equal(vmeta[0], 1),
                    lambda vpay=vpay, vmeta=vmeta: ops.deep_reduce_fit_decode(
                        vpay, vmeta[1], degree=v.degree, coef_bytes=v.coef_bytes),
                    lambda: tf.zeros([0], tf.float32))
            results += [chosen, npos, meta, values, vmeta]
        out = numpy_op(self._assemble(shape, count, summed), [gathered] + results, tf.float32,
                       name="deepreduce_decode_sum" if summed else "deepreduce_decode")
        if shape is not None:
            out.set_shape(shape)
        return out


class _GivenValues:
    """A value codec's decode with the values already decoded by a custom op (None: the codec runs)."""

    def __init__(self, real, queue) -> None:
        self._real = real
        self._queue = list(queue)

    def __getattr__(self, attr):
        return getattr(self._real, attr)

    def decode(self, params, payload, count):
        values = self._queue.pop(0) if self._queue else None
        if values is None:
            return self._real.decode(params, payload, count)
        return np.asarray(values, dtype=np.float32)


class _GivenBloomDecode:
    """The Bloom codec's decode, with the positives' query and policy selection already done by
    the custom ops; keeps every check of the core's decoder (counts, foreign policies)."""

    def __init__(self, real, queue, policy: str) -> None:
        self._real = real
        self._queue = list(queue)
        self._policy = policy

    def __getattr__(self, attr):
        return getattr(self._real, attr)

    def decode(self, params, payload, count, numel):
        from ..index import bloom as bloom_codec

        chosen, npos = self._queue.pop(0) if self._queue else (None, 0)
        p = bloom_codec.unpack_params(params)
        if (chosen is None or p.family != "blocked" or p.policy != self._policy or p.size == 0
                or len(payload) != p.filter_bytes):
            return self._real.decode(params, payload, count, numel)
        bloom_codec.check_positives(p.policy, int(npos), count)
        return np.asarray(chosen, dtype=np.int64)
