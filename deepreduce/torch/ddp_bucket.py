"""The DDP hook's worker side: how one bucket is reduced (:mod:`deepreduce.torch.ddp`).

:class:`BucketReduction` is the part of ``DeepReduceState`` that runs on its worker thread, the
only thread that issues collectives on the state's private process group. Per bucket, by the
route the protocol gives it (:meth:`deepreduce.dist.protocol.ReductionProtocol.route`):

* ``allgather`` (the default): the bucket's containers are encoded (one per parameter, or the
  merged gradients as one) and concatenated; every rank gathers every rank's in **one
  collective** (:mod:`deepreduce.dist.slots`: a fixed-size slot whose prefix carries the size,
  the digests of compressor and layout, and the step; only a payload that outgrows its slot
  costs a second gather, and the slot grows); every rank checks the headers (a disagreement is
  the same error on every rank, never a hang), splits each rank's bytes into containers and lets
  the protocol decode-sum and average them into the bucket. A rank whose encode raised sends
  the protocol's failure payload instead: every peer raises, naming it.
* ``sparse_allreduce``: the header alone (the same checks), then each container's tensor through
  the sparse all-reduce, in name order on every rank.
* ``dense`` / ``fp16`` (the ``auto`` plan's choices): one ``all_reduce`` of the bucket (as DDP
  itself, or in half precision), each container's residual added first; the plan is agreed, so
  no header travels.
* a summable compressor (``FP16Compressor``, GradiVeQ): the header, then one ``all_reduce`` of
  the codes.

After the step's last bucket the protocol commits or undoes the step's residual changes and
raises the step's error on every rank (:meth:`BucketReduction._end_step`).
"""
import contextlib
import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..dist import agreement, slots
from ..dist.protocol import ReductionProtocol
from ..errors import ConfigError
from .sparse import entries, from_entries


@dataclass
class Job:
    """One bucket handed over by the hook."""

    buffer: torch.Tensor
    views: List[torch.Tensor]
    names: List[str]
    step: int
    index: int                 # the bucket's position in the step (DDP's GradBucket.index)
    last: bool                 # the step's last bucket (DDP's GradBucket.is_last)
    future: torch.futures.Future
    merged: Optional[tuple] = None   # per_parameter=False: (name, positions of the views encoded as one)

    @property
    def label(self) -> str:
        """The bucket's name in the auto plan."""
        return bucket_name(self.names, range(len(self.names)))

    def containers(self) -> List[str]:
        """What each container of this bucket holds: the merged gradients' name, then each
        other parameter's (all parameters in order when nothing is merged)."""
        if self.merged is None:
            return list(self.names)
        return [self.merged[0]] + [n for i, n in enumerate(self.names) if i not in self.merged[1]]


