"""The DDP hook's worker side: how one bucket is reduced (:mod:`deepreduce.torch.ddp`).

:class:`BucketReduction` holds the methods of ``DeepReduceState`` that its worker thread, the only
thread issuing collectives on the state's private process group, runs per bucket, by the route
the protocol gives it (:meth:`deepreduce.collective.protocol.ReductionProtocol.route`):

* ``allgather`` (the default): the bucket's containers (one per parameter, or the merged
  gradients as one), concatenated; every rank gathers every rank's in **one collective**
  (:meth:`deepreduce.collective.slots.Slots.exchange`: a slot whose prefix carries the size, the
  digests of compressor and layout, and the step; a disagreement is the same error on every
  rank, never a hang); the protocol splits, decodes, sums and averages them into the bucket. A
  rank whose encode raised sends the protocol's failure payload instead: every peer raises.
* ``sparse_allreduce``: the header alone (the same checks), then each container's tensor through
  the sparse all-reduce, in name order on every rank.
* ``dense`` / ``fp16`` (the ``auto`` plan's choices): one ``all_reduce`` of the bucket, each
  container's residual added first; the plan is agreed, so no header travels.
* a summable compressor (``FP16Compressor``, GradiVeQ): one ``all_reduce`` of the codes and a
  flag once the ranks have agreed on them (:mod:`deepreduce.collective.slots`, "Summed payloads");
  the header first on the bucket's first step, or when any rank flagged.

After the step's last bucket the protocol commits or undoes the step's residual changes and
raises the step's error on every rank (``deepreduce.collective.inflight.end_step``). Bucket names and
merges come from :mod:`deepreduce.collective.buckets`, the totals from :mod:`deepreduce.collective.totals`.
"""
import contextlib
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..collective import agreement, buckets, slots, totals
from ..collective.protocol import ReductionProtocol
from . import summable
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
        return buckets.bucket_name(self.names, range(len(self.names)))

    @property
    def where(self) -> str:
        """The bucket in error messages."""
        return f"DDP bucket with parameters {buckets.describe(self.names)}"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class BucketReduction:
    """What ``DeepReduceState``'s worker runs per bucket (see the module docstring), over the
    state's ``pipeline``, ``compressor``, ``world_size``, ``stats`` and process-local parts."""

    def _reduce(self, job: Job) -> torch.Tensor:
        if job.buffer.device.type == "cuda":
            torch.cuda.set_device(job.buffer.device)
        route = "summable" if self.pipeline is None else "allgather" if job.buffer.is_sparse else \
            self._protocol.route(job.label)
        if route in ("dense", "fp16"):   # the auto plan's choice: no header, the plan is agreed
            return self._reduce_dense(job, route)
        payload, codes, failure = None, None, None
        layout = agreement.Layout(self._compressor_id, [(n, tuple(v.shape), str(v.dtype).replace("torch.", ""))
                                                        for n, v in zip(job.names, job.views)], "parameter")
        if route == "summable":
            codes, failure = self._compress(job)
            nbytes = slots.FAILED if codes is None else sum(_nbytes(c) for c in codes[0])
            signature = None if codes is None else (layout.digest, nbytes, codes[0][0].dtype)
            if self._steady_sum(job, codes, signature):
                totals.count(self.stats, 4 * sum(v.numel() for v in job.views), nbytes)
                return job.buffer
        else:   # the sparse all-reduce encodes its shards itself
            payload, failure = self._encode(job) if route == "allgather" else (None, None)
            nbytes = 0 if payload is None else _nbytes(payload)
        # one line for every route: a disagreement raises from the same frames on every rank
        headers, parts = self._exchange(job, payload, nbytes, layout)
        if failure is not None:
            raise failure
        slots.check_step(headers, job.where, repr(self.compressor) if route == "summable" else None)
        totals.count(self.stats, 4 * sum(v.numel() for v in job.views), nbytes)
        if route == "summable":
            self._reduce_codes(job, *codes, signature)
        elif route == "sparse_allreduce":
            self._reduce_sparse(job)
        elif job.buffer.is_sparse:
            return self._decode_entries(job, parts)
        else:
            self._decode(job, parts)
        return job.buffer

    def _exchange(self, job: Job, payload: Optional[torch.Tensor], nbytes: int, layout: agreement.Layout):
        """The bucket's one collective (:meth:`deepreduce.collective.slots.Slots.exchange`): every rank's
        header (``nbytes``: the payload's size, or :data:`~deepreduce.collective.slots.FAILED`), and with
        a ``payload`` every rank's payload. Raises the same error on every rank when the ranks'
        layouts differ. Returns (headers, every rank's payload or None)."""
        def explain() -> str:   # a collective of the communicator: the first difference, named
            return agreement.explain(layout, lambda data: self._communicator.allgather(data, "deepreduce.collective.agreement"))
        return self._slots.exchange(job.index, slots.prefix(nbytes, layout, job.step), payload, self._all_gather,
                                    job.buffer, job.where, explain)

    def _all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's ``tensor``, as views of one flat output (``all_gather_into_tensor``: one
        output buffer instead of one tensor per rank, and NCCL's native form of the gather)."""
        gathered = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        with totals.collective(self.stats, _nbytes(tensor)):
            dist.all_gather_into_tensor(gathered, tensor.reshape(-1), group=self._group)
        return list(gathered.view(self.world_size, *tensor.shape).unbind(0))

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        with totals.collective(self.stats, _nbytes(tensor)):
            dist.all_reduce(tensor, group=self._group)

    # containers --------------------------------------------------------------
    def _encode(self, job: Job):
        """(the bucket's containers, concatenated, None) or, when the encode raised, (the
        protocol's failure payload, the error): the peers learn of it in the gather."""
        try:
            with totals.timed(self.stats, "encode_seconds"):
                if not job.buffer.is_sparse:
                    with self._containers(job, fill=True) as pairs:
                        parts = [self.pipeline.encode(target, name=name, step=job.step) for name, target in pairs]
                    return torch.cat(parts).to(job.buffer.device), None
                positions, values = entries(job.buffer)
                payload = self.pipeline.core.encode_entries(positions, values, tuple(job.buffer.shape),
                                                            name=job.names[0], step=job.step)
                return torch.from_numpy(payload).to(job.buffer.device), None
        except Exception as exc:  # raised after the gather
            return torch.from_numpy(ReductionProtocol.failure_payload(exc)).to(job.buffer.device), exc

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
        yield list(zip(buckets.container_names(job.names, job.merged), targets))
        if job.merged is not None:
            at = 0
            for i in job.merged[1]:
                view = job.views[i]
                view.copy_(targets[0][at:at + view.numel()].view(view.shape))
                at += view.numel()

    def _decode_entries(self, job: Job, gathered: List[torch.Tensor]) -> torch.Tensor:
        """A sparse bucket (DDP puts each sparse gradient in a bucket of its own): every rank's
        entries summed and averaged into a coalesced COO gradient (:mod:`deepreduce.torch.sparse`)."""
        with totals.timed(self.stats, "decode_seconds"):
            summed = self._protocol.finish_entries([data.cpu().numpy() for data in gathered], job.names[0], job.step,
                                                   tuple(job.buffer.shape), f"parameter {job.names[0]!r}")
        return job.buffer if summed is None else from_entries(*summed, like=job.buffer)

    def _decode(self, job: Job, gathered: List[torch.Tensor]) -> None:
        """Every rank's containers decoded and summed per container into the bucket (on its
        device on the device path) and averaged, by the protocol."""
        count = len(buckets.container_names(job.names, job.merged))
        with totals.timed(self.stats, "decode_seconds"):
            per_rank = self._protocol.split_per_rank(gathered, count, job.where, job.step)
            with self._containers(job, fill=False) as pairs:
                for i, (name, target) in enumerate(pairs):
                    self._protocol.finish(
                        [parts[i] for parts in per_rank], name, job.step, lambda payloads, t=target:
                        self.pipeline.decode_sum(payloads, expected_shape=tuple(t.shape), out=t),
                        target.div_, f"parameter {name!r}")

    def _reduce_sparse(self, job: Job) -> None:
        """Each container's tensor through the sparse all-reduce (host arrays), in name order on
        every rank; the averages are written back into the bucket."""
        sent = self._protocol.sparse.sent_bytes
        with totals.timed(self.stats, "communication_seconds"), self._containers(job, fill=True) as pairs:
            for name, target in sorted(pairs, key=lambda pair: pair[0]):
                total, found = self._protocol.reduce_sparse(target.detach().reshape(-1).cpu().numpy(), name, job.step)
                if found is not None:
                    self._protocol.skip(name, job.step, found)
                    continue
                target.copy_(torch.from_numpy(total).view(target.shape))
        sent = self._protocol.sparse.sent_bytes - sent
        self.stats["wire_bytes"] += sent
        self.stats["collective_bytes"] += sent

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
        totals.count(self.stats, 4 * job.buffer.numel(), _nbytes(codes))
        return job.buffer.div_(self.world_size)

    # summable codes -----------------------------------------------------------
    def _compress(self, job: Job):
        """((codes, contexts), None) of a summable compressor (:mod:`deepreduce.torch.summable`),
        or (None, the error): the peers learn of it in the header."""
        try:
            with totals.timed(self.stats, "encode_seconds"):
                return summable.compress(self.compressor, job.views, job.names), None
        except Exception as exc:  # raised after the header
            return None, exc

    def _steady_sum(self, job: Job, codes: Optional[tuple], signature: Optional[tuple]) -> bool:
        """Once the ranks agreed on the bucket's codes: their one ``all_reduce`` with this rank's
        flag (:meth:`deepreduce.collective.slots.Slots.flag`; zeros for codes where it is 1). Whether
        the bucket was reduced (not before any agreement, nor when a rank flagged)."""
        agreed = self._slots.agreed(job.index)
        if agreed is None:
            return False
        flag = self._slots.flag(job.index, signature, job.step)
        if flag:
            codes = ([torch.zeros(agreed[1] // agreed[2].itemsize, dtype=agreed[2], device=job.buffer.device)], None)
        return self._reduce_codes(job, *codes, signature, flag=flag)

    def _reduce_codes(self, job: Job, codes: list, contexts: list, signature: tuple, flag: Optional[int] = None) -> bool:
        """The codes' ``all_reduce`` (a ``flag`` element after them unless None); unless a rank
        flagged, the codes' ``signature`` agreed (:meth:`deepreduce.collective.slots.Slots.agree`) and each
        parameter's sum decompressed into the bucket and averaged. Whether it was."""
        flat = torch.cat([c.reshape(-1) for c in codes] + ([codes[0].new_full((1,), flag)] if flag is not None else []))
        self._all_reduce(flat)
        if flag is not None and flat[-1].item():
            return False
        self._slots.agree(job.index, signature, job.step)   # before anything that may raise on one rank only
        with totals.timed(self.stats, "decode_seconds"):
            summable.decompress_into(self.compressor, flat, codes, contexts, job.views, self.world_size)
        return True
