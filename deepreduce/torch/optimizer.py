"""``DistributedOptimizer``: Horovod's optimizer contract, DeepReduce containers on the wire.

Like ``horovod.torch.DistributedOptimizer`` it wraps any torch optimizer, hooks every parameter
so that a gradient is compressed and sent as soon as backward produces it, and waits for the
results in ``step()`` (or ``synchronize()``). The difference is the wire: each rank encodes its
gradient into a DeepReduce container, containers (whose sizes differ per rank) travel by
allgather, and every rank decodes all of them and averages or sums. Horovod itself is used
through its public collectives only, never patched.

Encoding runs off the backward path: the hook hands the gradient to a background worker
(``deepreduce.torch.background``), which encodes it and starts its collective while backward
goes on; ``step()`` waits for every encode, then for the collectives, then decodes.
``background=False`` encodes inside the hook instead (same bytes, for debugging). Starting
Horovod collectives from the worker thread is safe: ``horovod.torch`` allocates handles under a
mutex (``HandleManager``), its tensor queue is mutex-protected, and the Python-side handle map is a
dict updated under the GIL. Horovod matches tensors across ranks by name, so the ranks need
not enqueue in the same order.

Before the first step's first collective (and after ``add_param_group``) the ranks compare their
parameters and compressor (:mod:`deepreduce.dist.agreement`): a mismatch is the same
CommunicationError on every rank, raised from ``backward()``, never a stall. Under ``nonfinite:
raise`` a NaN/Inf gradient on any rank makes ``step()`` raise the same NonFiniteGradientError on
every rank with nothing applied and the residuals restored, so the step can be skipped.

``bucket_cap_mb`` compresses the gradients of consecutive parameters as one tensor per bucket
(:mod:`deepreduce.dist.buckets`): the hook copies each finished gradient into its bucket's flat
buffer, the worker encodes a bucket once its last gradient is in, and ``step()`` decodes the
bucket and copies each slice back into its ``p.grad``.

A Horovod-style summable compressor (an object with ``compress``/``decompress``, such as
``deepreduce.torch.GradiVeQ`` or ``horovod.torch.Compression.fp16``) is also accepted; its output
is summed by allreduce instead (compressed and enqueued by the same worker).
"""
from __future__ import annotations

import contextlib
import time
import warnings
from concurrent.futures import Future
from typing import Dict, Iterable, List, Optional, Union

import torch

from ..dist import agreement, buckets
from ..dist.comm import Communicator
from ..dist.protocol import ReductionProtocol
from ..errors import ConfigError, DeepReduceError
from . import grad_buckets
from .arguments import build_pipeline, is_summable, parameter_names
from .background import EncodeWorker
from .checkpoint import compression_state_dict, load_compression_state_dict
from .grad_buckets import GradBucket
from .sparse import entries, from_entries