def _describe(names: List[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _where(job: Job) -> str:
    return f"DDP bucket with parameters {_describe(job.names)}"


def bucket_name(names: List[str], members) -> str:
    """``bucket:<first>..<last>/<count>`` of the parameters at ``members`` (one: its name)."""
    members = list(members)
    if len(members) == 1:
        return names[members[0]]
    return f"bucket:{names[members[0]]}..{names[members[-1]]}/{len(members)}"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class BucketReduction:
    """The worker-thread methods of ``DeepReduceState`` (see the module docstring); the state
    provides ``pipeline``, ``compressor``, ``world_size``, ``stats``, ``_protocol``,
    ``_communicator``, ``_group``, ``_slots``, ``_flats``, ``_errors``, ``_jobs`` and
    ``_compressor_id``."""

    def _work(self) -> None:
        """The worker thread: reduce each queued bucket in hook order and complete its future;
        after the step's last bucket, end the step (:meth:`_end_step`)."""
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
            if job.last:   # the step's residuals are kept, or undone when a bucket failed
                errors, self._errors = self._errors, []
                try:
                    self._end_step(job, errors)
                except Exception as exc:
                    error = error or exc
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)
            self._jobs.task_done()

    def _reduce(self, job: Job) -> torch.Tensor:
        if job.buffer.device.type == "cuda":
            torch.cuda.set_device(job.buffer.device)
        route = self._route(job)
        if route in ("dense", "fp16"):   # the auto plan's choice: no header, the plan is agreed
            return self._reduce_dense(job, route)
        start = time.perf_counter()
        failure, payload, codes = None, None, None
        try:
            if route == "summable":
                codes = self._compress(job)
            elif route == "allgather":   # the sparse all-reduce encodes its shards itself
                payload = self._encode(job)
        except Exception as exc:  # reported to every rank in the gather, raised below
            failure = exc
            if route == "allgather":
                payload = torch.from_numpy(ReductionProtocol.failure_payload(exc)).to(job.buffer.device)
        self.stats["encode_seconds"] += time.perf_counter() - start
        if codes is not None:
            nbytes = _nbytes(codes[0])
        elif payload is not None:
            nbytes = _nbytes(payload)
        else:   # the sparse all-reduce sends nothing here; a summable compressor that raised says so
            nbytes = 0 if failure is None else slots.FAILED
        headers, parts = self._exchange(job, payload, nbytes)
        if failure is not None:
            raise failure
        slots.check_step(headers, _where(job), None if codes is None else repr(self.compressor))
        self.stats["buckets"] += 1
        self.stats["dense_bytes"] += 4 * sum(v.numel() for v in job.views)
        self.stats["wire_bytes"] += nbytes
        if codes is not None:
            self._reduce_codes(job, *codes)
        elif route == "sparse_allreduce":
            self._reduce_sparse(job)
        elif job.buffer.is_sparse:
            return self._decode_entries(job, parts)
        else:
            self._decode(job, parts)
        return job.buffer

    def _route(self, job: Job) -> str:
        """How the bucket travels: "summable" (a summable compressor's all_reduce), or the auto
        plan's choice for it (dense, fp16, allgather, sparse_allreduce), else the config's."""
        if self.pipeline is None:
            return "summable"
        if job.buffer.is_sparse:
            return "allgather"
        return self._protocol.route(job.label)

    def _exchange(self, job: Job, payload: Optional[torch.Tensor], nbytes: int):
        """The bucket's one collective (:mod:`deepreduce.dist.slots`): every rank's header, and
        with a ``payload`` every rank's payload, of which what overflows the slot comes in a
        second gather. Raises the same error on every rank when the ranks' layouts differ.
        Returns (headers, every rank's payload or None)."""
        device = job.buffer.device
        layout = agreement.Layout(self._compressor_id, [(n, tuple(v.shape), str(v.dtype).replace("torch.", ""))
                                                        for n, v in zip(job.names, job.views)], "parameter")
        capacity = 0 if payload is None else self._slots.capacity(job.index)
        slot = torch.zeros(slots.PREFIX_BYTES + capacity, dtype=torch.uint8, device=device)
        slot[:slots.PREFIX_BYTES] = torch.from_numpy(slots.prefix(nbytes, layout, job.step))
        if payload is not None:
            slot[slots.PREFIX_BYTES:slots.PREFIX_BYTES + min(nbytes, capacity)] = payload[:capacity]
        gathered = self._all_gather(slot)
        headers = slots.parse(torch.stack([g[:slots.PREFIX_BYTES] for g in gathered]).cpu().numpy())
        slots.check(headers, _where(job), lambda: agreement.explain(layout, self._allgather))
        if payload is None:
            return headers, None
        sizes = [int(size) for size in headers[:, 0]]
        parts = [g[slots.PREFIX_BYTES:slots.PREFIX_BYTES + min(size, capacity)] for g, size in zip(gathered, sizes)]
        rest = self._slots.settle(job.index, headers[:, 0])
        if rest:   # a payload outgrew the slot: every rank saw it, every rank gathers the rest
            extra = torch.zeros(rest, dtype=torch.uint8, device=device)
            extra[:max(0, nbytes - capacity)] = payload[capacity:]
            parts = [torch.cat([part, more[:max(0, size - capacity)]])
                     for part, more, size in zip(parts, self._all_gather(extra), sizes)]
        return headers, parts

    def _all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        start = time.perf_counter()
        dist.all_gather(gathered, tensor, group=self._group)
        self.stats["communication_seconds"] += time.perf_counter() - start
        self.stats["collective_bytes"] += tensor.numel()
        return gathered

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        dist.all_reduce(tensor, group=self._group)
        self.stats["communication_seconds"] += time.perf_counter() - start
        self.stats["collective_bytes"] += tensor.numel() * tensor.element_size()

    # containers --------------------------------------------------------------
    def _encode(self, job: Job) -> torch.Tensor:
        if job.buffer.is_sparse:
            positions, values = entries(job.buffer)
            payload = self.pipeline.core.encode_entries(positions, values, tuple(job.buffer.shape), name=job.names[0],
                                                        step=job.step)
            return torch.from_numpy(payload).to(job.buffer.device)
        with self._containers(job, fill=True) as pairs:
            parts = [self.pipeline.encode(target, name=name, step=job.step) for name, target in pairs]
        return torch.cat(parts).to(job.buffer.device)

    @contextlib.contextmanager
    def _containers(self, job: Job, fill: bool):
        """(name, tensor) of each container of the bucket: a view of the bucket, or, for merged
        gradients, their flat tensor (kept across steps; only the worker thread uses it), filled
        from their views when ``fill`` and copied back into them on leaving."""
        targets = list(job.views)
        if job.merged is not None:
            name, members = job.merged
            numel = sum(job.views[i].numel() for i in members)
            flat = self._flats.get(name)
            if flat is None or flat.numel() != numel or flat.device != job.buffer.device:
                flat = self._flats[name] = job.buffer.new_empty(numel)
            if fill:
                torch.cat([job.views[i].reshape(-1) for i in members], out=flat)
            targets = [flat] + [v for i, v in enumerate(job.views) if i not in members]
        yield list(zip(job.containers(), targets))
        if job.merged is not None:
            at = 0
            for i in job.merged[1]:
                view = job.views[i]
                view.copy_(targets[0][at:at + view.numel()].view(view.shape))
                at += view.numel()

    def _decode_entries(self, job: Job, gathered: List[torch.Tensor]) -> torch.Tensor:
        """A sparse bucket (DDP puts each sparse gradient in a bucket of its own): every rank's
        entries summed and averaged into a coalesced COO gradient (:mod:`deepreduce.torch.sparse`)."""
        start = time.perf_counter()
        summed = self._protocol.finish_entries([data.cpu().numpy() for data in gathered], job.names[0], job.step,
                                               tuple(job.buffer.shape), f"parameter {job.names[0]!r}")
        self.stats["decode_seconds"] += time.perf_counter() - start
        return job.buffer if summed is None else from_entries(*summed, like=job.buffer)

    def _decode(self, job: Job, gathered: List[torch.Tensor]) -> None:
        """Every rank's containers decoded and summed per container into the bucket (on its
        device on the device path) and averaged, by the protocol."""
        start = time.perf_counter()
        per_rank = self._protocol.split_per_rank(gathered, len(job.containers()), _where(job), job.step)
        with self._containers(job, fill=False) as pairs:
            for i, (name, target) in enumerate(pairs):
                self._protocol.finish(
                    [parts[i] for parts in per_rank], name, job.step,
                    lambda payloads, t=target: self.pipeline.decode_sum(payloads, expected_shape=tuple(t.shape), out=t),
                    target.div_, f"parameter {name!r}")
        self.stats["decode_seconds"] += time.perf_counter() - start

    def _reduce_sparse(self, job: Job) -> None:
        """Each container's tensor through the sparse all-reduce (host arrays), in name order on
        every rank; the averages are written back into the bucket."""
        start, sent = time.perf_counter(), self._protocol.sparse.sent_bytes
        with self._containers(job, fill=True) as pairs:
            for name, target in sorted(pairs, key=lambda pair: pair[0]):
                total, found = self._protocol.reduce_sparse(target.detach().reshape(-1).cpu().numpy(), name, job.step)
                if found is not None:
                    self._protocol.skip(name, job.step, found)
                    continue
                target.copy_(torch.from_numpy(total).view(target.shape))
        self.stats["communication_seconds"] += time.perf_counter() - start
        self.stats["wire_bytes"] += self._protocol.sparse.sent_bytes - sent
        self.stats["collective_bytes"] += self._protocol.sparse.sent_bytes - sent

    def _reduce_dense(self, job: Job, route: str) -> torch.Tensor:
        """The auto plan's dense or fp16 all-reduce of the whole bucket; each container's
        error-feedback residual travels with it (``ReductionProtocol.take_residual``)."""
        with self._containers(job, fill=True) as pairs:
            for name, target in pairs:
                residual = self._protocol.take_residual(name)
                if residual is not None:
                    target.add_(torch.from_numpy(residual).view(target.shape).to(target.device))
        codes = job.buffer if route == "dense" else job.buffer.to(torch.float16)
        self._all_reduce(codes)
        if route == "fp16":
            job.buffer.copy_(codes)
        self.stats["buckets"] += 1
        self.stats["dense_bytes"] += 4 * job.buffer.numel()
        self.stats["wire_bytes"] += codes.numel() * codes.element_size()
        return job.buffer.div_(self.world_size)

    def _allgather(self, payload: np.ndarray) -> List[np.ndarray]:
        return self._communicator.allgather(payload, "deepreduce.dist.agreement")

    def _end_step(self, job: Job, errors: List[BaseException]) -> None:
        """After the step's last bucket: keep its residuals (and let the auto planner plan), or,
        if a bucket failed or any rank sent a non-finite container under ``nonfinite: raise``,
        undo them and raise (the same error on every rank)."""
        if self._protocol is None:
            if errors:
                raise errors[0]
            return
        self._protocol.end_step(job.step, errors)

    # summable codes -----------------------------------------------------------
    def _compress(self, job: Job):
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

    def _reduce_codes(self, job: Job, flat: torch.Tensor, codes, contexts) -> None:
        self._all_reduce(flat)
        start = time.perf_counter()
        offset = 0
        for code, ctx, view in zip(codes, contexts, job.views):
            summed = flat[offset:offset + code.numel()].view(code.shape)
            offset += code.numel()
            view.copy_(self.compressor.decompress(summed, ctx).view(view.shape) / self.world_size)
        self.stats["decode_seconds"] += time.perf_counter() - start
