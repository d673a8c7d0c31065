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
rebuild after the first iteration: it is keyed by name, not by bucket). Then, per bucket:

1. every rank all-gathers a 4-entry int64 header: its payload size (or -1 if encoding failed),
   the digest of its compressor, the digest of the bucket's layout (:class:`deepreduce.dist.agreement.Layout`:
   parameter names, shapes and dtypes, and the compressor), and its step;
2. every rank checks the headers; any disagreement (another config, another model, a rank whose
   encoder raised) raises the same error on every rank, naming the bucket's parameters, before
   any payload moves, so a mistake is an error and never a hang; where the digests differ, every
   rank gathers the others' layouts and names the first difference;
3. containers: the concatenation of the bucket's containers, padded to the longest rank's, goes
   through one ``all_gather`` (uint8 tensors on the bucket's device, so NCCL works); every rank
   splits each rank's bytes into containers, decodes and sums them per parameter and divides by
   the world size (DDP averages). Under ``nonfinite: raise`` a rank's NaN/Inf gradient travels
   as a flagged container; every rank sees the flag, skips decoding, and the step's last bucket
   raises the same NonFiniteGradientError on every rank after all its collectives, with the
   residuals restored (DDP re-raises it from ``backward()`` as a RuntimeError carrying its text;
   catch it and skip the step, docs/ddp.md). Summable compressors (``FP16Compressor``,
   ``deepreduce.torch.GradiVeQ``) instead concatenate their codes into one ``all_reduce``.

The hook itself only queues the bucket and returns a ``torch.futures.Future``; a per-state
worker thread encodes, communicates, decodes and completes the future, so the backward pass
never waits on communication (nor on encoding). The collectives run in a process group of their
own (created by the state over the same ranks), issued by that one thread in hook order: futures
chained on gloo complete on gloo's worker threads, and collectives issued from their callbacks
would reach the group in an order that can differ between ranks.

Whole buckets (``per_parameter=False``): the gradients of a bucket's parameters with at least
the config's ``min_numel`` elements are concatenated (in bucket order) and encoded as one tensor,
one container for all of them, as ``DistributedOptimizer(bucket_cap_mb=...)`` does
(:mod:`deepreduce.dist.buckets`: far less per-tensor cost for models with many tensors; a sparsifier
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
to the restored model's parameters.
"""

import atexit
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..dist import agreement
from ..dist.comm.torch_distributed import TorchDistributedCommunicator
from ..dist.protocol import ReductionProtocol
from ..errors import CommunicationError, ConfigError
from ..pipeline import Pipeline
from ..wire import container
from .arguments import LOSSLESS_CONFIG, named_parameter_map
from .checkpoint import compression_state_dict, load_compression_state_dict
from .pipeline import TorchPipeline, build
from .sparse import entries, from_entries

_FAILED = -1          # header size of a rank whose encoder raised
# what a pickled DeepReduceState leaves out (DeepReduceState.__getstate__)
_PROCESS_LOCAL = ("_group", "_communicator", "_protocol", "_jobs", "_worker", "_flats", "process_group")


class FP16Compressor:
    """Summable half precision: gradients travel as float16 through ``all_reduce``.

    The contract of Horovod's ``Compression.fp16`` (``compress`` -> (tensor, context),
    ``decompress``), so a ``DeepReduceState`` accepts either.
    """

    @staticmethod
    def compress(tensor: torch.Tensor):
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        return tensor.to(ctx)

    def __repr__(self) -> str:
        return "FP16Compressor()"


@dataclass
class _Job:
    """One bucket handed over by the hook."""

    buffer: torch.Tensor
    views: List[torch.Tensor]
    names: List[str]
    step: int
    last: bool                 # the step's last bucket (DDP's GradBucket.is_last)
    future: torch.futures.Future
    merged: Optional[tuple] = None   # per_parameter=False: (name, positions of the views encoded as one)

    def containers(self) -> List[str]:
        """What each container of this bucket holds: the merged gradients' name, then each
        other parameter's (all parameters in order when nothing is merged)."""
        if self.merged is None:
            return list(self.names)
        return [self.merged[0]] + [n for i, n in enumerate(self.names) if i not in self.merged[1]]


def _is_summable(obj) -> bool:
    return hasattr(obj, "compress") and hasattr(obj, "decompress") and not isinstance(obj, (Pipeline, TorchPipeline))


def _describe(names: List[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


class DeepReduceState:
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
        if compression is not None and _is_summable(compression):
            self.pipeline, self.compressor = None, compression
        else:
            self.pipeline = build(LOSSLESS_CONFIG if compression is None else compression, path=path)
            self.pipeline.core.collective_steps()
            self.compressor = None
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
        self._auto_names: Dict[torch.Tensor, str] = {}
        # state
        self.step = 0
        # statistics
        self.stats = {"buckets": 0, "dense_bytes": 0, "wire_bytes": 0, "collective_bytes": 0,
                      "encode_seconds": 0.0, "communication_seconds": 0.0, "decode_seconds": 0.0}
        # the private group (made by _connect, once per process, so that an unpickled state makes
        # its own), the communicator and protocol over it, and the worker that alone issues
        # collectives on it
        self._group = None
        self._communicator, self._protocol = self._make_protocol()
        self._flats: Dict[str, torch.Tensor] = {}   # per_parameter=False: each merge's flat tensor, by name
        self._jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        atexit.register(_close_at_exit, weakref.ref(self))
        self._connect()

    def _make_protocol(self):
        """(communicator, protocol); the communicator gets its process group in :meth:`_connect`."""
        communicator = TorchDistributedCommunicator()    # layouts when ranks disagree; the sparse all-reduce
        return communicator, None if self.pipeline is None else ReductionProtocol(self.pipeline.core, communicator)

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
        (or ``register(model, state=...)``) first when it was built with ``named_parameters``."""
        state = dict(state)
        sparse_state = state.pop("_sparse_state")
        self.__dict__.update(state)
        self.process_group, self._group = None, None
        self._communicator, self._protocol = self._make_protocol()
        if sparse_state is not None:
            self._protocol.sparse.load_state_dict(sparse_state)
        self._flats, self._jobs, self._worker, self._auto_names = {}, queue.Queue(), None, {}
        atexit.register(_close_at_exit, weakref.ref(self))

    def bind(self, named_parameters) -> None:
        """Name the parameters again after unpickling: ``model.named_parameters()`` of the model
        the hook is registered on (the names must be the pickled state's)."""
        mapping = named_parameter_map(named_parameters)
        if self._unbound is not None and sorted(self._unbound) != sorted(mapping.values()):
            missing = sorted(set(self._unbound) - set(mapping.values()))[:4]
            raise ConfigError(f"DeepReduceState.bind: the parameters' names differ from the pickled state's "
                              f"(missing: {missing}); pass the named_parameters of the same model")
        self._names, self._unbound = mapping, None

    def __repr__(self) -> str:
        what = self.compressor if self.pipeline is None else self.pipeline.get_config()
        return f"DeepReduceState(world_size={self.world_size}, compression={what!r}, step={self.step})"

    # ------------------------------------------------------------------ the hook's side
    def _name(self, param: torch.Tensor) -> str:
        if self._unbound is not None:
            raise ConfigError("DeepReduceState was unpickled: call state.bind(model.named_parameters()) (or "
                              "deepreduce.torch.ddp.register(model, state=state)) before training")
        if self._names is None:
            return self._auto_names.setdefault(param, f"param.{len(self._auto_names)}")
        name = self._names.get(param)
        if name is None:
            raise ConfigError(f"DDP bucket holds a parameter of shape {tuple(param.shape)} that is not in the "
                              "named_parameters given to DeepReduceState (is the state registered on another "
                              "model? pass model.module.named_parameters())")
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
        return self._queue(bucket, buffer, views, names, None if self.per_parameter else self._merged(names, views))

    def _queue(self, bucket: dist.GradBucket, buffer: torch.Tensor, views, names, merged) -> torch.futures.Future:
        job = _Job(buffer, views, names, self.step, bucket.is_last(),
                   torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future(),
                   merged)
        if bucket.is_last():
            self.step += 1
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="deepreduce-ddp", daemon=True)
            self._worker.start()
        self._jobs.put(job)
        # The worker completes job.future with the bucket or an exception object; the chained
        # future re-raises the latter, so DDP's wait fails with its message on this rank.
        return job.future.then(_unwrap)

    def _merged(self, names: List[str], views: List[torch.Tensor]) -> Optional[tuple]:
        """(name, positions) of the bucket's gradients encoded as one (those a container would
        carry: not small enough to be summed dense), or None when fewer than two are."""
        members = [i for i, v in enumerate(views) if v.numel() >= self.pipeline.core.min_numel]
        if len(members) < 2:
            return None
        return f"bucket:{names[members[0]]}..{names[members[-1]]}/{len(members)}", members

    # ------------------------------------------------------------------ the worker's side
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:   # close(): the worker ends before its process group goes
                self._jobs.task_done()
                return
            try:
                result = self._reduce(job)
                if job.last:
                    self._end_step(job)
                job.future.set_result(result)
            except Exception as exc:  # every failure reaches DDP's wait on this rank
                job.future.set_exception(exc)
            finally:
                self._jobs.task_done()

    def _reduce(self, job: _Job) -> torch.Tensor:
        device = job.buffer.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        start = time.perf_counter()
        failure, payload, codes = None, None, None
        sparse = self._protocol is not None and self._protocol.sparse is not None
        try:
            if self.pipeline is None:
                codes = self._compress(job)
            elif not sparse:   # the sparse all-reduce encodes its shards itself
                payload = self._encode(job)
        except Exception as exc:  # reported to every rank through the header, raised below
            failure = exc
        self.stats["encode_seconds"] += time.perf_counter() - start
        sent = payload if codes is None else codes[0]
        nbytes = _FAILED if failure is not None else 0 if sent is None else sent.numel() * sent.element_size()
        layout = agreement.Layout(self._compressor_id, [(n, tuple(v.shape), str(v.dtype).replace("torch.", ""))
                                                        for n, v in zip(job.names, job.views)], "parameter")
        headers = self._exchange_headers(job, nbytes, layout, device)
        self._check_agreement(job, headers, layout, failure, equal_sizes=codes is not None)
        self.stats["buckets"] += 1
        self.stats["dense_bytes"] += 4 * sum(v.numel() for v in job.views)
        self.stats["wire_bytes"] += nbytes
        if codes is not None:
            self._reduce_codes(job, *codes)
        elif sparse:
            self._reduce_sparse(job)
        else:
            if job.buffer.is_sparse:
                return self._gather_entries(job, payload, headers[:, 0])
            self._gather_and_decode(job, payload, headers[:, 0])
        return job.buffer

    def _exchange_headers(self, job: _Job, nbytes: int, layout: agreement.Layout, device) -> np.ndarray:
        header = torch.tensor([nbytes, layout.compressor_digest, layout.digest, job.step], dtype=torch.int64,
                              device=device)
        headers = [torch.empty_like(header) for _ in range(self.world_size)]
        start = time.perf_counter()
        dist.all_gather(headers, header, group=self._group)
        self.stats["communication_seconds"] += time.perf_counter() - start
        return torch.stack(headers).cpu().numpy()

    def _check_agreement(self, job: _Job, headers: np.ndarray, layout: agreement.Layout,
                         failure: Optional[Exception], equal_sizes: bool) -> None:
        where = f"DDP bucket with parameters {_describe(job.names)}"
        if len(set(headers[:, 1].tolist())) > 1 or len(set(headers[:, 2].tolist())) > 1:
            # every rank saw it: every rank gathers the layouts and names the same first difference
            raise CommunicationError(f"{where}: {agreement.explain(layout, self._allgather)}; every rank must run "
                                     "the same model with the same deepreduce config")
        if failure is not None:
            raise failure
        failed = [r for r in range(self.world_size) if headers[r, 0] == _FAILED]
        if failed:
            raise CommunicationError(f"{where}: rank(s) {failed} could not encode their gradients "
                                     "(their own error says why)")
        if len(set(headers[:, 3].tolist())) > 1:
            raise CommunicationError(f"{where}: ranks disagree about the step counter ({headers[:, 3].tolist()}); "
                                     "every rank must resume from the same checkpoint")
        if equal_sizes and len(set(headers[:, 0].tolist())) > 1:
            raise CommunicationError(f"{where}: ranks produced codes of different sizes "
                                     f"({headers[:, 0].tolist()} bytes) for an all_reduce; their "
                                     f"{self.compressor!r} states differ")

    # containers --------------------------------------------------------------
    def _encode(self, job: _Job) -> torch.Tensor:
        if job.buffer.is_sparse:
            positions, values = entries(job.buffer)
            payload = self.pipeline.core.encode_entries(positions, values, tuple(job.buffer.shape), name=job.names[0],
                                                        step=job.step)
            return torch.from_numpy(payload).to(job.buffer.device)
        if job.merged is None:
            parts = [self.pipeline.encode(view, name=name, step=job.step) for name, view in zip(job.names, job.views)]
        else:
            name, members = job.merged
            flat = self._merged_flat(job)
            torch.cat([job.views[i].reshape(-1) for i in members], out=flat)
            parts = [self.pipeline.encode(flat, name=name, step=job.step)]
            parts += [self.pipeline.encode(view, name=n, step=job.step)
                      for i, (n, view) in enumerate(zip(job.names, job.views)) if i not in members]
        return torch.cat(parts).to(job.buffer.device)

    def _merged_flat(self, job: _Job) -> torch.Tensor:
        """The flat tensor of a bucket's merged gradients, kept across steps (only the worker
        thread uses it): filled from their views to encode, then decoded into and spread back over
        them by :meth:`_copy_back`."""
        name, members = job.merged
        numel = sum(job.views[i].numel() for i in members)
        flat = self._flats.get(name)
        if flat is None or flat.numel() != numel or flat.device != job.buffer.device:
            flat = self._flats[name] = job.buffer.new_empty(numel)
        return flat

    def _targets(self, job: _Job) -> List[torch.Tensor]:
        """Where each container of the bucket decodes to: a view of the bucket, or, for merged
        gradients, their flat tensor (:meth:`_merged_flat`)."""
        if job.merged is None:
            return list(job.views)
        members = job.merged[1]
        return [self._merged_flat(job)] + [v for i, v in enumerate(job.views) if i not in members]

    @staticmethod
    def _copy_back(job: _Job, scratch: torch.Tensor) -> None:
        at = 0
        for i in job.merged[1]:
            view = job.views[i]
            view.copy_(scratch[at:at + view.numel()].view(view.shape))
            at += view.numel()

    def _gather(self, payload: torch.Tensor, sizes: np.ndarray) -> List[torch.Tensor]:
        """Every rank's bytes of the bucket: one ``all_gather`` of the payloads padded to the
        longest (``sizes``: each rank's byte count, from the headers)."""
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=payload.device)
        padded[:payload.numel()] = payload
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        start = time.perf_counter()
        dist.all_gather(gathered, padded, group=self._group)
        self.stats["communication_seconds"] += time.perf_counter() - start
        self.stats["collective_bytes"] += longest
        return [data[:int(size)] for data, size in zip(gathered, sizes)]

    def _gather_entries(self, job: _Job, payload: torch.Tensor, sizes: np.ndarray) -> torch.Tensor:
        """A sparse bucket (DDP puts each sparse gradient in a bucket of its own): every rank's
        entries summed and averaged into a coalesced COO gradient (:mod:`deepreduce.torch.sparse`)."""
        gathered = self._gather(payload, sizes)
        start = time.perf_counter()
        summed, shape = [], tuple(job.buffer.shape)
        self._protocol.finish(
            [data.cpu().numpy() for data in gathered], job.names[0], job.step,
            lambda parts: summed.append(self.pipeline.core.decode_entries(parts, shape)),
            lambda ranks: np.divide(summed[0][1], ranks, out=summed[0][1]), f"parameter {job.names[0]!r}")
        self.stats["decode_seconds"] += time.perf_counter() - start
        return from_entries(*summed[0], like=job.buffer) if summed else job.buffer

    def _gather_and_decode(self, job: _Job, payload: torch.Tensor, sizes: np.ndarray) -> None:
        gathered = self._gather(payload, sizes)
        start = time.perf_counter()
        per_rank = []
        names = job.containers()
        for rank, data in enumerate(gathered):
            parts = container.split(data)   # a device tensor is split into device slices
            if len(parts) != len(names):
                raise CommunicationError(f"rank {rank} sent {len(parts)} containers for a DDP bucket of "
                                         f"{len(names)} ({_describe(job.names)})")
            per_rank.append(parts)
        for i, (name, target) in enumerate(zip(names, self._targets(job))):
            self._protocol.finish(   # decoded straight into the bucket (on its device on the device path)
                [parts[i] for parts in per_rank], name, job.step,
                lambda payloads, t=target: self.pipeline.decode_sum(payloads, expected_shape=tuple(t.shape), out=t),
                target.div_, f"parameter {name!r}")
        if job.merged is not None:
            self._copy_back(job, self._targets(job)[0])
        self.stats["decode_seconds"] += time.perf_counter() - start

    def _reduce_sparse(self, job: _Job) -> None:
        """Each container's tensor through the sparse all-reduce (host arrays), in name order on
        every rank; the averages are written back into the bucket."""
        targets, names = self._targets(job), job.containers()
        if job.merged is not None:
            torch.cat([job.views[i].reshape(-1) for i in job.merged[1]], out=targets[0])
        start, sent = time.perf_counter(), self._protocol.sparse.sent_bytes
        for i in sorted(range(len(names)), key=names.__getitem__):
            target = targets[i]
            total, found = self._protocol.reduce_sparse(target.detach().reshape(-1).cpu().numpy(), names[i], job.step)
            if found is not None:
                self._protocol.skip(names[i], job.step, found)
                continue
            target.copy_(torch.from_numpy(total).view(target.shape))
        if job.merged is not None:
            self._copy_back(job, targets[0])
        self.stats["communication_seconds"] += time.perf_counter() - start
        self.stats["wire_bytes"] += self._protocol.sparse.sent_bytes - sent
        self.stats["collective_bytes"] += self._protocol.sparse.sent_bytes - sent

    def _allgather(self, payload: np.ndarray) -> List[np.ndarray]:
        return self._communicator.allgather(payload, "deepreduce.dist.agreement")

    def _end_step(self, job: _Job) -> None:
        """After the step's last bucket: keep its residuals, or, if any rank sent a non-finite
        container under ``nonfinite: raise``, undo them and raise the same error on every rank."""
        if self._protocol is not None:
            self._protocol.end_step(job.step)

    # summable codes -----------------------------------------------------------
    def _compress(self, job: _Job):
        codes, contexts = [], []
        named = getattr(self.compressor, "accepts_name", False)
        for name, view in zip(job.names, job.views):
            code, ctx = self.compressor.compress(view, name=name) if named else self.compressor.compress(view)
            codes.append(code)
            contexts.append(ctx)
        dtypes = {c.dtype for c in codes}
        if len(dtypes) != 1:
            raise ConfigError(f"{self.compressor!r} returned codes of several dtypes ({sorted(map(str, dtypes))}) "
                              "for one bucket; a summable compressor must use one dtype")
        return torch.cat([c.reshape(-1) for c in codes]), codes, contexts

    def _reduce_codes(self, job: _Job, flat: torch.Tensor, codes, contexts) -> None:
        start = time.perf_counter()
        dist.all_reduce(flat, group=self._group)
        self.stats["communication_seconds"] += time.perf_counter() - start
        self.stats["collective_bytes"] += flat.numel() * flat.element_size()
        start = time.perf_counter()
        offset = 0
        for code, ctx, view in zip(codes, contexts, job.views):
            summed = flat[offset:offset + code.numel()].view(code.shape)
            offset += code.numel()
            view.copy_(self.compressor.decompress(summed, ctx).view(view.shape) / self.world_size)
        self.stats["decode_seconds"] += time.perf_counter() - start

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
        out = dict(self.stats, steps=self.step)
        out["relative_volume"] = out["wire_bytes"] / out["dense_bytes"] if out["dense_bytes"] else 0.0
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
        self.stats.update(stats)


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
