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
from ..collective.comm.horovod import HorovodCommunicator, settled
from ..collective.ports import Pending
from ..collective.routes.dense import summed_dense
from ..collective.step import Item, StepEngine
from ..errors import ConfigError
from . import grad_buckets
from .arguments import build_pipeline, horovod, is_summable, parameter_names
from .checkpoint import compression_state_dict, load_compression_state_dict
from .grad_buckets import GradBucket
from .horovod_contract import HorovodOptimizer, graft
from .tensors import TorchTensors


class EngineReduction:
    """The Horovod optimizer's :class:`~deepreduce.torch.horovod_contract.Reduction`: the step
    engine's (:class:`deepreduce.collective.step.StepEngine`). ``submit`` hands a gradient (or a
    full bucket) to the engine, ``finish`` finishes the step. It is given the optimizer's
    ``trainable()`` parameters and its ``allreduce`` port, nothing else of it."""

    def __init__(self, optimizer: HorovodOptimizer, named_parameters, compression, communicator, background,
                 path="auto", bucket_cap_mb=None):
        self.trainable, self._allreduce, self._hvd = optimizer.trainable, optimizer.allreduce, optimizer._hvd
        self.names = parameter_names(optimizer.param_groups, named_parameters)
        self.summable = is_summable(compression)
        self.compressor = compression if self.summable else None
        self.pipeline = None if self.summable else build_pipeline(compression, path)
        self._agreed = False         # ranks agreed on the parameters (agreement.agree) since they last changed
        self._bucket_cap_mb = buckets.check_bucket_cap_for(bucket_cap_mb, self.summable, "DistributedOptimizer")
        self._buckets: List[GradBucket] = []
        self._bucket_of: Dict[torch.Tensor, tuple] = {}    # parameter -> (bucket, its index there)
        self.communicator = communicator or self._horovod_communicator(
            None if self.pipeline is None else self.pipeline.core.communicator, optimizer._process_set)
        self.engine = StepEngine(self.pipeline, self.communicator, TorchTensors(), self._engine_allreduce,
                                 average=optimizer._op == self._hvd.Average, background=background,
                                 compressor=self.compressor)
        self.protocol = self.engine.protocol   # its sparse all-reduce's state goes in checkpoints

    @staticmethod
    def _horovod_communicator(configured, process_set):
        """The communicator the config names, else Horovod's allgather; a Horovod one gathers
        within the process set."""
        comm = HorovodCommunicator() if configured is None else configured
        if isinstance(comm, HorovodCommunicator):
            comm.process_set = process_set
        return comm

    def name(self, p: torch.Tensor) -> str:
        return self.names[p]

    def parameters_changed(self) -> None:
        self._agreed = False         # the ranks compare their parameters again before the next step

    def _agree(self) -> None:
        """Plan the buckets, then let the engine compare every rank's parameters, buckets and
        compression (one small allgather) before the step's first collective."""
        if self._agreed:
            return
        params = self.trainable()
        if self._bucket_cap_mb is not None:
            self._buckets, self._bucket_of = grad_buckets.plan(params, self.names, self._bucket_cap_mb,
                                                               lambda p: not self._summed_dense(p))
        layout = agreement.Layout(
            agreement.compressor_identity(self.compressor if self.summable else self.pipeline),
            [(self.names[p], tuple(p.shape), str(p.dtype).replace("torch.", "")) for p in params]
            + [(f"<{b.name}>", (b.buffer.numel(),), "bucket") for b in self._buckets], "parameter")
        self.engine.begin(layout, "DistributedOptimizer")
        self._agreed = True

    def _engine_allreduce(self, tensor: torch.Tensor, item: Item, average: bool) -> Pending:
        """The engine's all-reduce port: Horovod's, in place, on the process set."""
        handle = self._allreduce(item.name, tensor, average)
        return Pending(lambda: settled(self._hvd, handle))

    def sparse_refusal(self, p: torch.Tensor) -> Optional[str]:
        self._agree()
        return ("a summable compressor reduces dense codes" if self.summable
                else "it is in a bucket (bucket_cap_mb)" if p in self._bucket_of
                else None if self.protocol.sparse is None
                else "the sparse all-reduce reduces dense tensors")

    def submit(self, p: torch.Tensor, step: int) -> None:
        """Hand ``p``'s finished gradient (or, once full, its bucket) to the engine. The engine's
        worker reads ``p.grad`` itself (no copy): autograd has finished writing it, and until
        ``step()``/``synchronize()`` nothing else may write it (as with Horovod, whose collectives
        work on ``p.grad`` in place)."""
        self._agree()
        item = Item(self.names[p], step, p.grad, label=f"parameter {self.names[p]!r}", key=p,
                    replace=lambda new: setattr(p, "grad", new))
        if p in self._bucket_of:
            bucket, i = self._bucket_of[p]
            if not bucket.add(i, p.grad):
                return
            item = Item(bucket.name, step, bucket.buffer, label=f"bucket {bucket.label}", key=bucket,
                        written=bucket.copy_back)
        item.summed_dense = self._summed_dense(item.grad)
        self.engine.submit(item)

    def _summed_dense(self, grad: torch.Tensor) -> bool:   # a gradient, or its parameter (same shape)
        """Small float32 CPU gradients go to Horovod's fused all-reduce (routes.dense.summed_dense) when
        Horovod is the communicator."""
        return (not self.summable and isinstance(self.communicator, HorovodCommunicator)
                and grad.device.type == "cpu" and grad.dtype == torch.float32
                and summed_dense(self.pipeline.core, grad.numel()))

    def finish(self, step: int) -> None:
        """The engine's finish in the parameters' order (then the buckets'); buckets are emptied
        for the next step whatever happened."""
        order = [self.names[p] for p in self.trainable()]
        try:
            self.engine.finish(step, order + [b.name for b in self._buckets])
        finally:
            for bucket in self._buckets:
                bucket.reset()

    def state_dict(self, step: int) -> dict:
        sparse = self.protocol.sparse
        return compression_state_dict(self.pipeline, self.compressor, step,
                                       None if sparse is None else sparse.state_dict())

    def load_state_dict(self, state: dict) -> int:
        return load_compression_state_dict(self.pipeline, self.compressor, state, "DistributedOptimizer",
                                           self.protocol.sparse)

    def stats(self) -> dict:
        """The engine's figures (:meth:`deepreduce.collective.step.StepEngine.stats`) and ``buckets``
        (how many buckets the gradients travel in; 0 without ``bucket_cap_mb``)."""
        return dict(self.engine.stats(), buckets=len(self._buckets))


def check_arguments(op, backward_passes_per_step, gradient_predivide_factor: float, num_groups: int, groups):
    """The factory's Horovod arguments checked (ConfigErrors naming the argument); returns ``op``
    (default ``hvd.Average``)."""
    hvd = horovod()
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
    return op


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

    def reduction(opt: HorovodOptimizer) -> EngineReduction:
        return EngineReduction(opt, named_parameters, compression, communicator, background, path, bucket_cap_mb)

    return graft(optimizer)(optimizer.param_groups, reduction, backward_passes_per_step, op,
                            gradient_predivide_factor, process_set, sparse_as_dense)
