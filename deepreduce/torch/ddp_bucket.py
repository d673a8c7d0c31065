"""What the DDP hook (:mod:`deepreduce.torch.ddp`) makes of a bucket: the parameters' names
(:class:`ParameterNames`) and the step engine's item (:func:`bucket_item`).

A bucket is cut back into one view per parameter (``bucket.parameters()`` in bucket order, no
padding); each view is a part of the item, encoded under its parameter's name, so ratios, filters,
seeds and residuals mean what they mean in the Horovod optimizer (and a residual survives DDP's
bucket rebuild: it is keyed by name). With ``per_parameter=False`` the parameters of at least
``min_numel`` elements are one part instead, their gradients concatenated into a flat tensor kept
across steps and copied back after the reduction (:func:`deepreduce.collective.buckets.merge`),
named ``bucket:<first>..<last>/<count>`` (which keys its residual; DDP rebuilds its buckets after
the first iteration, and the new ones start with fresh residuals).
The item's header (:class:`deepreduce.collective.slots.Header`) lets the DDP transport check the
ranks' layouts and steps in the bucket's own collective.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..collective import agreement, buckets, slots
from ..collective.step import Item
from ..errors import CommunicationError, ConfigError
from .arguments import named_parameter_map


class ParameterNames:
    """How the hook names the parameters DDP hands over; pickles with the state (the tensors stay
    behind: :meth:`bind` attaches the names to a model's parameters again)."""

    def __init__(self, named_parameters=None) -> None:
        self.names = None if named_parameters is None else named_parameter_map(named_parameters)
        self.unbound: Optional[List[str]] = None   # an unpickled state's names, until bind()
        # (name, shape) of each parameter in the order DDP first handed it over: how an unpickled
        # state names a restored model's parameters without bind() (first_name)
        self.handed: List[Tuple[str, Tuple[int, ...]]] = []
        self.named: Dict[torch.Tensor, str] = {}   # every parameter named in this process

    def __getstate__(self) -> dict:
        unbound = self.unbound if self.names is None else list(self.names.values())
        return {"names": None, "unbound": unbound, "handed": self.handed}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, named={})

    @staticmethod
    def upgrade(state: dict) -> dict:
        """A pickled hook state from before the names were an object of their own (its keys
        ``_names``, ``_unbound``, ``_handed``), with them as one."""
        if not isinstance(state.get("_names"), ParameterNames):
            names = ParameterNames()
            names.unbound, names.handed = state.pop("_unbound", None), state.pop("_handed", [])
            state["_names"] = names
        return state

    def bind(self, named_parameters) -> None:
        """Name the parameters again after unpickling (the names must be the pickled state's)."""
        mapping = named_parameter_map(named_parameters)
        if self.unbound is not None and sorted(self.unbound) != sorted(mapping.values()):
            missing = sorted(set(self.unbound) - set(mapping.values()))[:4]
            raise ConfigError(f"DeepReduceState.bind: the parameters' names differ from the pickled state's "
                              f"(missing: {missing}); pass the named_parameters of the same model")
        self.names, self.unbound = mapping, None
        self.named.clear()

    def name(self, param: torch.Tensor, step: int) -> str:
        name = self.named.get(param)
        if name is None:
            name = self.named[param] = self.first_name(param, step)
        return name

    def first_name(self, param: torch.Tensor, step: int) -> str:
        """The name of a parameter handed over for the first time in this process: its name in
        ``named_parameters`` (given, or :meth:`bind`); else the name recorded at its position in
        the order DDP first handed parameters over (``handed``, which pickles: an unpickled state
        registered without bind(), as PyTorch's PowerSGD state is, names a restored model's
        parameters from the buckets alone, every rank alike, since DDP hands buckets over in index
        order); else ``param.<k>`` for the k-th. A shape that differs from the recorded one is a
        ConfigError asking for bind()."""
        k, shape = len(self.named), tuple(param.shape)
        if self.names is not None:
            name = self.names.get(param)
            if name is None:
                raise ConfigError(f"DDP bucket holds a parameter of shape {shape} that is not in the "
                                  "named_parameters given to DeepReduceState (is the state registered on another "
                                  "model? pass model.module.named_parameters())")
        elif k < len(self.handed):
            name, recorded = self.handed[k]
            if tuple(recorded) != shape:
                raise ConfigError(f"DeepReduceState was unpickled: the parameter at position {k} of DDP's hand-over "
                                  f"order has shape {shape}, the state's {name!r} there {tuple(recorded)} (another "
                                  "model or bucketing); call state.bind(model.module.named_parameters()) before training")
        elif self.unbound is not None and step > 0:
            raise ConfigError(f"DeepReduceState was unpickled after {step} step(s) without the order of its "
                              "parameters (pickled by an older version, or given a state_dict before its first "
                              "bucket): call state.bind(model.module.named_parameters()) before training")
        else:
            name = f"param.{k}"
        if k == len(self.handed):
            self.handed.append((name, shape))
        return name


