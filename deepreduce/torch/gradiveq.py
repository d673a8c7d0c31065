"""GradiVeQ as a Horovod ``Compressor``: summable PCA codes through an ordinary allreduce.

Use it as ``hvd.DistributedOptimizer(opt, named_parameters=..., compression=GradiVeQ())``
(unmodified Horovod) or with ``deepreduce.torch.DistributedOptimizer(..., compression=
GradiVeQ())``. The math is :mod:`deepreduce.summable.gradiveq`; this module keeps the per-tensor
state and runs the per-step products on the gradient's own device.

Life of one conv-layer gradient (iteration counter ``t`` per tensor):

* ``t < warmup``: sent uncompressed;
* sampling window (``sample_iters``): sent uncompressed; the aggregated result that comes
  back from the allreduce (identical on every rank) is recorded -- the group-first slices for
  PCA, a running sum for the per-slice means;
* at the end of the window every rank trains the same model from the same aggregated data
  (float64 SVD, deterministic signs), so ``U`` is identical on every rank without sending it;
* ``compress_iters`` steps: the code ``U^T g`` (plus uncompressed groups and the tail) is
  allreduced and decompressed after; then a new sampling window starts (the paper's schedule:
  2,500 / 100 / 400).

Tensors that are not 4-D conv kernels (unless ``slice_size`` is given), smaller than
``min_numel`` or with no valid slice size travel uncompressed. Works with allreduce ``Sum``
and ``Average`` (any linear reduction; not Adasum).

Which tensor is which: Horovod calls ``compress(tensor)`` without a name. Without a name, a
tensor is identified by (shape, dtype, position among same-shaped tensors in this step); a
step starts at the first ``compress`` after a ``decompress``. That needs the gradient hooks to
fire in the same order every step (true for a fixed model). deepreduce's own optimizer passes
``name=`` and needs no such assumption.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import checkpoint
from ..errors import ConfigError, quote
from ..params import Param
from ..summable import gradiveq as gv

_SIZE = Param(int, low=0, high=1 << 60, doc="a size (a dimension, a code width)")


@dataclass
class _TensorState:
    plan: Optional[gv.SlicePlan]
    t: int = 0
    samples: List[List[torch.Tensor]] = field(default_factory=list)   # per group: first-slice samples
    running: Optional[torch.Tensor] = None                             # float64 sum of the slices
    n_samples: int = 0
    model: Optional[gv.Model] = None
    device_model: Optional[Tuple[torch.device, list, torch.Tensor]] = None


@dataclass(frozen=True)
class _Ctx:
    key: object
    mode: str          # "raw" or "pca"
    phase: str
    shape: Tuple[int, ...]
    dtype: torch.dtype


class GradiVeQ(gv.Settings):
    """Horovod-compatible GradiVeQ compressor (instance methods ``compress``/``decompress``).

    Arguments: those of :class:`deepreduce.summable.gradiveq.Settings` (the paper's defaults; layout
    ``"torch"``).
    """

    accepts_name = True

    def __init__(self, loss: float = 0.01, reuse: int = 0, slice_size: int = 0, max_slice: int = 4096,
                 min_numel: int = 1024, warmup: int = 2500, sample_iters: int = 100,
                 compress_iters: int = 400, layout: str = "torch") -> None:
        super().__init__(loss, reuse, slice_size, max_slice, min_numel, warmup, sample_iters, compress_iters, layout)
        self._states: Dict[object, _TensorState] = {}
        self._occurrence: Dict[tuple, int] = {}
        self._new_step = True
        self.stats = {"compressed": 0, "uncompressed": 0, "dense_elements": 0, "sent_elements": 0,
                      "trainings": 0}

    # ---------------------------------------------------------------- state
    def _key(self, tensor: torch.Tensor, name: Optional[str]):
        if name is not None:
            return name
        if self._new_step:
            self._occurrence.clear()
            self._new_step = False
        sig = (tuple(tensor.shape), tensor.dtype)
        occ = self._occurrence.get(sig, 0)
        self._occurrence[sig] = occ + 1
        return sig + (occ,)

    def _state(self, key, shape) -> _TensorState:
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _TensorState(self.plan(shape))
        return state

    def model(self, key) -> Optional[gv.Model]:
        """The trained model of a tensor (by name, or auto key), None before training."""
        state = self._states.get(key)
        return None if state is None else state.model

    def compression_stats(self) -> dict:
        """Counts of compressed/uncompressed sends, element volumes, and per-tensor ``d``."""
        out = dict(self.stats)
        out["ratio"] = out["dense_elements"] / out["sent_elements"] if out["sent_elements"] else 1.0
        out["dims"] = {str(k): s.model.dims for k, s in self._states.items() if s.model is not None}
        return out

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Every compressible tensor's schedule position, open sampling window and trained model,
        plus the counters, as tensors and Python values (``torch.save`` takes it)."""
        tensors = {}
        for key, state in self._states.items():
            if state.plan is None:
                continue            # always sent uncompressed: nothing to remember
            model = None
            if state.model is not None:
                model = {"groups": [(g.start, g.count, None if g.u is None else torch.from_numpy(g.u.copy()))
                                    for g in state.model.groups],
                         "offset": torch.from_numpy(state.model.offset.copy()), "dims": list(state.model.dims)}
            tensors[key] = {"shape": list(state.plan.shape), "t": state.t, "n_samples": state.n_samples,
                            "samples": [[x.clone() for x in group] for group in state.samples],
                            "running": None if state.running is None else state.running.cpu().clone(),
                            "model": model}
        return {"config": self.get_config(), "tensors": tensors, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output into a GradiVeQ built with the same arguments; every
        field is checked against this compressor's plans (:mod:`deepreduce.checkpoint`) before
        anything is replaced."""
        owner = "GradiVeQ.load_state_dict"
        if not isinstance(state, dict) or set(state) != {"config", "tensors", "stats"}:
            raise ConfigError(f"{owner}: expected a dict with the keys config, tensors, stats")
        if state["config"] != self.get_config():
            raise ConfigError(f"{owner}: checkpoint of GradiVeQ({quote(state['config'])}), this compressor is {self!r}")
        if not isinstance(state["tensors"], dict):
            raise ConfigError(f"{owner}: 'tensors' must map tensor keys to their states")
        stats = checkpoint.checked_fields(f"{owner} stats", state["stats"], {key: checkpoint.COUNT for key in self.stats})
        restored = {key: self._restored(f"{owner} tensor {quote(key)}", entry) for key, entry in state["tensors"].items()}
        self._states.clear()
        self._states.update(restored)
        self.stats.update(stats)
        self._occurrence.clear()
        self._new_step = True

    def _restored(self, owner: str, entry) -> _TensorState:
        """One tensor's checkpointed state, checked: a shape this compressor compresses, its
        schedule position, an open window of ``n_samples < sample_iters`` samples of its plan's
        slice size and a model whose groups are its plan's."""
        entry = checkpoint.checked_keys(owner, entry, ("shape", "t", "n_samples", "samples", "running", "model"))
        shape = entry["shape"]
        if not isinstance(shape, (list, tuple)) or len(shape) > 64:
            raise ConfigError(f"{owner}: 'shape' must be a list of at most 64 sizes, got {quote(shape)}")
        shape = tuple(_SIZE.check(owner, "shape", checkpoint.scalar(s), "checkpoint field") for s in shape)
        plan = self.plan(shape) if math.prod(shape) <= 1 << 60 else None
        if plan is None:
            raise ConfigError(f"{owner}: this compressor sends a tensor of shape {quote(shape)} uncompressed "
                              "and keeps no state for it")
        fields = checkpoint.checked_fields(owner, {"t": entry["t"], "n_samples": entry["n_samples"]},
                                           {"t": checkpoint.STEP, "n_samples": Param(
                                               int, low=0, high=self.schedule.sample_iters - 1)})
        restored = _TensorState(plan, fields["t"], n_samples=fields["n_samples"])
        samples, k = entry["samples"], plan.slice_size
        if restored.n_samples == 0:
            if samples != [] or entry["running"] is not None:
                raise ConfigError(f"{owner}: no samples taken, but 'samples' or 'running' holds some")
        else:
            if not isinstance(samples, (list, tuple)) or len(samples) != len(plan.groups) or \
                    any(not isinstance(group, (list, tuple)) or len(group) != restored.n_samples for group in samples):
                raise ConfigError(f"{owner}: 'samples' must hold {restored.n_samples} samples for each of the "
                                  f"plan's {len(plan.groups)} groups")
            restored.samples = [[torch.from_numpy(checkpoint.checked_array(owner, "a sample", x, "float64", k))
                                 for x in group] for group in samples]
            restored.running = torch.from_numpy(checkpoint.checked_array(
                owner, "'running'", entry["running"], "float64", shape=(plan.n_slices, k)))
        if entry["model"] is not None:
            restored.model = self._restored_model(owner, plan, entry["model"])
        return restored

    @staticmethod
    def _restored_model(owner: str, plan: gv.SlicePlan, model) -> gv.Model:
        """A checkpointed model, checked against ``plan``: its groups, compressors ``K x d``
        (``1 <= d < K``, or none), offsets and dims."""
        model = checkpoint.checked_keys(f"{owner} model", model, ("groups", "offset", "dims"))
        groups, dims, k = model["groups"], model["dims"], plan.slice_size
        if not isinstance(groups, (list, tuple)) or len(groups) != len(plan.groups) or \
                not isinstance(dims, (list, tuple)) or len(dims) != len(plan.groups):
            raise ConfigError(f"{owner}: the model must have one group and one dim for each of the plan's "
                              f"{len(plan.groups)} groups")
        restored = []
        for (start, count), group in zip(plan.groups, groups):
            if not isinstance(group, (list, tuple)) or len(group) != 3 or \
                    (checkpoint.scalar(group[0]), checkpoint.scalar(group[1])) != (start, count):
                raise ConfigError(f"{owner}: model group {quote(group)} is not the plan's ({start}, {count}, U)")
            u = group[2]
            if u is not None:
                u = np.asarray(u)
                width = u.shape[1] if u.ndim == 2 else 0
                if not 1 <= width < k:
                    raise ConfigError(f"{owner}: a model's compressor must be {k} x d with 1 <= d < {k}, "
                                      f"got shape {u.shape}")
                u = checkpoint.checked_array(owner, "a compressor U", u, "float", shape=(k, width))
            restored.append(gv.GroupModel(start, count, u))
        offset = checkpoint.checked_array(owner, "the model's offset", model["offset"], "float",
                                          shape=(plan.n_slices, k))
        return gv.Model(plan, restored, offset,
                        [_SIZE.check(owner, "dims", checkpoint.scalar(d), "checkpoint field") for d in dims])

    # ---------------------------------------------------------------- slicing on device
    def _slices(self, tensor: torch.Tensor, plan: gv.SlicePlan):
        perm = gv.slice_order(plan.shape, plan.layout)
        flat = (tensor.permute(*perm) if perm else tensor).reshape(-1)
        return flat[: plan.sliced].reshape(plan.n_slices, plan.slice_size), flat[plan.sliced:]

    def _unslice(self, slices: torch.Tensor, tail: torch.Tensor, plan: gv.SlicePlan) -> torch.Tensor:
        flat = torch.cat([slices.reshape(-1), tail])
        perm = gv.slice_order(plan.shape, plan.layout)
        if perm is None:
            return flat.reshape(plan.shape)
        permuted = flat.reshape(tuple(plan.shape[p] for p in perm))
        return permuted.permute(*gv.inverse(perm)).contiguous()

    def _device_model(self, state: _TensorState, device: torch.device):
        cached = state.device_model
        if cached is None or cached[0] != device:
            us = [None if g.u is None else torch.from_numpy(g.u).to(device) for g in state.model.groups]
            cached = state.device_model = (device, us, torch.from_numpy(state.model.offset).to(device))
        return cached[1], cached[2]

    # ---------------------------------------------------------------- Horovod contract
    def compress(self, tensor: torch.Tensor, name: Optional[str] = None):
        """``(tensor to allreduce, context)``: the code in compression steps, else the tensor."""
        key = self._key(tensor, name)
        state = self._state(key, tuple(tensor.shape))
        phase = self.schedule.phase(state.t)
        ctx = _Ctx(key, "raw", phase, tuple(tensor.shape), tensor.dtype)
        self.stats["dense_elements"] += tensor.numel()
        if state.plan is None or phase != "compress" or state.model is None \
                or not tensor.dtype.is_floating_point:
            self.stats["uncompressed"] += 1
            self.stats["sent_elements"] += tensor.numel()
            return tensor, ctx
        us, _ = self._device_model(state, tensor.device)
        slices, tail = self._slices(tensor.detach().float(), state.plan)
        parts = []
        for g, u in zip(state.model.groups, us):
            block = slices[g.start:g.start + g.count]
            parts.append((block @ u if u is not None else block).reshape(-1))
        parts.append(tail)
        code = torch.cat(parts)
        self.stats["compressed"] += 1
        self.stats["sent_elements"] += code.numel()
        return code, _Ctx(key, "pca", phase, ctx.shape, ctx.dtype)

    def decompress(self, tensor: torch.Tensor, ctx: _Ctx, parts: int = 1) -> torch.Tensor:
        """The aggregated gradient from the allreduce output; advances the tensor's schedule.

        ``parts`` (default 1) splits the affine offset for decompressing one rank's share of a
        sum (see :func:`deepreduce.summable.gradiveq.decompress`).
        """
        self._new_step = True
        state = self._states[ctx.key]
        if ctx.mode == "raw":
            if ctx.phase == "sample" and state.plan is not None and tensor.dtype.is_floating_point:
                self._record(state, tensor)
            out = tensor
        else:
            us, offset = self._device_model(state, tensor.device)
            plan, pos = state.plan, 0
            code = tensor.float()
            blocks = []
            for g, u in zip(state.model.groups, us):
                width = u.shape[1] if u is not None else plan.slice_size
                block = code[pos:pos + g.count * width].reshape(g.count, width)
                pos += g.count * width
                blocks.append(block @ u.T if u is not None else block)
            slices = torch.cat(blocks) + offset / parts
            out = self._unslice(slices, code[pos:], plan).to(ctx.dtype)
        state.t += 1
        return out

    def _record(self, state: _TensorState, reduced: torch.Tensor) -> None:
        plan = state.plan
        slices, _ = self._slices(reduced.detach().double(), plan)
        if state.n_samples == 0:
            state.samples = [[] for _ in plan.groups]
            state.running = torch.zeros_like(slices)
        for i, (start, _count) in enumerate(plan.groups):
            state.samples[i].append(slices[start].cpu())
        state.running = state.running.to(slices.device)     # a checkpoint restores it on the CPU
        state.running += slices
        state.n_samples += 1
        if state.n_samples == self.schedule.sample_iters:
            samples = [torch.stack(s).numpy() for s in state.samples]
            mean = (state.running / state.n_samples).cpu().numpy()
            state.model = gv.train(plan, samples, mean, self.loss)
            state.device_model = None
            state.samples, state.running, state.n_samples = [], None, 0
            self.stats["trainings"] += 1
