"""``DistributedOptimizer``: Horovod's optimizer contract, DeepReduce containers on the wire.

Like ``horovod.torch.DistributedOptimizer`` it wraps any torch optimizer (the contract:
:mod:`deepreduce.torch.horovod_contract`) and hooks every parameter, so that a gradient is
compressed and sent as soon as backward produces it; ``step()`` (or ``synchronize()``) waits for
the results. The difference is the wire: each rank encodes its gradient into a DeepReduce
container, containers (whose sizes differ per rank) travel by allgather, and every rank decodes
all of them and averages or sums (:class:`deepreduce.collective.protocol.ReductionProtocol`). Horovod
is used through its public collectives only, never patched.

The hook hands each gradient (or full bucket, :mod:`deepreduce.torch.grad_buckets`) to a worker
thread (:class:`deepreduce.collective.inflight.InFlight`), which encodes it and starts its collective
while backward goes on. Starting Horovod collectives there is safe: ``horovod.torch`` allocates
handles under a mutex, its tensor queue is mutex-protected and its handle map is a dict updated
under the GIL; Horovod matches tensors by name, so the ranks need not enqueue in one order. Before
the first collective (and after ``add_param_group``) the ranks compare parameters and compressor
(:mod:`deepreduce.collective.agreement`): a mismatch is the same CommunicationError on every rank,
raised from ``backward()``, never a stall.
"""
from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional

import torch

from ..collective import agreement, buckets, inflight
from ..collective.comm import Communicator
from ..collective.comm.horovod import HorovodCommunicator
from ..collective.protocol import ReductionProtocol
from . import grad_buckets
from .arguments import build_pipeline, is_summable, parameter_names
from .grad_buckets import GradBucket
from .horovod_contract import HorovodOptimizer, check_arguments, graft
from .sparse import entries, from_entries