def bucket_item(bucket: dist.GradBucket, names: List[str], step: int, compressor_id: Tuple[str, int],
                summed: Optional[str], merge_from: Optional[int], flats: Dict[str, torch.Tensor]):
    """(the step engine's item for ``bucket``, a callable giving what its future holds afterwards).

    ``names``: its parameters'; ``summed``: a summable compressor's name (its codes' sizes must
    agree); ``merge_from``: ``min_numel`` when ``per_parameter=False``, else None; ``flats``: the
    merged parts' flat tensors, by name (reused across steps; only the engine's worker uses them)."""
    buffer, params = bucket.buffer(), bucket.parameters()
    where = f"DDP bucket with parameters {buckets.describe(names)}"
    if buffer.is_sparse:   # DDP's sparse path: one parameter, its COO gradient, in a bucket of its own
        views = [buffer]
    else:
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        if offset != buffer.numel():
            raise CommunicationError(f"DDP bucket {bucket.index()} holds {buffer.numel()} elements, its parameters "
                                     f"{offset}: cannot cut it into per-parameter gradients")
    layout = agreement.Layout(compressor_id, [(n, tuple(v.shape), str(v.dtype).replace("torch.", ""))
                                              for n, v in zip(names, views)], "parameter")
    header = slots.Header(bucket.index(), layout, step, where, 4 * buffer.numel(), summed, buffer.device)
    result = [buffer]
    if buffer.is_sparse:
        item = Item(names[0], step, buffer, label=f"parameter {names[0]!r}", header=header, timeline=step >= 1,
                    replace=lambda new: result.__setitem__(0, new))
        return item, lambda: result[0]
    merged = None if merge_from is None else buckets.merge(names, [v.numel() for v in views], merge_from)
    parts, written = list(zip(names, views)), None
    if merged is not None:
        name, members = merged
        flat = flats.get(name)
        numel = sum(views[i].numel() for i in members)
        if flat is None or flat.numel() != numel or flat.device != buffer.device:
            flat = flats[name] = buffer.new_empty(numel)
        torch.cat([views[i].reshape(-1) for i in members], out=flat)
        parts = [(name, flat)] + [(n, v) for i, (n, v) in enumerate(zip(names, views)) if i not in members]

        def written() -> None:
            at = 0
            for i in members:
                views[i].copy_(flat[at:at + views[i].numel()].view(views[i].shape))
                at += views[i].numel()
    item = Item(buckets.bucket_name(names, range(len(names))), step, buffer, label=where, parts=parts,
                header=header, written=written, timeline=step >= 1)
    return item, lambda: result[0]


def new_future(buffer: torch.Tensor) -> torch.futures.Future:
    """The future DDP waits on for a bucket held in ``buffer`` (on its device)."""
    return torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()


def complete(futures: List[tuple], error: Optional[BaseException]) -> None:
    """Every (future, result) of a finished step's buckets: its result, or the step's error."""
    for future, result in futures:
        if error is None:
            future.set_result(result())
        else:
            future.set_exception(error)


def unwrap(future: torch.futures.Future) -> torch.Tensor:
    """What DDP's wait gets: the bucket, or the step's error raised on this rank."""
    return future.value()