def _horovod():
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError(f"deepreduce.torch.DistributedOptimizer needs horovod.torch: {exc}. "
                                      "Run `make setup` to build Horovod.") from exc
    return hvd


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin whose methods are grafted onto the wrapped optimizer's class (as Horovod does).

    Each gradient (or bucket) travels one way, its *kind*: ``containers`` (allgather),
    ``sparse`` (the sparse all-reduce, run in ``synchronize``), ``entries`` (a sparse COO
    gradient), ``summable`` (the user's summable compressor), ``dense`` / ``fp16`` (Horovod's
    all-reduce: small tensors, or the ``auto`` plan's choice), ``failed`` (this rank's encode
    raised; its peers see it through the protocol's failure payload).
    """

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, process_set, communicator, background, path="auto",
                 bucket_cap_mb=None, sparse_as_dense=False):
        self._optimizer_class.__init__(self, params)
        self._hvd = _horovod()
        self._op, self._predivide, self._process_set = op, gradient_predivide_factor, process_set
        # Horovod's semantics: a rank outside the process set takes no part in its collectives
        # and applies its own gradients (no hooks, synchronize() returns at once)
        self._member = process_set is None or bool(process_set.included())
        self._names = parameter_names(self.param_groups, named_parameters)
        self._summable = is_summable(compression)
        self._compressor = compression if self._summable else None
        self._pipeline = None if self._summable else build_pipeline(compression, path)
        self._agreed = False         # ranks agreed on the parameters (agreement.agree) since they last changed
        self._bucket_cap_mb = buckets.check_bucket_cap_for(bucket_cap_mb, self._summable, "DistributedOptimizer")
        self._buckets: List[GradBucket] = []
        self._bucket_of: Dict[torch.Tensor, tuple] = {}    # parameter -> (bucket, its index there)
        self._copied: set = set()     # parameters of this step already copied into their bucket
        self._communicator = communicator or self._default_communicator()
        self._protocol = None if self._summable else \
            ReductionProtocol(self._pipeline.core, self._communicator, average=op == self._hvd.Average)
        self._worker = EncodeWorker(background)
        self.backward_passes_per_step = backward_passes_per_step
        self._delay: Dict[torch.Tensor, int] = {}
        self._pending: Dict[Union[torch.Tensor, GradBucket], Future] = {}   # a parameter or a bucket
        self._hook_handles: List = []
        self._sparse_as_dense = sparse_as_dense
        self._densified: Dict[torch.Tensor, int] = {}   # sparse_as_dense: parameter -> its gradient's sparse_dim
        self._step_count = 0
        self._should_synchronize = True
        self._synchronized = False
        self._warned_resynchronize = False
        self._times = dict.fromkeys(("encode", "encode_hidden", "encode_wait", "communication_wait",
                                     "summable_decode"), 0.0)
        self._steps_communicated = 0
        self._register_hooks()

    # ----------------------------------------------------------------- set-up
    def _default_communicator(self) -> Communicator:
        from ..dist.comm.horovod import HorovodCommunicator

        comm = self._pipeline.core.communicator if self._pipeline is not None else None
        comm = HorovodCommunicator() if comm is None else comm
        if isinstance(comm, HorovodCommunicator):
            comm.process_set = self._process_set
        return comm

    def _register_hooks(self) -> None:
        if not self._member:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._delay[p] = self.backward_passes_per_step
                    self._hook_handles.append(p.register_hook(self._make_pass_check(p)))
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook()))

    def _make_pass_check(self, p: torch.Tensor):
        """Refuse a backward pass beyond backward_passes_per_step *before* it accumulates into
        ``p.grad``, which the worker may be reading."""
        def check(grad: torch.Tensor) -> None:
            if self._delay[p] <= 0:
                raise DeepReduceError(
                    "gradients were computed more than backward_passes_per_step times before "
                    "optimizer.step(); raise backward_passes_per_step or call step() more often"
                )
        return check

    def _make_hook(self):
        def hook(p: torch.Tensor) -> None:
            self._delay[p] -= 1
            if self._delay[p] == 0:
                self._submit(p)
        return hook

    def add_param_group(self, param_group) -> None:
        self._optimizer_class.add_param_group(self, param_group)
        self._agreed = False         # the ranks compare their parameters again before the next step

    def _agree(self) -> None:
        """Compare every rank's parameters and compression (one small allgather, see
        :mod:`deepreduce.dist.agreement`) before this step's first per-tensor collective."""
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._bucket_cap_mb is not None:
            self._buckets, self._bucket_of = grad_buckets.plan(params, self._names, self._bucket_cap_mb,
                                                               lambda p: not self._summed_dense(p))
        layout = agreement.Layout(
            agreement.compressor_identity(self._compressor if self._summable else self._pipeline),
            [(self._names[p], tuple(p.shape), str(p.dtype).replace("torch.", "")) for p in params]
            + [(f"<{b.name}>", (b.buffer.numel(),), "bucket") for b in self._buckets], "parameter")
        agreement.agree(layout, lambda payload: self._communicator.allgather(payload, "deepreduce.dist.agreement"),
                        "DistributedOptimizer")
        self._agreed = True

    # ----------------------------------------------------------------- start: the worker encodes and sends
    def _submit(self, p: torch.Tensor) -> None:
        """Hand ``p``'s finished gradient to the worker, which encodes it and starts its collective.

        The worker reads ``p.grad`` itself (no copy): autograd has finished writing it (this is
        the last of backward_passes_per_step passes, and a further pass is refused before it
        accumulates), and until ``step()``/``synchronize()`` nothing else may write it (as with
        Horovod, whose collectives work on ``p.grad`` in place).
        """
        if not self._agreed:
            self._agree()
        if p.grad.is_sparse:
            self._check_sparse(p)
            if self._sparse_as_dense:   # as Horovod: reduced dense, handed back sparse (synchronize)
                self._densified[p] = p.grad.sparse_dim()
                p.grad = p.grad.to_dense()
        if p in self._bucket_of:
            self._copy_into_bucket(p)
        else:
            self._start_later(p, self._names[p], p.grad, f"parameter {self._names[p]!r}")

    def _check_sparse(self, p: torch.Tensor) -> None:
        """Refuse a sparse gradient where it cannot travel as entries (unless ``sparse_as_dense``)."""
        if self._sparse_as_dense:
            return
        where = ("a summable compressor reduces dense codes" if self._summable else
                 "it is in a bucket (bucket_cap_mb)" if p in self._bucket_of else
                 "the sparse all-reduce reduces dense tensors" if self._protocol.sparse is not None else None)
        if where is not None:
            raise ConfigError(f"parameter {self._names[p]!r} has a sparse gradient, but {where}: "
                              "pass sparse_as_dense=True")

    def _copy_into_bucket(self, p: torch.Tensor) -> None:
        """Copy ``p``'s finished gradient into its bucket; hand the bucket to the worker once it
        holds all of them (the worker then encodes the whole bucket under its name)."""
        bucket, i = self._bucket_of[p]
        with torch.no_grad():
            bucket.slice(i).copy_(p.grad.reshape(-1))
        self._copied.add(p)
        bucket.waiting -= 1
        if not bucket.waiting:
            self._start_later(bucket, bucket.name, bucket.buffer,
                              f"{bucket.name!r} (parameters {', '.join(self._names[q] for q in bucket.params)})")

    def _start_later(self, key, name: str, grad: torch.Tensor, label: str) -> None:
        """Queue ``grad``'s encode and collective on the worker; ``_pending[key]`` holds
        (handle, kind, data, (encode start, encode end))."""
        step = self._step_count
        if self._protocol is not None and self._protocol.auto is not None and not self._summed_dense(grad):
            self._protocol.auto.ready(name, grad.numel())

        def start():
            began = time.perf_counter()
            try:
                handle, kind, data = self._start(name, grad, step)
            except Exception as exc:
                exc.add_note(f"deepreduce: raised while encoding {label} at step {step}")
                raise
            return handle, kind, data, (began, time.perf_counter())

        self._pending[key] = self._worker.submit(start)

    def _start(self, name: str, grad: torch.Tensor, step: int):
        """Start ``grad``'s collective the way it travels; return (handle, kind, data)."""
        if self._summable:
            return self._allreduce(name, *self._compressor_codes(name, grad), self._op), "summable", None
        if grad.is_sparse:
            positions, values = entries(grad)
            payload = self._pipeline.core.encode_entries(positions, values, tuple(grad.shape), name=name, step=step)
            return self._protocol.start(payload, name), "entries", step
        if self._summed_dense(grad):
            self._pipeline.core.count_summed_dense(grad.numel())
            return self._allreduce(name, grad, None, self._hvd.Sum), "dense", None
        route = self._protocol.route(name)
        if route == "sparse_allreduce":   # synchronize() runs it, in one order on every rank
            return (name, step), "sparse", None
        if route in ("dense", "fp16"):
            residual = self._protocol.take_residual(name)
            if residual is not None:
                with torch.no_grad():
                    grad.add_(torch.from_numpy(residual).view_as(grad).to(grad.device, grad.dtype))
            sent = grad if route == "dense" else grad.to(torch.float16)
            return self._allreduce(name, sent, None, self._hvd.Sum), route, sent
        handle, failed = self._protocol.start_encoded(lambda: self._host_bytes(grad, name, step), name)
        return (handle, "failed", failed) if failed is not None else (handle, "containers", step)

    def _host_bytes(self, grad: torch.Tensor, name: str, step: int):
        payload = self._pipeline.encode(grad, name=name, step=step)
        return payload.numpy() if payload.device.type == "cpu" else payload   # device bytes stay there

    def _compressor_codes(self, name: str, grad: torch.Tensor):
        if getattr(self._compressor, "accepts_name", False):
            return self._compressor.compress(grad, name=name)
        return self._compressor.compress(grad)

    def _allreduce(self, name: str, tensor: torch.Tensor, ctx, op):
        """Start Horovod's in-place all-reduce of ``tensor`` (``op=Average`` with the predivide
        factor as Horovod applies it); return (handle, ctx)."""
        kwargs = {} if self._process_set is None else {"process_set": self._process_set}
        if op == self._hvd.Average:
            kwargs.update(prescale_factor=1.0 / self._predivide, postscale_factor=self._predivide)
        return self._hvd.allreduce_async_(tensor, name=f"deepreduce.{name}", op=op, **kwargs), ctx

    def _summed_dense(self, grad: torch.Tensor) -> bool:   # a gradient, or its parameter (same shape)
        """Small float32 CPU gradients go to Horovod's fused all-reduce (Pipeline.summed_dense) when
        Horovod is the communicator."""
        from ..dist.comm.horovod import HorovodCommunicator

        return (not self._summable and isinstance(self._communicator, HorovodCommunicator)
                and grad.device.type == "cpu" and grad.dtype == torch.float32
                and self._pipeline.core.summed_dense(grad.numel()))

    # ----------------------------------------------------------------- finish: wait, decode, write back
    def _finish(self, key, handle, kind: str, data) -> None:
        """Wait for one collective and write the aggregated gradient into ``p.grad`` (or the
        bucket's gradients). The protocol decides, decodes and averages containers; a
        non-finite container of any rank is recorded there and nothing is written."""
        start = time.perf_counter()
        bucket = isinstance(key, GradBucket)
        target = key.buffer if bucket else key.grad
        name, label = (key.name, f"bucket {key.name!r} (parameters {', '.join(self._names[q] for q in key.params)})") \
            if bucket else (self._names[key], f"parameter {self._names[key]!r}")
        if kind == "failed":
            handle.wait()
            raise data
        if kind in ("summable", "dense", "fp16"):   # summed by Horovod in place
            output = self._hvd.synchronize(handle[0])
            decode_start = time.perf_counter()
            self._times["communication_wait"] += decode_start - start
            with torch.no_grad():
                if kind == "summable":
                    target.copy_(self._compressor.decompress(output, handle[1]).view_as(target))
                    self._times["summable_decode"] += time.perf_counter() - decode_start
                    return
                if kind == "fp16":
                    target.copy_(data.view_as(target))
                if self._op == self._hvd.Average:
                    target.div_(self._communicator.size)
        elif kind == "sparse":
            total, found = self._protocol.reduce_sparse(target.detach().reshape(-1).cpu().numpy(), *handle)
            self._times["communication_wait"] += time.perf_counter() - start
            if found is not None:
                return self._protocol.skip(*handle, found)
            with torch.no_grad():
                target.copy_(torch.from_numpy(total).view_as(target))
        elif kind == "entries":
            payloads = handle.wait()
            self._times["communication_wait"] += time.perf_counter() - start
            summed = self._protocol.finish_entries(payloads, name, data, tuple(target.shape), label)
            if summed is not None:
                key.grad = from_entries(*summed, like=target)
            return
        else:
            payloads = handle.wait()
            self._times["communication_wait"] += time.perf_counter() - start
            if self._protocol.finish(
                    payloads, name, data,
                    lambda parts: self._pipeline.decode_sum(parts, expected_shape=tuple(target.shape), out=target),
                    target.div_, label) is not None:
                return
        if bucket:
            key.copy_back()

    def synchronize(self) -> None:
        """Wait for every parameter's encode and collective and write the aggregated gradients.

        An error of any parameter (raised on the worker, by the collective or by decoding) is
        re-raised here, with its type and message, after every other pending collective has
        been waited for; the optimizer is then ready for the next step. Under ``nonfinite:
        raise`` a NaN/Inf gradient on any rank makes every rank raise the same
        NonFiniteGradientError here: nothing is written to the optimizer's step, and the
        residuals are restored, so catching it and going on skips the step (see README).
        """
        if not self._member:
            self._synchronized = True
            return
        wait_start = time.perf_counter()
        step = self._step_count
        if self._protocol is not None and self._protocol.auto is not None:
            self._protocol.auto.backward_done()
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and p not in self._pending and p not in self._copied:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    self._submit(p)
        errors: List[BaseException] = []
        try:
            started = self._wait_for_encodes(wait_start, errors)
            # the sparse all-reduce runs its collectives now: last, in one order on every rank
            started.sort(key=lambda entry: (entry[2] == "sparse", entry[1][0] if entry[2] == "sparse" else ""))
            for key, handle, kind, data in started:
                try:
                    self._finish(key, handle, kind, data)
                except Exception as exc:  # keep draining the other collectives first
                    errors.append(exc)
        finally:
            for p, sparse_dim in self._densified.items():
                p.grad = p.grad.to_sparse(sparse_dim)
            self._densified.clear()
            self._pending.clear()
            self._copied.clear()
            for bucket in self._buckets:
                bucket.reset()
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
            self._step_count += 1
        if self._protocol is not None:
            order = [self._names[p] for group in self.param_groups for p in group["params"]]
            self._protocol.end_step(step, errors, order + [b.name for b in self._buckets])
        elif errors:
            raise errors[0]
        self._steps_communicated += 1
        self._synchronized = True

    def _wait_for_encodes(self, wait_start: float, errors: List[BaseException]):
        """Wait for the worker; return (key, handle, kind, data) of every collective it started."""
        started = []
        for key, future in self._pending.items():
            try:
                handle, kind, data, (encode_start, encode_end) = future.result()
            except Exception as exc:
                errors.append(exc)
                continue
            started.append((key, handle, kind, data))
            self._times["encode"] += encode_end - encode_start
            if self._worker.background:
                self._times["encode_hidden"] += max(0.0, min(encode_end, wait_start) - encode_start)
        self._times["encode_wait"] += time.perf_counter() - wait_start
        return started

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (e.g. for gradient clipping) around ``step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless inside :meth:`skip_synchronize`), then the wrapped optimizer's step.

        As in Horovod, ``step()`` after an explicit ``synchronize()`` outside
        ``skip_synchronize()`` warns (once per optimizer) and synchronizes again. A step that
        initialises the optimizer's state (:meth:`_initialising_state`) is local: no collective.
        """
        if self._should_synchronize and not self._initialising_state():
            if self._synchronized and not self._warned_resynchronize:
                self._warned_resynchronize = True
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(); the gradients are reduced again, which slows training. "
                              "Use `with optimizer.skip_synchronize(): optimizer.step()` after synchronize().",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._optimizer_class.step(self, closure)

    def _initialising_state(self) -> bool:
        """Whether this ``step()`` is the local one by which Horovod initialises optimizer state.

        ``hvd.broadcast_optimizer_state`` gives a rank whose optimizer has no state yet (a fresh
        rank, while rank 0 resumed from a checkpoint) zero gradients directly, without backward,
        and calls ``step()`` on that rank alone; a collective there would wait forever for ranks
        that never join. Recognised as: no backward pass handed over a gradient since the last
        step, the optimizer holds no state, and every gradient exists and is all zero. Averaging
        such gradients would leave them unchanged, so the local step is exactly the collective
        one's result, and it leaves the compression state (step counter, residuals) untouched.
        """
        if self._pending or self._copied or any(d != self.backward_passes_per_step for d in self._delay.values()):
            return False
        if any(self.state.get(p) for group in self.param_groups for p in group["params"]):
            return False
        grads = [p.grad for p in self._delay]
        return all(g is not None and not (g.coalesce().values() if g.is_sparse else g).any() for g in grads)

    def zero_grad(self, set_to_none: bool = True):
        if self._pending or self._copied:
            raise DeepReduceError("optimizer.zero_grad() called after backward() but before step() or synchronize()")
        return self._optimizer_class.zero_grad(self, set_to_none=set_to_none)

    # ----------------------------------------------------------------- stats
    def compression_stats(self) -> dict:
        """Bytes before and after compression and where the time went.

        ``encode_seconds``: wall time of the encodes (pipeline encode, or the summable
        compressor's compress) of the steps taken; ``decode_seconds``: the pipeline's decode time
        (or decompress time). ``encode_hidden_seconds``: the part of ``encode_seconds`` that ran
        before ``step()``/``synchronize()`` started waiting, i.e. behind backward (always 0 with
        ``background=False``; where ranks have fewer cores than busy threads, "hidden" encode
        time still shares the CPU with backward). ``encode_wait_seconds``:
        time step() waited for the worker; ``communication_wait_seconds``: time it then waited for
        the collectives; ``buckets``: how many buckets the gradients travel in (0 without
        ``bucket_cap_mb``).
        """
        stats = {} if self._pipeline is None else self._pipeline.stats.as_dict()
        if self._summable:
            stats.update(decode_seconds=self._times["summable_decode"])
        stats.update(encode_seconds=self._times["encode"], steps=self._steps_communicated,
                     background=self._worker.background, encode_hidden_seconds=self._times["encode_hidden"],
                     encode_wait_seconds=self._times["encode_wait"], buckets=len(self._buckets),
                     communication_wait_seconds=self._times["communication_wait"])
        if self._protocol is not None:
            stats.update(self._protocol.stats())
        return stats

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self):
        """The wrapped optimizer's state dict plus, under ``"deepreduce"``, the step counter, the
        pipeline's residuals and learned state (or the summable compressor's, e.g. GradiVeQ models).

        Save it as usual (``torch.save(optimizer.state_dict(), ...)``); a run resumed with
        ``load_state_dict`` sends byte-identical containers to one that never stopped.
        """
        if self._pending or self._copied:
            raise DeepReduceError("optimizer.state_dict() called after backward() but before step()")
        out = self._optimizer_class.state_dict(self)
        sparse = None if self._protocol is None else self._protocol.sparse
        out["deepreduce"] = compression_state_dict(self._pipeline, self._compressor, self._step_count,
                                                   None if sparse is None else sparse.state_dict())
        return out

    def load_state_dict(self, state_dict):
        """Restore both parts of :meth:`state_dict`; a plain torch optimizer state dict (no
        ``"deepreduce"`` entry) restores the optimizer and leaves the compression state as it is."""
        state_dict = dict(state_dict)
        compression = state_dict.pop("deepreduce", None)
        if compression is not None:
            self._step_count = load_compression_state_dict(self._pipeline, self._compressor, compression,
                                                           "DistributedOptimizer",
                                                           None if self._protocol is None else self._protocol.sparse)
        self._optimizer_class.load_state_dict(self, state_dict)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression=None, backward_passes_per_step: int = 1, op=None,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, communicator: Optional[Communicator] = None,
                         background: bool = True, path: str = "auto", bucket_cap_mb: Optional[float] = None):
    """Wrap ``optimizer`` so its gradients travel as DeepReduce containers.

    Takes the arguments of ``horovod.torch.DistributedOptimizer``. ``compression`` is a config
    (YAML path or dict), a built pipeline, or a Horovod-style summable compressor; None sends
    gradients losslessly. ``op`` is ``hvd.Average`` (default) or ``hvd.Sum``. ``num_groups`` and
    ``groups`` are refused with a ConfigError (:func:`deepreduce.dist.buckets.refuse_groups`: use
    ``bucket_cap_mb``). Sparse COO gradients (``nn.Embedding(sparse=True)``) travel as their
    touched entries and come back sparse (:mod:`deepreduce.torch.sparse`); ``sparse_as_dense=True``
    reduces them dense and hands them back sparse, as Horovod does. ``process_set``: as Horovod's,
    ranks outside the set apply their own gradients. ``communicator`` overrides the config's (default: Horovod allgather).
    ``background`` (default True) encodes on a worker thread while backward goes on; False encodes
    inside the backward hook (identical bytes; simpler to debug). ``path`` ("auto", "device",
    "host"; see ``deepreduce.torch.pipeline``): where the codecs run; "auto" compresses CUDA
    gradients on their device (only the compressed bytes leave it) and CPU ones with the C++
    kernels; every path sends the same bytes and gives the same parameters. ``bucket_cap_mb``
    (default None: every gradient is its own container) compresses the gradients of consecutive
    parameters, in backward order, as one tensor per bucket of at most that many MiB
    (:mod:`deepreduce.dist.buckets`: one selection, filter, container and allgather per bucket instead
    of per parameter; Top-r then selects over the bucket); gradients below the config's
    ``min_numel`` stay out of buckets.
    """
    hvd = _horovod()
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ConfigError("DistributedOptimizer: op must be hvd.Average or hvd.Sum; Adasum does not apply to "
                          "compressed containers")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ConfigError(f"DistributedOptimizer: backward_passes_per_step must be a positive integer, "
                          f"got {backward_passes_per_step!r}")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ConfigError("DistributedOptimizer: gradient_predivide_factor requires op=hvd.Average")
    buckets.refuse_groups(num_groups, groups, "DistributedOptimizer")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    cls._optimizer_class = optimizer.__class__   # the wrapped optimizer's methods, however cls is subclassed
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, process_set, communicator, background, path, bucket_cap_mb,
               sparse_as_dense)
