"""DeepReduce as a PyTorch DDP communication hook.

One line for the common case::

    model = torch.nn.parallel.DistributedDataParallel(net)
    state = deepreduce.torch.ddp.register(model, "configs/bf_p2.yaml")

or, as PyTorch's PowerSGD hook: ``model.register_comm_hook(DeepReduceState(None, config,
net.named_parameters()), deepreduce_hook)``.

The hook hands each bucket to the step engine (:class:`deepreduce.collective.step.StepEngine`) as
one item whose parts are its parameters' gradients (:mod:`deepreduce.torch.ddp_bucket`) and
returns a future; the engine's worker encodes it and runs its collective while backward goes on
(the config's ``aggregation``: by default the bucket's containers in one collective; a summable
compressor's codes in one ``all_reduce``). The last bucket (``GradBucket.is_last``) makes the
worker finish the step (the ``nonfinite`` policy, averaging, commit or undo of the residuals),
then complete every bucket's future, or fail each with the step's error on every rank (DDP
re-raises it from ``backward()`` as a RuntimeError carrying its text; docs/ddp.md). Ranks that
disagree fail together with the same error, never a hang. The collectives run in a process group
of the state's own, issued by the engine's one worker; each bucket's carries a header the ranks
check (:mod:`deepreduce.collective.comm.torch_slots`).

Checkpoints: ``state.state_dict()`` (step, residuals, learned compressor state); a resumed run
sends byte-identical containers. The state also pickles (``torch.save(state)``, as
``PowerSGDState``): ``register(model, state=loaded)`` binds it to the restored model, and
``model.register_comm_hook(loaded, deepreduce_hook)`` names the parameters by the order DDP hands
them over (:meth:`deepreduce.torch.ddp_bucket.ParameterNames.first_name`).
"""

import atexit
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import checkpoint
from ..collective import agreement, totals
from ..collective.comm.torch_slots import SlottedTorchDistributed
from ..collective.step import StepEngine
from ..errors import CommunicationError, ConfigError
from . import ddp_bucket
from .arguments import build_pipeline, check_ddp_arguments, is_summable
from .checkpoint import compression_state_dict, load_compression_state_dict
from .ddp_bucket import ParameterNames, bucket_item
from .summable import FP16Compressor
from .tensors import TorchTensors

__all__ = ["DeepReduceState", "FP16Compressor", "deepreduce_hook", "register"]

# what a pickled DeepReduceState leaves out (DeepReduceState.__getstate__)
_PROCESS_LOCAL = ("_group", "_transport", "_engine", "_futures", "_flats", "_stepping", "process_group")


