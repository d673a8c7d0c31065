"""DeepReduce as a PyTorch DDP communication hook.

One line for the common case::

    model = torch.nn.parallel.DistributedDataParallel(net)
    state = deepreduce.torch.ddp.register(model, "configs/bf_p2.yaml")

or, in the style of PyTorch's ``PowerSGDState`` / ``powerSGD_hook``::

    state = DeepReduceState(process_group=None, compression="configs/bf_p2.yaml",
                            named_parameters=net.named_parameters())
    model.register_comm_hook(state, deepreduce_hook)

What happens to a bucket. DDP hands the hook a flat bucket of many parameters' gradients. The
bucket is cut back into one view per parameter (``bucket.parameters()`` in bucket order, no
padding), and each parameter is encoded on its own under its name, so Top-r ratios, Bloom filters,
seeds and error-feedback residuals mean exactly what they mean in
``deepreduce.torch.DistributedOptimizer`` (and a parameter's residual survives DDP's bucket
rebuild after the first iteration: it is keyed by name, not by bucket). The bucket then travels
by the config's ``aggregation`` (allgather by default: one collective per bucket in steady state;
the sparse all-reduce; or, under ``auto``, the planner's choice per bucket) and comes back
averaged, as DDP expects; :mod:`deepreduce.torch.ddp_bucket` says how. Ranks that disagree
(another config, another model, a rank whose encoder raised) fail together with the same error,
naming the bucket's parameters, never a hang. Under ``nonfinite: raise`` a rank's NaN/Inf
gradient travels as a flagged container and the step's last bucket raises the same
NonFiniteGradientError on every rank, with the residuals restored (DDP re-raises it from
``backward()`` as a RuntimeError carrying its text; catch it and skip the step, docs/ddp.md).

The hook itself only queues the bucket and returns a ``torch.futures.Future``; a per-state
worker thread encodes, communicates, decodes and completes the future, so the backward pass
never waits on communication (nor on encoding). The collectives run in a process group of their
own (created by the state over the same ranks), issued by that one thread in hook order: futures
chained on gloo complete on gloo's worker threads, and collectives issued from their callbacks
would reach the group in an order that can differ between ranks.

Whole buckets (``per_parameter=False``): the gradients of a bucket's parameters with at least
the config's ``min_numel`` elements are concatenated (in bucket order) and encoded as one tensor,
one container for all of them, as ``DistributedOptimizer(bucket_cap_mb=...)`` does
(:mod:`deepreduce.collective.buckets`: far less per-tensor cost for models with many tensors; a sparsifier
then selects over the concatenation); the smaller ones keep a container each. The concatenation
is named after its parameters (``bucket:<first>..<last>/<count>``), which keys its residual. DDP
rebuilds its buckets once, after the first iteration, in the order gradients became ready; the
new buckets start with fresh residuals (what the first iteration's buckets left unsent is
dropped).

Checkpoints: ``state.state_dict()`` holds the step counter, the error-feedback residuals and any
learned compressor state (SIDCo stage counts, GradiVeQ models); save it beside the model and
optimizer state and ``load_state_dict`` it after building the state on resume. A resumed run
sends byte-identical containers to one that never stopped. The state object also pickles
(``torch.save(state)``, as PyTorch's ``PowerSGDState``): process groups, the worker and its queue
stay behind and are made again in the loading process; ``register(model, state=loaded)`` binds it
to the restored model's parameters, and ``model.register_comm_hook(loaded, deepreduce_hook)`` (no
bind, as with ``PowerSGDState``) names them by the order DDP hands them over, which the state
recorded (:meth:`DeepReduceState._first_name`).
"""

import atexit
import queue
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import checkpoint
from ..collective import agreement, buckets, inflight, slots, totals
from ..collective.comm.torch_distributed import TorchDistributedCommunicator
from ..collective.protocol import ReductionProtocol
from ..errors import CommunicationError, ConfigError
from .arguments import build_pipeline, is_summable, named_parameter_map
from .checkpoint import compression_state_dict, load_compression_state_dict
from .ddp_bucket import BucketReduction, Job
from .summable import FP16Compressor

__all__ = ["DeepReduceState", "FP16Compressor", "deepreduce_hook", "register"]

