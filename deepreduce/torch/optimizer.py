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
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Union

import numpy as np
import torch

from ..dist import agreement, buckets
from ..dist.comm import Communicator
from ..dist.protocol import ReductionProtocol
from ..errors import ConfigError, DeepReduceError
from ..pipeline import Pipeline
from .background import EncodeWorker
from .checkpoint import compression_state_dict, load_compression_state_dict
from .pipeline import TorchPipeline, build
from .sparse import entries, from_entries

LOSSLESS_CONFIG = {"sparsifier": {"id": "none"}, "index": {"id": "raw"}, "value": {"id": "raw"},
                   "memory": {"id": "none"}}


def _horovod():
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError(f"deepreduce.torch.DistributedOptimizer needs horovod.torch: {exc}. "
                                      "Run `make setup` to build Horovod.") from exc
    return hvd


@dataclass(eq=False)
class _Bucket:
    """Gradients of consecutive parameters sent as one tensor (see :mod:`deepreduce.dist.buckets`)."""
    name: str
    params: List[torch.Tensor]
    offsets: List[int]
    buffer: torch.Tensor          # flat float32, on the parameters' device
    waiting: int = 0              # gradients of this step not yet copied in

    def slice(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()]


def _is_summable_compressor(obj) -> bool:
    return hasattr(obj, "compress") and hasattr(obj, "decompress") and not isinstance(obj, (Pipeline, TorchPipeline))


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin whose methods are grafted onto the wrapped optimizer's class (as Horovod does)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, process_set, communicator, background, path="auto",
                 bucket_cap_mb=None, sparse_as_dense=False):
        self._optimizer_class.__init__(self, params)
        hvd = _horovod()
        self._hvd = hvd
        self._op = op
        self._predivide = gradient_predivide_factor
        self._process_set = process_set
        # Horovod's semantics: a rank outside the process set takes no part in its collectives
        # and applies its own gradients (no hooks, synchronize() returns at once)
        self._member = process_set is None or bool(process_set.included())
        self._names = _parameter_names(self.param_groups, named_parameters)
        self._summable = _is_summable_compressor(compression)
        if self._summable:
            self._compressor, self._pipeline = compression, None
        else:
            self._compressor = None
            self._pipeline = build(LOSSLESS_CONFIG if compression is None else compression, path=path)
            self._pipeline.core.collective_steps()
        self._agreed = False         # ranks agreed on the parameters (agreement.agree) since they last changed
        self._bucket_cap_mb = buckets.check_bucket_cap_for(bucket_cap_mb, self._summable, "DistributedOptimizer")
        self._buckets: List[_Bucket] = []
        self._bucket_of: Dict[torch.Tensor, tuple] = {}    # parameter -> (bucket, its index there)
        self._copied: set = set()     # parameters of this step already copied into their bucket
        self._communicator = communicator or self._default_communicator()
        self._protocol = None if self._pipeline is None else \
            ReductionProtocol(self._pipeline.core, self._communicator, average=op == hvd.Average)
        aggregation = None if self._pipeline is None else self._pipeline.core.aggregation
        self._auto = None if aggregation is None else aggregation.planner(self._pipeline.core, self._communicator)
        self._worker = EncodeWorker(background)
        self.backward_passes_per_step = backward_passes_per_step
        self._delay: Dict[torch.Tensor, int] = {}
        self._pending: Dict[Union[torch.Tensor, _Bucket], Future] = {}   # a parameter or a bucket
        self._hook_handles: List = []
        self._sparse_as_dense = sparse_as_dense
        self._densified: Dict[torch.Tensor, int] = {}   # sparse_as_dense: parameter -> its gradient's sparse_dim
        self._step_count = 0
        self._should_synchronize = True
        self._synchronized = False
        self._warned_resynchronize = False
        self._times = {"encode": 0.0, "encode_hidden": 0.0, "encode_wait": 0.0, "communication_wait": 0.0,
                       "summable_decode": 0.0}
        self._steps_communicated = 0
        self._register_hooks()

    # ----------------------------------------------------------------- set-up
    def _default_communicator(self) -> Communicator:
        from ..dist.comm.horovod import HorovodCommunicator

        if self._pipeline is not None and self._pipeline.core.communicator is not None:
            comm = self._pipeline.core.communicator
        else:
            comm = HorovodCommunicator()
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

    # ----------------------------------------------------------------- communication
    def _agree(self) -> None:
        """Compare every rank's parameters and compression (one small allgather, see
        :mod:`deepreduce.dist.agreement`) before this step's first per-tensor collective."""
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._plan_buckets(params)
        layout = agreement.Layout(
            agreement.compressor_identity(self._compressor if self._summable else self._pipeline),
            [(self._names[p], tuple(p.shape), str(p.dtype).replace("torch.", "")) for p in params]
            + [(f"<{b.name}>", (b.buffer.numel(),), "bucket") for b in self._buckets], "parameter")
        agreement.agree(layout, lambda payload: self._communicator.allgather(payload, "deepreduce.dist.agreement"),
                        "DistributedOptimizer")
        self._agreed = True

    def _plan_buckets(self, params: List[torch.Tensor]) -> None:
        """Group the float32 gradients that travel as containers into buckets of at most
        ``bucket_cap_mb`` MiB, per device, in backward order (the reverse of the parameters')."""
        self._buckets, self._bucket_of = [], {}
        if self._bucket_cap_mb is None:
            return
        eligible: Dict[torch.device, List[torch.Tensor]] = {}
        for p in reversed(params):
            if p.dtype == torch.float32 and not self._summed_dense(p):
                eligible.setdefault(p.device, []).append(p)
        for device, group in eligible.items():
            for members in buckets.plan([p.numel() for p in group], self._bucket_cap_mb * buckets.MIB):
                chosen = [group[i] for i in members]
                sizes = [p.numel() for p in chosen]
                bucket = _Bucket(f"bucket{len(self._buckets)}.{self._names[chosen[0]]}", chosen,
                                 buckets.offsets(sizes), torch.empty(sum(sizes), dtype=torch.float32, device=device),
                                 len(chosen))
                self._buckets.append(bucket)
                for i, p in enumerate(chosen):
                    self._bucket_of[p] = (bucket, i)

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
            if self._sparse_as_dense:   # as Horovod: reduced dense, handed back sparse (see _finish)
                self._densified[p] = p.grad.sparse_dim()
                p.grad = p.grad.to_dense()
        if p in self._bucket_of:
            self._copy_into_bucket(p)
            return
        name, grad, step = self._names[p], p.grad, self._step_count
        if self._auto is not None and not self._summed_dense(grad):
            self._auto.ready(name, grad.numel())

        def start():
            try:
                if grad.is_sparse:
                    return self._start_entries(name, grad, step)
                if self._summable:
                    return self._start_allreduce(name, grad)
                if self._summed_dense(grad):
                    return self._start_dense_allreduce(name, grad)
                return self._start_allgather(name, grad, step)
            except Exception as exc:
                exc.add_note(f"deepreduce: raised while encoding parameter {name!r} at step {step}")
                raise

        self._pending[p] = self._worker.submit(start)

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

    def _start_entries(self, name: str, grad: torch.Tensor, step: int):
        """Encode a sparse COO gradient's entries (:mod:`deepreduce.torch.sparse`) and start the
        allgather; ctx ``("entries", step)``."""
        start = time.perf_counter()
        positions, values = entries(grad)
        payload = self._pipeline.core.encode_entries(positions, values, tuple(grad.shape), name=name, step=step)
        return self._protocol.start(payload, name), ("entries", step), (start, time.perf_counter())

    def _finish_entries(self, p: torch.Tensor, payloads, step: int) -> None:
        """Sum every rank's entries of ``p``'s sparse gradient (averaged under ``op=Average``)
        into a new coalesced sparse ``p.grad`` of the same sparse dimensions."""
        summed = []
        found = self._protocol.finish(
            payloads, self._names[p], step,
            lambda parts: summed.append(self._pipeline.core.decode_entries(parts, tuple(p.grad.shape))),
            lambda ranks: np.divide(summed[0][1], ranks, out=summed[0][1]), self._label(p))
        if found is None:
            p.grad = from_entries(*summed[0], like=p.grad)

    def _copy_into_bucket(self, p: torch.Tensor) -> None:
        """Copy ``p``'s finished gradient into its bucket; hand the bucket to the worker once it
        holds all of them (the worker then encodes the whole bucket under its name)."""
        bucket, i = self._bucket_of[p]
        with torch.no_grad():
            bucket.slice(i).copy_(p.grad.reshape(-1))
        self._copied.add(p)
        bucket.waiting -= 1
        if bucket.waiting:
            return
        step = self._step_count
        if self._auto is not None:
            self._auto.ready(bucket.name, bucket.buffer.numel())

        def start():
            try:
                return self._start_allgather(bucket.name, bucket.buffer, step)
            except Exception as exc:
                exc.add_note(f"deepreduce: raised while encoding {bucket.name!r} (parameters "
                             f"{', '.join(self._names[q] for q in bucket.params)}) at step {step}")
                raise

        self._pending[bucket] = self._worker.submit(start)

    def _start_allreduce(self, name: str, grad: torch.Tensor):
        """Compress and start the allreduce; return (handle, ctx, (compress start, compress end))."""
        start = time.perf_counter()
        kwargs = {} if self._process_set is None else {"process_set": self._process_set}
        if getattr(self._compressor, "accepts_name", False):
            compressed, ctx = self._compressor.compress(grad, name=name)
        else:
            compressed, ctx = self._compressor.compress(grad)
        interval = (start, time.perf_counter())
        if self._op == self._hvd.Average:
            handle = self._hvd.allreduce_async_(compressed, name=f"deepreduce.{name}", op=self._hvd.Average,
                                                prescale_factor=1.0 / self._predivide,
                                                postscale_factor=self._predivide, **kwargs)
        else:
            handle = self._hvd.allreduce_async_(compressed, name=f"deepreduce.{name}", op=self._op, **kwargs)
        return handle, ctx, interval

    def _summed_dense(self, grad: torch.Tensor) -> bool:   # a gradient, or its parameter (same shape)
        """Small float32 CPU gradients go to Horovod's fused all-reduce (Pipeline.summed_dense) when
        Horovod is the communicator."""
        from ..dist.comm.horovod import HorovodCommunicator

        return (isinstance(self._communicator, HorovodCommunicator) and grad.device.type == "cpu"
                and grad.dtype == torch.float32 and self._pipeline.core.summed_dense(grad.numel()))

    def _start_dense_allreduce(self, name: str, grad: torch.Tensor):
        """Start the in-place sum of a small gradient (Horovod fuses it with the others); ctx
        ``"dense"`` tells :meth:`_finish` there is nothing to decode."""
        now = time.perf_counter()
        kwargs = {} if self._process_set is None else {"process_set": self._process_set}
        self._pipeline.core.count_summed_dense(grad.numel())
        handle = self._hvd.allreduce_async_(grad, name=f"deepreduce.{name}", op=self._hvd.Sum, **kwargs)
        return handle, "dense", (now, now)

    def _route(self, name: str) -> str:
        """How ``name`` travels: the ``auto`` plan's choice, else the config's aggregation."""
        if self._auto is not None:
            return self._auto.choice(name)
        return "allgather" if self._protocol.sparse is None else "sparse_allreduce"

    def _start_allgather(self, name: str, grad: torch.Tensor, step: int):
        """Encode and start the allgather; return (handle, step, (encode start, encode end)).
        Under the sparse all-reduce nothing starts here: ``synchronize`` reduces these tensors in
        one order on every rank (ctx ``"sparse"``, handle ``(name, step)``); the ``auto`` plan may
        send a tensor by dense or fp16 all-reduce instead (its residual travels with it)."""
        start = time.perf_counter()
        route = self._route(name)
        if route == "sparse_allreduce":
            return (name, step), "sparse", (start, start)
        if route in ("dense", "fp16"):
            self._flush_residual(name, grad)
            if route == "dense":
                return self._start_dense_allreduce(name, grad)
            half = grad.to(torch.float16)
            kwargs = {} if self._process_set is None else {"process_set": self._process_set}
            return self._hvd.allreduce_async_(half, name=f"deepreduce.{name}", op=self._hvd.Sum, **kwargs), \
                ("fp16", half), (start, time.perf_counter())
        try:
            payload = self._pipeline.encode(grad, name=name, step=step)
        except Exception as exc:   # the collective still runs, so every rank stays in phase
            return self._protocol.start(self._protocol.failure_payload(exc), name), ("failed", exc), \
                (start, time.perf_counter())
        interval = (start, time.perf_counter())
        on_host = payload.numpy() if payload.device.type == "cpu" else payload   # device bytes stay there
        return self._protocol.start(on_host, name), step, interval

    def _flush_residual(self, name: str, grad: torch.Tensor) -> None:
        """Add ``name``'s error-feedback residual into ``grad`` and clear it (a tensor the plan
        moved to a dense all-reduce sends what compression had held back)."""
        residual = getattr(self._pipeline.core.memory, "residual", lambda _: None)(name)
        if residual is not None and residual.any():
            with torch.no_grad():
                grad.add_(torch.from_numpy(residual).view_as(grad).to(grad.device, grad.dtype))
            residual[...] = 0.0

    def _finish(self, p: torch.Tensor, handle, ctx):
        """Wait for one collective and write the aggregated gradient into ``p.grad`` (or the
        bucket's gradients). Containers: ``ctx`` is the step; the protocol decides, decodes and
        averages (a non-finite container of any rank is recorded there, nothing is written)."""
        start = time.perf_counter()
        if self._summable:
            output = self._hvd.synchronize(handle)
            decode_start = time.perf_counter()
            self._times["communication_wait"] += decode_start - start
            p.grad.copy_(self._compressor.decompress(output, ctx).view_as(p.grad))
            self._times["summable_decode"] += time.perf_counter() - decode_start
            return
        target = p.buffer if isinstance(p, _Bucket) else p.grad
        if ctx == "dense" or (isinstance(ctx, tuple) and ctx[0] == "fp16"):   # summed by Horovod in place
            self._hvd.synchronize(handle)
            self._times["communication_wait"] += time.perf_counter() - start
            with torch.no_grad():
                if ctx != "dense":
                    target.copy_(ctx[1].view_as(target))
                if self._op == self._hvd.Average:
                    target.div_(self._communicator.size)
        elif isinstance(ctx, tuple) and ctx[0] == "failed":   # this rank's encode raised; its peers see it
            handle.wait()
            raise ctx[1]
        elif isinstance(ctx, tuple):   # ("entries", step): a sparse gradient
            payloads = handle.wait()
            self._times["communication_wait"] += time.perf_counter() - start
            self._finish_entries(p, payloads, ctx[1])
            return
        elif ctx == "sparse":
            name, step = handle
            total, found = self._protocol.reduce_sparse(target.detach().reshape(-1).cpu().numpy(), name, step)
            self._times["communication_wait"] += time.perf_counter() - start
            if found is not None:
                self._protocol.skip(name, step, found)
                return
            with torch.no_grad():
                target.copy_(torch.from_numpy(total).view_as(target))
        else:
            payloads = handle.wait()
            self._times["communication_wait"] += time.perf_counter() - start
            found = self._protocol.finish(
                payloads, p.name if isinstance(p, _Bucket) else self._names[p], ctx,
                lambda parts: self._pipeline.decode_sum(parts, expected_shape=tuple(target.shape), out=target),
                target.div_, self._label(p))
            if found is not None:
                return
        if isinstance(p, _Bucket):
            with torch.no_grad():
                for i, q in enumerate(p.params):
                    q.grad.copy_(p.slice(i).view_as(q))

    def _label(self, key) -> str:
        """A pending entry named in messages: a parameter, or a bucket with its parameters."""
        if isinstance(key, _Bucket):
            return f"bucket {key.name!r} (parameters {', '.join(self._names[q] for q in key.params)})"
        return f"parameter {self._names[key]!r}"

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
        if self._auto is not None:
            self._auto.backward_done()
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
            for p, handle, ctx in started:
                try:
                    self._finish(p, handle, ctx)
                except Exception as exc:  # keep draining the other collectives first
                    errors.append(exc)
        finally:
            for p, sparse_dim in self._densified.items():
                p.grad = p.grad.to_sparse(sparse_dim)
            self._densified.clear()
            self._pending.clear()
            self._copied.clear()
            for bucket in self._buckets:
                bucket.waiting = len(bucket.params)
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
            self._step_count += 1
        if self._protocol is not None:
            order = [self._names[p] for group in self.param_groups for p in group["params"]]
            self._protocol.end_step(step, errors, order + [b.name for b in self._buckets])
        elif errors:
            raise errors[0]
        if self._auto is not None:
            table = self._auto.end_step(step)
            if table is not None and self._communicator.rank == 0:
                print(f"deepreduce auto aggregation, after step {step}:\n{table}", flush=True)
        self._steps_communicated += 1
        self._synchronized = True

    def _wait_for_encodes(self, wait_start: float, errors: List[BaseException]):
        """Wait for the worker; return (parameter, handle, ctx) of every collective it started."""
        started = []
        for p, future in self._pending.items():
            try:
                handle, ctx, (encode_start, encode_end) = future.result()
            except Exception as exc:
                errors.append(exc)
                continue
            started.append((p, handle, ctx))
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
        return all(g is not None and not _any_nonzero(g) for g in grads)

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
        sparse = None if self._protocol is None else self._protocol.sparse
        if sparse is not None:
            stats.update(aggregation=self._pipeline.core.aggregation.id, received_bytes=dict(sparse.received_bytes))
        if self._auto is not None:
            stats.update(self._auto.stats())
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
        out["deepreduce"] = compression_state_dict(self._pipeline, self._compressor, self._step_count,
                                                   self._sparse_state())
        return out

    def _sparse_state(self):
        sparse = None if self._protocol is None else self._protocol.sparse
        return None if sparse is None else sparse.state_dict()

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


def _any_nonzero(grad: torch.Tensor) -> bool:
    values = grad.coalesce().values() if grad.is_sparse else grad
    return bool(values.any())


def named_parameter_map(named_parameters) -> Dict[torch.Tensor, str]:
    """``{parameter: name}`` from (name, parameter) pairs; a ConfigError for malformed pairs or
    duplicate names (the DDP hook state uses it too)."""
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
           or not isinstance(item[1], torch.Tensor) for item in named):
        raise ConfigError("named_parameters must be a sequence of (name, parameter) pairs, "
                          "e.g. model.named_parameters()")
    names = [n for n, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"named_parameters has duplicate names: {', '.join(duplicates)}")
    return {p: n for n, p in named}


def _parameter_names(param_groups, named_parameters) -> Dict[torch.Tensor, str]:
    """Map every parameter to a unique name, as Horovod requires; errors name the problem."""
    all_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(all_params)}
    mapping = named_parameter_map(named_parameters)
    missing = [i for i, p in enumerate(all_params) if p not in mapping]
    if missing:
        raise ConfigError(f"named_parameters does not cover {len(missing)} optimizer parameter(s) "
                          f"(positions {missing[:5]} of the optimizer's parameters)")
    return mapping


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