class _DistributedOptimizer(HorovodOptimizer):
    """The reduction, grafted with the Horovod contract onto the wrapped optimizer's class.

    Each gradient (or bucket) travels by the route :func:`deepreduce.collective.inflight.route_of`
    gives it; a rank whose encode raised sends the protocol's failure payload instead.
    """

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, process_set, communicator, background, path="auto",
                 bucket_cap_mb=None, sparse_as_dense=False):
        self._optimizer_class.__init__(self, params)
        self._init_contract(backward_passes_per_step, op, gradient_predivide_factor, process_set, sparse_as_dense)
        self._names = parameter_names(self.param_groups, named_parameters)
        self._summable = is_summable(compression)
        self._compressor = compression if self._summable else None
        self._pipeline = None if self._summable else build_pipeline(compression, path)
        self._agreed = False         # ranks agreed on the parameters (agreement.agree) since they last changed
        self._bucket_cap_mb = buckets.check_bucket_cap_for(bucket_cap_mb, self._summable, "DistributedOptimizer")
        self._buckets: List[GradBucket] = []
        self._bucket_of: Dict[torch.Tensor, tuple] = {}    # parameter -> (bucket, its index there)
        self._communicator = communicator or self._horovod_communicator(
            None if self._pipeline is None else self._pipeline.core.communicator)
        self._protocol = None if self._summable else \
            ReductionProtocol(self._pipeline.core, self._communicator, average=op == self._hvd.Average)
        self._auto = None if self._protocol is None else self._protocol.auto
        self._flight = inflight.InFlight(background)
        self._register_hooks()

    def add_param_group(self, param_group) -> None:
        self._optimizer_class.add_param_group(self, param_group)
        self._agreed = False         # the ranks compare their parameters again before the next step

    def _agree(self) -> None:
        """Plan the buckets, then compare every rank's parameters, buckets and compression (one
        small allgather, :mod:`deepreduce.collective.agreement`) before the step's first collective."""
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._bucket_cap_mb is not None:
            self._buckets, self._bucket_of = grad_buckets.plan(params, self._names, self._bucket_cap_mb,
                                                               lambda p: not self._summed_dense(p))
        layout = agreement.Layout(
            agreement.compressor_identity(self._compressor if self._summable else self._pipeline),
            [(self._names[p], tuple(p.shape), str(p.dtype).replace("torch.", "")) for p in params]
            + [(f"<{b.name}>", (b.buffer.numel(),), "bucket") for b in self._buckets], "parameter")
        agreement.agree(layout, lambda payload: self._communicator.allgather(payload, "deepreduce.collective.agreement"),
                        "DistributedOptimizer")
        self._agreed = True

    # ----------------------------------------------------------------- start: the worker encodes and sends
    def _submit(self, p: torch.Tensor) -> None:
        """Hand ``p``'s finished gradient (or, once full, its bucket) to the worker, which encodes
        it and starts its collective (the ``auto`` plan sees it ready). The worker reads
        ``p.grad`` itself (no copy): autograd has finished writing it, and until
        ``step()``/``synchronize()`` nothing else may write it (as with Horovod, whose collectives
        work on ``p.grad`` in place)."""
        if not self._agreed:
            self._agree()
        if p.grad.is_sparse:   # it travels as entries, unless:
            self._sparse_gradient(p, "a summable compressor reduces dense codes" if self._summable
                                  else "it is in a bucket (bucket_cap_mb)" if p in self._bucket_of
                                  else None if self._protocol.sparse is None
                                  else "the sparse all-reduce reduces dense tensors")
        key, name, grad, label = p, self._names[p], p.grad, f"parameter {self._names[p]!r}"
        if p in self._bucket_of:
            bucket, i = self._bucket_of[p]
            if not bucket.add(i, p.grad):
                return
            key, name, grad, label = bucket, bucket.name, bucket.buffer, bucket.label
        step = self._step_count
        if self._auto is not None and not self._summed_dense(grad):
            self._auto.ready(name, grad.numel())
        self._flight.start(key, lambda: self._start(name, grad, step), label, step)

    def _start(self, name: str, grad: torch.Tensor, step: int):
        """Start ``grad``'s collective the way it travels; return (handle, route, data)."""
        summed_dense = self._summed_dense(grad)
        route = inflight.route_of(self._protocol, name, grad.is_sparse, summed_dense)
        if route == "summable":
            named = getattr(self._compressor, "accepts_name", False)
            code, ctx = self._compressor.compress(grad, name=name) if named else self._compressor.compress(grad)
            return self._allreduce(name, code, self._op), route, ctx
        if route == "entries":
            payload = self._pipeline.core.encode_entries(*entries(grad), tuple(grad.shape), name=name, step=step)
            return self._protocol.start(payload, name), route, step
        if route == "sparse_allreduce":   # synchronize() runs it, in one order on every rank
            return (name, step), route, None
        if route in ("dense", "fp16"):   # a small tensor, or the auto plan's choice: its residual goes too
            if summed_dense:
                self._pipeline.core.count_summed_dense(grad.numel())
            elif (residual := self._protocol.take_residual(name)) is not None:
                with torch.no_grad():
                    grad.add_(torch.from_numpy(residual).view_as(grad).to(grad.device, grad.dtype))
            sent = grad if route == "dense" else grad.to(torch.float16)
            return self._allreduce(name, sent, self._hvd.Sum), route, sent
        handle, failed = self._protocol.start_encoded(lambda: self._host_bytes(grad, name, step), name)
        return (handle, "failed", failed) if failed is not None else (handle, route, step)

    def _host_bytes(self, grad: torch.Tensor, name: str, step: int):
        payload = self._pipeline.encode(grad, name=name, step=step)
        return payload.numpy() if payload.device.type == "cpu" else payload   # device bytes stay there

    def _summed_dense(self, grad: torch.Tensor) -> bool:   # a gradient, or its parameter (same shape)
        """Small float32 CPU gradients go to Horovod's fused all-reduce (Pipeline.summed_dense) when
        Horovod is the communicator."""
        return (not self._summable and isinstance(self._communicator, HorovodCommunicator)
                and grad.device.type == "cpu" and grad.dtype == torch.float32
                and self._pipeline.core.summed_dense(grad.numel()))

    # ----------------------------------------------------------------- finish: wait, decode, write back
    def _finish(self, key, handle, route: str, data) -> None:
        """Wait for one collective and write the aggregated gradient into ``p.grad`` (or the
        bucket's gradients). The protocol decides, decodes and averages containers; a
        non-finite container of any rank is recorded there and nothing is written."""
        bucket = isinstance(key, GradBucket)
        target = key.buffer if bucket else key.grad
        name = key.name if bucket else self._names[key]
        label = f"bucket {key.label}" if bucket else f"parameter {name!r}"
        with self._flight.timed("communication_wait"):
            if route == "sparse_allreduce":
                total, found = self._protocol.reduce_sparse(target.detach().reshape(-1).cpu().numpy(), *handle)
            else:
                received = self._hvd.synchronize(handle) if route in ("summable", "dense", "fp16") else handle.wait()
        with torch.no_grad():
            if route == "summable":
                with self._flight.timed("decode"):
                    target.copy_(self._compressor.decompress(received, data).view_as(target))
            elif route in ("dense", "fp16"):   # summed by Horovod in place
                if route == "fp16":
                    target.copy_(data.view_as(target))
                if self._protocol.average:
                    target.div_(self._communicator.size)
            elif route == "sparse_allreduce":
                if found is not None:
                    return self._protocol.skip(*handle, found)
                target.copy_(torch.from_numpy(total).view_as(target))
            elif route == "entries":
                summed = self._protocol.finish_entries(received, name, data, tuple(target.shape), label)
                if summed is not None:
                    key.grad = from_entries(*summed, like=target)
            elif self._protocol.finish(
                    received, name, data,
                    lambda parts: self._pipeline.decode_sum(parts, expected_shape=tuple(target.shape), out=target),
                    target.div_, label) is not None:
                return
        if bucket:
            key.copy_back()

    def synchronize(self) -> None:
        """Wait for every parameter's encode and collective and write the aggregated gradients.

        An error of any parameter (raised on the worker, by the collective or by decoding) is
        re-raised here, with its type and message, once every other collective of the step
        finished; the next step works as usual. Under ``nonfinite: raise`` a NaN/Inf gradient on
        any rank makes every rank raise the same NonFiniteGradientError here with nothing written
        and the residuals restored, so catching it skips the step (see README).
        """
        if not self._member:
            self._synchronized = True
            return
        since, step = time.perf_counter(), self._step_count
        if self._auto is not None:
            self._auto.backward_done()
        self._hand_over_the_rest()
        try:
            errors = self._flight.finish(self._finish, since)
        finally:
            self._end_passes()
            for bucket in self._buckets:
                bucket.reset()
            self._step_count += 1
        order = [self._names[p] for group in self.param_groups for p in group["params"]]
        inflight.end_step(self._protocol, step, errors, order + [b.name for b in self._buckets])
        self._flight.steps += 1
        self._synchronized = True

    def compression_stats(self) -> dict:
        """The pipeline's bytes before and after compression and decode time (a summable
        compressor's: ``decode_seconds``, its decompress time), where the time went
        (:meth:`deepreduce.collective.inflight.InFlight.stats`), ``buckets`` (how many buckets the
        gradients travel in; 0 without ``bucket_cap_mb``) and the aggregation's figures."""
        stats = {} if self._pipeline is None else self._pipeline.stats.as_dict()
        if self._summable:
            stats.update(decode_seconds=self._flight.seconds["decode"])
        stats.update(self._flight.stats(), buckets=len(self._buckets))
        if self._protocol is not None:
            stats.update(self._protocol.stats())
        return stats


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression=None, backward_passes_per_step: int = 1, op=None,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, communicator: Optional[Communicator] = None,
                         background: bool = True, path: str = "auto", bucket_cap_mb: Optional[float] = None):
    """Wrap ``optimizer`` so its gradients travel as DeepReduce containers.

    Takes the arguments of ``horovod.torch.DistributedOptimizer``. ``compression`` is a config
    (YAML path or dict), a built pipeline, or a Horovod-style summable compressor; None sends
    gradients losslessly. ``op`` is ``hvd.Average`` (default) or ``hvd.Sum``. ``num_groups`` and
    ``groups`` are refused with a ConfigError (:func:`deepreduce.collective.buckets.refuse_groups`: use
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
    (:mod:`deepreduce.collective.buckets`: one selection, filter, container and allgather per bucket instead
    of per parameter; Top-r then selects over the bucket); gradients below the config's
    ``min_numel`` stay out of buckets.
    """
    op = check_arguments(op, backward_passes_per_step, gradient_predivide_factor, num_groups, groups)
    return graft(optimizer, _DistributedOptimizer)(
        optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
        gradient_predivide_factor, process_set, communicator, background, path, bucket_cap_mb, sparse_as_dense)