# what a pickled DeepReduceState leaves out (DeepReduceState.__getstate__)
_PROCESS_LOCAL = ("_group", "_communicator", "_protocol", "_auto", "_slots", "_errors", "_jobs", "_worker", "_flats",
                  "process_group", "_named", "_stepping")


class DeepReduceState(BucketReduction):
    """Hyperparameters, state and statistics of the deepreduce DDP hook (one per DDP model).

    Hyperparameters:
        process_group: the group DDP reduces over (None: the default group). The state creates
            a private group over the same ranks for its collectives, so build it on every rank
            (like DDP itself), after ``torch.distributed.init_process_group``.
        compression: a deepreduce config (YAML path or dict), a built pipeline, or a summable
            compressor (``FP16Compressor``, ``deepreduce.torch.GradiVeQ``, Horovod's
            ``Compression.fp16``); None sends gradients losslessly.
        named_parameters: ``model.named_parameters()`` of the wrapped module; names key the
            residuals and seeds (the same names as the Horovod optimizer gives byte-identical
            containers). Without it parameters are named ``param.<k>`` in the order DDP first
            hands them over, which is the same on every rank.
        path: where the codecs run ("auto", "device", "host"; ``deepreduce.torch.pipeline``):
            "auto" compresses CUDA buckets on their device and decodes into them there.
        per_parameter: True (default): each parameter's gradient is its own container; False:
            a bucket's gradients of at least ``min_numel`` elements travel as one (see the module
            docstring, "Whole buckets").

    State: ``step`` (iterations communicated), the pipeline's residuals and learned state.
    Statistics: ``compression_stats()``.
    """

    def __init__(self, process_group=None, compression=None, named_parameters=None, path: str = "auto",
                 per_parameter: bool = True) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise CommunicationError("DeepReduceState: call torch.distributed.init_process_group first")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ConfigError(f"DeepReduceState: process_group must be a torch.distributed.ProcessGroup "
                              f"or None, got {type(process_group).__name__}")
        # hyperparameters
        self.process_group = process_group
        group = dist.group.WORLD if process_group is None else process_group
        self.world_size = dist.get_world_size(group)
        summable = is_summable(compression)
        self.pipeline = None if summable else build_pipeline(compression, path)
        self.compressor = compression if summable else None
        if not isinstance(per_parameter, bool):
            raise ConfigError(f"DeepReduceState: per_parameter must be True or False, got {per_parameter!r}")
        if not per_parameter and self.pipeline is None:
            raise ConfigError("DeepReduceState: per_parameter=False merges containers; a summable compressor "
                              "already sends each bucket as one all_reduce")
        self.per_parameter = per_parameter
        label, digest = agreement.compressor_identity(self.compressor or self.pipeline)
        self._compressor_id = (label if per_parameter else label + " (whole buckets)", digest)
        self._names = None if named_parameters is None else named_parameter_map(named_parameters)
        self._unbound: Optional[List[str]] = None   # an unpickled state's names, until bind()
        # (name, shape) of each parameter in the order DDP first handed it over (pickled): how an
        # unpickled state names a restored model's parameters without bind() (_first_name)
        self._handed: List[Tuple[str, Tuple[int, ...]]] = []
        # state
        self.step = 0
        # statistics
        self.stats = totals.new()
        self._process_local()
        self._connect()

    def _process_local(self) -> None:
        """What belongs to this process (not pickled): the private group (made by
        :meth:`_connect`, once per process, so that an unpickled state makes its own), the
        communicator, protocol and auto planner over it, the slot sizes, and the worker that alone
        issues collectives on it."""
        self.process_group, self._group = getattr(self, "process_group", None), None
        self._communicator = TorchDistributedCommunicator()   # layouts when ranks disagree; the sparse all-reduce
        core = None if self.pipeline is None else self.pipeline.core
        self._protocol = None if core is None else ReductionProtocol(core, self._communicator)
        self._auto = None if self._protocol is None else self._protocol.auto
        self._slots = slots.Slots()
        self._stepping = False   # a bucket of the step was handed over, its last one not yet
        self._errors: List[BaseException] = []   # the failed buckets of the step under way
        self._named: Dict[torch.Tensor, str] = {}   # every parameter named in this process
        self._flats: Dict[str, torch.Tensor] = {}   # per_parameter=False: each merge's flat tensor, by name
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        atexit.register(_close_at_exit, weakref.ref(self))

    def _connect(self) -> None:
        """Make the private process group over the ranks of ``process_group`` if this process has
        none yet (every rank gets here at the same point: construction, or an unpickled state's
        first bucket)."""
        if self._group is not None:
            return
        group = dist.group.WORLD if self.process_group is None else self.process_group
        self._group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend=dist.get_backend(group))
        self._communicator.group = self._group

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        """Everything but what belongs to this process: the process groups, the worker thread
        and its queue, the communicator and the merge buffers (as PyTorch's ``PowerSGDState``
        leaves out its process group). Parameters do not survive pickling: their names are
        kept, and :meth:`bind` attaches them to a model's parameters again."""
        self.wait_idle()
        state = {k: v for k, v in self.__dict__.items() if k not in _PROCESS_LOCAL}
        sparse = None if self._protocol is None else self._protocol.sparse
        state["_sparse_state"] = None if sparse is None else sparse.state_dict()
        if self._names is not None:
            state["_names"], state["_unbound"] = None, list(self._names.values())
        return state

    def __setstate__(self, state: dict) -> None:
        """A pickled state in this process: over the default process group (as
        ``PowerSGDState``), with its private group made on the first bucket. Call :meth:`bind`
        (or ``register(model, state=...)``) to give its parameters their names again; without it,
        the hook names them by the order DDP hands them over (:meth:`_first_name`)."""
        checkpoint.checked_progress("DeepReduceState", state.get("step"), state.get("stats"), totals.KEYS)
        state = dict(state)
        state.setdefault("_handed", [])   # pickled before the hand-over order was recorded
        sparse_state = state.pop("_sparse_state")
        self.__dict__.update(state)
        self._process_local()
        if sparse_state is not None:
            self._protocol.sparse.load_state_dict(
                checkpoint.checked_aggregation("DeepReduceState", sparse_state, self._protocol.sparse.communicator.size))

    def bind(self, named_parameters) -> None:
        """Name the parameters again after unpickling: ``model.named_parameters()`` of the model
        the hook is registered on (the names must be the pickled state's)."""
        mapping = named_parameter_map(named_parameters)
        if self._unbound is not None and sorted(self._unbound) != sorted(mapping.values()):
            missing = sorted(set(self._unbound) - set(mapping.values()))[:4]
            raise ConfigError(f"DeepReduceState.bind: the parameters' names differ from the pickled state's "
                              f"(missing: {missing}); pass the named_parameters of the same model")
        self._names, self._unbound = mapping, None
        self._named.clear()

    def __repr__(self) -> str:
        what = self.compressor if self.pipeline is None else self.pipeline.get_config()
        return f"DeepReduceState(world_size={self.world_size}, compression={what!r}, step={self.step})"

    # ------------------------------------------------------------------ the hook's side
    def _name(self, param: torch.Tensor) -> str:
        name = self._named.get(param)
        if name is None:
            name = self._named[param] = self._first_name(param)
        return name

    def _first_name(self, param: torch.Tensor) -> str:
        """The name of a parameter DDP hands over for the first time in this process: its name in
        ``named_parameters`` (given, or :meth:`bind`); else the name recorded at its position in
        the order DDP first handed parameters to this state (``_handed``, which pickles); else
        ``param.<k>`` for the k-th. A parameter is named before its bucket is encoded, so a pickled
        state recorded every name its residuals and seeds are keyed by, and an unpickled one that
        is registered without bind() (``model.register_comm_hook(state, deepreduce_hook)``, as
        PyTorch's PowerSGD state) names a restored model's parameters from the buckets alone:
        every rank alike, since DDP hands buckets over in index order. This assumes the restored
        model hands parameters over in the original's order (same model and DDP arguments, the
        hook registered before the first backward); a shape that differs from the recorded one
        is a ConfigError asking for bind()."""
        k, shape = len(self._named), tuple(param.shape)
        if self._names is not None:
            name = self._names.get(param)
            if name is None:
                raise ConfigError(f"DDP bucket holds a parameter of shape {shape} that is not in the "
                                  "named_parameters given to DeepReduceState (is the state registered on another "
                                  "model? pass model.module.named_parameters())")
        elif k < len(self._handed):
            name, recorded = self._handed[k]
            if tuple(recorded) != shape:
                raise ConfigError(f"DeepReduceState was unpickled: the parameter at position {k} of DDP's hand-over "
                                  f"order has shape {shape}, the state's {name!r} there {tuple(recorded)} (another "
                                  "model or bucketing); call state.bind(model.module.named_parameters()) before training")
        elif self._unbound is not None and self.step > 0:
            raise ConfigError(f"DeepReduceState was unpickled after {self.step} step(s) without the order of its "
                              "parameters (pickled by an older version, or given a state_dict before its first "
                              "bucket): call state.bind(model.module.named_parameters()) before training")
        else:
            name = f"param.{k}"
        if k == len(self._handed):
            self._handed.append((name, shape))
        return name

    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Queue one bucket for the worker; return the future DDP waits on."""
        self._connect()
        buffer = bucket.buffer()
        params = bucket.parameters()
        if buffer.is_sparse:   # DDP's sparse path: one parameter, its COO gradient
            if self.pipeline is None or self._protocol.sparse is not None:
                raise ConfigError(f"parameter {self._name(params[0])!r} has a sparse gradient: a summable compressor "
                                  "or the sparse all-reduce needs dense ones (build the model with sparse=False)")
            return self._queue(bucket, buffer, [buffer], [self._name(params[0])], merged=None)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        if offset != buffer.numel():
            raise CommunicationError(f"DDP bucket {bucket.index()} holds {buffer.numel()} elements, its parameters "
                                     f"{offset}: cannot cut it into per-parameter gradients")
        names = [self._name(p) for p in params]
        merged = None if self.per_parameter else \
            buckets.merge(names, [v.numel() for v in views], self.pipeline.core.min_numel)
        return self._queue(bucket, buffer, views, names, merged)

    def _queue(self, bucket: dist.GradBucket, buffer: torch.Tensor, views, names, merged) -> torch.futures.Future:
        job = Job(buffer, views, names, self.step, bucket.index(), bucket.is_last(),
                   torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future(),
                   merged)
        if self._auto is not None and job.step >= 1:
            # the backward timeline, which the worker reads after the step's last bucket; not of
            # the first step, whose buckets DDP rebuilds after it (no timeline: no plan yet)
            if not self._stepping:
                self._auto.restart_timeline()
            self._auto.ready(job.label, buffer.numel())
            if job.last:
                self._auto.backward_done()
        self._stepping = not job.last
        if job.last:
            self.step += 1
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="deepreduce-ddp", daemon=True)
            self._worker.start()
        self._jobs.put(job)
        # The worker completes job.future with the bucket or an exception object; the chained
        # future re-raises the latter, so DDP's wait fails with its message on this rank.
        return job.future.then(_unwrap)

    def _work(self) -> None:
        """The worker thread: reduce each queued bucket in hook order and complete its future;
        after the step's last bucket, end the step (:func:`deepreduce.collective.inflight.end_step`)."""
        while True:
            job = self._jobs.get()
            if job is None:   # close(): the worker ends before its process group goes
                self._jobs.task_done()
                return
            result, error = job.buffer, None
            try:
                result = self._reduce(job)
            except Exception as exc:  # every failure reaches DDP's wait on this rank
                error = exc
                self._errors.append(exc)
            if job.last:   # the step's residuals are kept (the auto planner plans), or undone and
                errors, self._errors = self._errors, []   # the same error raised on every rank
                try:
                    inflight.end_step(self._protocol, job.step, errors)
                except Exception as exc:
                    error = error or exc
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)
            self._jobs.task_done()

    def close(self) -> None:
        """Stop the worker thread, then release the private process group, in that order (a
        worker or gloo group left to interpreter teardown can abort the process). Called at
        exit; call it earlier to release the group while the program goes on."""
        worker, self._worker = self._worker, None
        if worker is not None and worker.is_alive():
            self._jobs.put(None)
            worker.join()
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    # ------------------------------------------------------------------ stats and checkpoints
    def wait_idle(self) -> None:
        """Block until every queued bucket is finished (DDP's backward already waits for them)."""
        self._jobs.join()

    def compression_stats(self) -> dict:
        """Hook-level totals: buckets, dense and wire bytes (this rank's payloads), bytes in the
        collectives (with padding), encode/communication/decode seconds, steps, relative volume."""
        self.wait_idle()
        out = totals.report(self.stats, steps=self.step)
        if self._protocol is not None:
            out.update(self._protocol.stats())
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


def _unwrap(future: torch.futures.Future) -> torch.Tensor:
    return future.value()


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
