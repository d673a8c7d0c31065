"""``DistributedOptimizer``: Horovod's optimizer contract, DeepReduce containers on the wire.

Like ``horovod.torch.DistributedOptimizer`` it wraps any torch optimizer (the contract:
:mod:`deepreduce.torch.horovod_contract`) and hooks every parameter, so that a gradient is
compressed and sent as soon as backward produces it; ``step()`` (or ``synchronize()``) waits for
the results. The difference is the wire: each rank encodes its gradient into a DeepReduce
container, containers (whose sizes differ per rank) travel by allgather, and every rank decodes
all of them and averages or sums. Horovod
is used through its public collectives only, never patched.

The hook hands each gradient (or full bucket, :mod:`deepreduce.torch.grad_buckets`) to a worker
thread (the step engine, :class:`deepreduce.collective.step.StepEngine`), which encodes it and starts its collective
while backward goes on. Starting Horovod collectives there is safe: ``horovod.torch`` allocates
handles under a mutex, its tensor queue is mutex-protected and its handle map is a dict updated
under the GIL; Horovod matches tensors by name, so the ranks need not enqueue in one order. Before
the first collective (and after ``add_param_group``) the ranks compare parameters and compressor
(:mod:`deepreduce.collective.agreement`): a mismatch is the same CommunicationError on every rank,
raised from ``backward()``, never a stall.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch

from ..collective import agreement, buckets
from ..collective.comm import Communicator
from ..collective.comm.horovod import HorovodCommunicator
from ..collective.ports import Pending
from ..collective.routes.dense import summed_dense
from ..collective.step import Item, StepEngine
from . import grad_buckets
from .arguments import build_pipeline, is_summable, parameter_names
from .grad_buckets import GradBucket
from .horovod_contract import HorovodOptimizer, check_arguments, graft
from .tensors import TorchTensors


class _DistributedOptimizer(HorovodOptimizer):
    """The Horovod contract grafted onto the wrapped optimizer's class; the reduction is the step
    engine's (:class:`deepreduce.collective.step.StepEngine`): a hook submits a gradient (or a full
    bucket), ``synchronize()`` finishes the step."""

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
        self._engine = StepEngine(self._pipeline, self._communicator, TorchTensors(), self._engine_allreduce,
                                  average=op == self._hvd.Average, background=background,
                                  compressor=self._compressor)
        self._protocol = self._engine.protocol   # its sparse all-reduce's state goes in checkpoints
        self._register_hooks()

    def add_param_group(self, param_group) -> None:
        self._optimizer_class.add_param_group(self, param_group)
        self._agreed = False         # the ranks compare their parameters again before the next step

    def _agree(self) -> None:
        """Plan the buckets, then let the engine compare every rank's parameters, buckets and
        compression (one small allgather) before the step's first collective."""
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._bucket_cap_mb is not None:
            self._buckets, self._bucket_of = grad_buckets.plan(params, self._names, self._bucket_cap_mb,
                                                               lambda p: not self._summed_dense(p))
        layout = agreement.Layout(
            agreement.compressor_identity(self._compressor if self._summable else self._pipeline),
            [(self._names[p], tuple(p.shape), str(p.dtype).replace("torch.", "")) for p in params]
            + [(f"<{b.name}>", (b.buffer.numel(),), "bucket") for b in self._buckets], "parameter")
        self._engine.begin(layout, "DistributedOptimizer")
        self._agreed = True

    def _engine_allreduce(self, tensor: torch.Tensor, item: Item, average: bool) -> Pending:
        """The engine's all-reduce port: Horovod's, in place, on the process set (averaging with
        the predivide factor where ``average``)."""
        handle = self._allreduce(item.name, tensor, self._op if average else self._hvd.Sum)
        return Pending(lambda: self._hvd.synchronize(handle))

    def _submit(self, p: torch.Tensor) -> None:
        """Hand ``p``'s finished gradient (or, once full, its bucket) to the engine. The engine's
        worker reads ``p.grad`` itself (no copy): autograd has finished writing it, and until
        ``step()``/``synchronize()`` nothing else may write it (as with Horovod, whose collectives
        work on ``p.grad`` in place)."""
        if not self._agreed:
            self._agree()
        if p.grad.is_sparse:   # it travels as entries, unless:
            self._sparse_gradient(p, "a summable compressor reduces dense codes" if self._summable
                                  else "it is in a bucket (bucket_cap_mb)" if p in self._bucket_of
                                  else None if self._protocol.sparse is None
                                  else "the sparse all-reduce reduces dense tensors")
        item = Item(self._names[p], self._step_count, p.grad, label=f"parameter {self._names[p]!r}", key=p,
                    replace=lambda new: setattr(p, "grad", new))
        if p in self._bucket_of:
            bucket, i = self._bucket_of[p]
            if not bucket.add(i, p.grad):
                return
            item = Item(bucket.name, self._step_count, bucket.buffer, label=f"bucket {bucket.label}", key=bucket,
                        written=bucket.copy_back)
        item.summed_dense = self._summed_dense(item.grad)
        self._engine.submit(item)

    def _summed_dense(self, grad: torch.Tensor) -> bool:   # a gradient, or its parameter (same shape)
        """Small float32 CPU gradients go to Horovod's fused all-reduce (routes.dense.summed_dense) when
        Horovod is the communicator."""
        return (not self._summable and isinstance(self._communicator, HorovodCommunicator)
                and grad.device.type == "cpu" and grad.dtype == torch.float32
                and summed_dense(self._pipeline.core, grad.numel()))

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
        step = self._step_count
        self._hand_over_the_rest()
        order = [self._names[p] for group in self.param_groups for p in group["params"]]
        try:
            self._engine.finish(step, order + [b.name for b in self._buckets])
        finally:
            self._end_passes()
            for bucket in self._buckets:
                bucket.reset()
            self._step_count += 1
        self._synchronized = True

    def compression_stats(self) -> dict:
        """The engine's figures (:meth:`deepreduce.collective.step.StepEngine.stats`: bytes before
        and after compression, encode / wait / decode seconds, routes taken, the aggregation's
        figures) and ``buckets`` (how many buckets the gradients travel in; 0 without
        ``bucket_cap_mb``)."""
        return dict(self._engine.stats(), buckets=len(self._buckets))


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