class DeepReduceState:
    """Hyperparameters, state and statistics of the deepreduce DDP hook (one per DDP model).

    Hyperparameters:
        process_group: the group DDP reduces over (None: the default group); the state makes a
            private group over its ranks, so build it on every rank after ``init_process_group``.
        compression: a deepreduce config (YAML path or dict), a built pipeline, or a summable
            compressor (``FP16Compressor``, ``deepreduce.torch.GradiVeQ``, Horovod's
            ``Compression.fp16``); None sends gradients losslessly.
        named_parameters: ``model.named_parameters()`` of the wrapped module (names key the
            residuals and seeds); without it, ``param.<k>`` in the order DDP hands them over.
        path: where the codecs run ("auto", "device", "host"; ``deepreduce.torch.pipeline``).
        per_parameter: True (default): a container per parameter; False: a bucket's gradients of
            at least ``min_numel`` elements as one (:mod:`deepreduce.torch.ddp_bucket`).

    State: ``step`` (iterations communicated), the pipeline's residuals and learned state.
    Statistics: ``compression_stats()``.
    """

    def __init__(self, process_group=None, compression=None, named_parameters=None, path: str = "auto",
                 per_parameter: bool = True) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise CommunicationError("DeepReduceState: call torch.distributed.init_process_group first")
        summable = is_summable(compression)
        check_ddp_arguments(process_group, per_parameter, summable)
        self.process_group, self.per_parameter = process_group, per_parameter
        self.world_size = dist.get_world_size(dist.group.WORLD if process_group is None else process_group)
        self.pipeline = None if summable else build_pipeline(compression, path)
        self.compressor = compression if summable else None
        label, digest = agreement.compressor_identity(self.compressor or self.pipeline)
        self._compressor_id = (label if per_parameter else label + " (whole buckets)", digest)
        self._names = ParameterNames(named_parameters)
        self.step = 0
        self.stats = totals.new()
        self._process_local()
        self._connect()

    def _process_local(self) -> None:
        """What belongs to this process (not pickled): group, transport, engine, the step's futures."""
        self.process_group, self._group = getattr(self, "process_group", None), None
        self._transport = SlottedTorchDistributed()
        self._transport.totals = self.stats
        self._engine = StepEngine(self.pipeline, self._transport, TorchTensors(), self._allreduce,
                                  compressor=self.compressor, allreduce_averages=False, worker="deepreduce-ddp")
        self._futures: List[tuple] = []   # (future, result) of each bucket of the step under way
        self._flats: Dict[str, torch.Tensor] = {}
        self._stepping = False            # a bucket of the step was handed over, its last one not yet
        atexit.register(_close_at_exit, weakref.ref(self))

    def _connect(self) -> None:
        """Make the private process group if this process has none (every rank does it at one point)."""
        if self._group is None:
            group = dist.group.WORLD if self.process_group is None else self.process_group
            self._group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend=dist.get_backend(group))
            self._transport.group = self._group

    def _allreduce(self, tensor: torch.Tensor, item, average: bool):
        return self._transport.allreduce(tensor, item.header)   # a sum: the routes divide

    _protocol = property(lambda self: self._engine.protocol)     # the sparse all-reduce's state is checkpointed
    _worker = property(lambda self: self._engine.worker.thread)  # the engine's thread, None when stopped

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        """All but what belongs to this process (as ``PowerSGDState`` leaves out its group)."""
        self.wait_idle()
        state = {k: v for k, v in self.__dict__.items() if k not in _PROCESS_LOCAL}
        sparse = None if self._protocol is None else self._protocol.sparse
        state["_sparse_state"] = None if sparse is None else sparse.state_dict()
        return state

    def __setstate__(self, state: dict) -> None:
        """A pickled state in this process (its private group made on the first bucket; see :meth:`bind`)."""
        checkpoint.checked_progress("DeepReduceState", state.get("step"), state.get("stats"), totals.KEYS)
        state = ParameterNames.upgrade(dict(state))
        sparse_state = state.pop("_sparse_state")
        self.__dict__.update(state)
        self._process_local()
        if sparse_state is not None:
            self._protocol.sparse.load_state_dict(
                checkpoint.checked_aggregation("DeepReduceState", sparse_state, self._protocol.sparse.communicator.size))

    def bind(self, named_parameters) -> None:
        """Name the parameters again after unpickling: ``model.module.named_parameters()``."""
        self._names.bind(named_parameters)

    def __repr__(self) -> str:
        what = self.compressor if self.pipeline is None else self.pipeline.get_config()
        return f"DeepReduceState(world_size={self.world_size}, compression={what!r}, step={self.step})"

    # ------------------------------------------------------------------ the hook's side
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Hand one bucket to the engine; return the future DDP waits on (the last bucket finishes the step)."""
        self._connect()
        names = [self._names.name(p, self.step) for p in bucket.parameters()]
        if bucket.buffer().is_sparse and (self.pipeline is None or self._protocol.sparse is not None):
            raise ConfigError(f"parameter {names[0]!r} has a sparse gradient: a summable compressor "
                              "or the sparse all-reduce needs dense ones (build the model with sparse=False)")
        item, result = bucket_item(bucket, names, self.step, self._compressor_id,
                                   None if self.compressor is None else repr(self.compressor),
                                   None if self.per_parameter else self.pipeline.core.min_numel, self._flats)
        if self._engine.auto is not None and self.step >= 1 and not self._stepping:
            self._engine.auto.restart_timeline()   # DDP rebuilt its buckets after the first step
        future = ddp_bucket.new_future(bucket.buffer())
        self._futures.append((future, result))
        self._engine.submit(item)
        self._stepping = not bucket.is_last()
        if bucket.is_last():
            futures, self._futures = self._futures, []
            self._engine.finish_later(self.step, [], lambda error: ddp_bucket.complete(futures, error))
            self.step += 1
        return future.then(ddp_bucket.unwrap)

    def close(self) -> None:
        """Stop the worker, then release the private group, in that order (either left to teardown can
        abort the process). Called at exit; call it earlier to release the group sooner."""
        self._engine.close()
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    # ------------------------------------------------------------------ stats and checkpoints
    def wait_idle(self) -> None:
        """Block until every bucket handed over is finished (DDP's backward already waits for them)."""
        self._engine.idle()

    def compression_stats(self) -> dict:
        """The engine's figures (:meth:`deepreduce.collective.step.StepEngine.stats`) and the hook's
        totals (:mod:`deepreduce.collective.totals`): buckets, bytes, steps, relative volume."""
        self.wait_idle()
        out = self._engine.stats()
        out.update((k, v) for k, v in totals.report(self.stats, steps=self.step).items()
                   if k not in ("encode_seconds", "decode_seconds"))   # the engine's count those
        return out

    def state_dict(self) -> dict:
        """Step counter, residuals and learned compressor state, plus the statistics, for ``torch.save``."""
        self.wait_idle()
        sparse = None if self._protocol is None else self._protocol.sparse
        return dict(compression_state_dict(self.pipeline, self.compressor, self.step,
                                           None if sparse is None else sparse.state_dict()), stats=dict(self.stats))

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (build the state with the same config first)."""
        if not isinstance(state, dict) or set(state.get("stats", ())) != set(self.stats):
            raise ConfigError("DeepReduceState.load_state_dict: expected the output of DeepReduceState.state_dict() "
                              "(a dict with 'stats' holding this version's counters)")
        self.wait_idle()
        state = dict(state)
        stats = state.pop("stats")
        self.step = load_compression_state_dict(self.pipeline, self.compressor, state, "DeepReduceState",
                                                None if self._protocol is None else self._protocol.sparse)
        self.stats.update(checkpoint.checked_totals("DeepReduceState", stats, totals.KEYS))


def _close_at_exit(ref) -> None:
    state = ref()
    if state is not None:
        state.close()


def deepreduce_hook(state: DeepReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``model.register_comm_hook(state, deepreduce_hook)``."""
    return state.submit(bucket)


def register(model: torch.nn.Module, compression=None, process_group=None, path: str = "auto",
             per_parameter: bool = True, state: Optional[DeepReduceState] = None) -> DeepReduceState:
    """Build a :class:`DeepReduceState` for a DDP ``model`` and register the hook; return the state.

    ``compression``, ``path`` and ``per_parameter`` as for DeepReduceState; ``process_group``
    defaults to the model's. ``state``: register this state instead (e.g. an unpickled one, which
    is bound to the model's parameters; the other arguments must then be left out).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise ConfigError(f"deepreduce.torch.ddp.register needs a torch.nn.parallel.DistributedDataParallel "
                          f"model, got {type(model).__name__}; wrap it first")
    existing = getattr(model, "_comm_hooks", [])
    if existing:
        raise ConfigError(f"this DDP model already has a communication hook ({existing[0][0].__qualname__}); "
                          "DDP accepts one per model")
    if state is not None:
        if compression is not None or process_group is not None:
            raise ConfigError("deepreduce.torch.ddp.register: pass either state= or compression/process_group")
        state.bind(model.module.named_parameters())
    else:
        state = DeepReduceState(model.process_group if process_group is None else process_group, compression,
                                model.module.named_parameters(), path, per_parameter)
    model.register_comm_hook(state, deepreduce_hook)
    return state
