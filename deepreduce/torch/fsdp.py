"""deepreduce on a PyTorch FSDP2 model (``torch.distributed.fsdp.fully_shard``) and on HSDP.

``register(model, compression, replicate_group=None)`` installs, on every ``FSDPModule`` of
``model``:

* a compressed **reduce-scatter** (``set_custom_reduce_scatter``): each rank selects over its
  flat gradient, encodes one container per destination chunk, one alltoall carries each to its
  owner, which decode-sums its chunk in float32 (the step engine's ``shard`` route,
  :mod:`deepreduce.collective.routes.shard`). FSDP's reduce op (AVG, SUM, PreMulSum: its
  divide factor and forced SUM) is honoured exactly;
* with ``replicate_group`` (HSDP built as ``fully_shard(..., mesh=mesh["shard"])``), a
  compressed **replicate all-reduce** (``set_all_reduce_hook``): the config's aggregation
  (allgather of containers, or the sparse all-reduce) over the replicate group on each rank's
  reduced shard, averaged over the replicate group unless a gradient divide factor is set.

Each call is one step of a :class:`~deepreduce.collective.step.StepEngine` (begin once per
layout, submit, finish): the engine agrees the ranks' layouts and config, applies the
``nonfinite`` policy and commits or undoes the residuals; the comms run synchronously inside
FSDP's post-backward. bf16 or fp32 buffers (``MixedPrecisionPolicy.reduce_dtype``) are summed in
float32 and written back in their dtype. Supported: torch >= 2.9 (tested with 2.13), whose
``ReduceScatter`` protocol lives in ``torch.distributed.fsdp._fully_shard._fsdp_api``. See
docs/fsdp.md.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from ..collective import agreement
from ..collective.comm.torch_distributed import TorchDistributedCommunicator
from ..collective.ports import Pending
from ..collective.routes.shard import Scaling
from ..collective.step import Item, StepEngine
from ..errors import BackendUnavailableError, CommunicationError, ConfigError
from . import fsdp_checkpoint
from .arguments import build_pipeline, is_summable
from .tensors import TorchTensors

SUPPORTED_TORCH = "torch >= 2.9 (tested with 2.13)"
RECIPE = ("build HSDP as fully_shard(module, mesh=mesh['shard']) on every module and pass "
          "replicate_group=mesh['replicate'].get_group() to deepreduce.torch.fsdp.register")
AGGREGATIONS = (None, "allgather", "sparse_allreduce")


def _fsdp_api():
    """(FSDPModule, ReduceScatter) of this torch, or a BackendUnavailableError naming the versions."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError as exc:
        raise BackendUnavailableError(f"deepreduce.torch.fsdp needs FSDP2's ReduceScatter protocol ("
                                      f"{SUPPORTED_TORCH}); torch {torch.__version__} lacks it: {exc}") from exc
    if not hasattr(FSDPModule, "set_custom_reduce_scatter") or not hasattr(FSDPModule, "set_all_reduce_hook"):
        raise BackendUnavailableError(f"deepreduce.torch.fsdp needs FSDPModule.set_custom_reduce_scatter ("
                                      f"{SUPPORTED_TORCH}); torch {torch.__version__} lacks it")
    return FSDPModule, ReduceScatter


def scaling_of(op, size: int) -> Scaling:
    """What FSDP's reduce ``op`` asks of the sum over ``size`` ranks (AVG, SUM, PreMulSum);
    a ConfigError names any other op."""
    kind = op if isinstance(op, dist.ReduceOp.RedOpType) else getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return Scaling(divide=size)
    if kind == dist.ReduceOp.SUM:
        return Scaling()
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if not isinstance(factor, float):
            raise ConfigError(f"deepreduce FSDP reduce-scatter: PREMUL_SUM with a tensor factor ({factor!r}) "
                              "is not supported; set a float gradient divide factor")
        return Scaling(multiply=factor)
    raise ConfigError(f"deepreduce FSDP reduce-scatter: reduce op {kind!r} is not supported (AVG, SUM and "
                      "PREMUL_SUM are)")


class FSDPCompression:
    """What :func:`register` installed: one step engine per (group, role, averaging), the layouts
    the ranks agreed on, and each module's step count. ``stats()``: the engines' figures.

    A DCP ``Stateful``: ``state_dict()`` / ``load_state_dict()`` save and restore this rank's
    compressor state under a rank-unique key (:mod:`deepreduce.torch.fsdp_checkpoint`), so the
    handle goes into ``dcp.save`` / ``dcp.load`` beside the model and optimizer."""

    def __init__(self, compression, path: str) -> None:
        self.compression, self.path = compression, path
        self._engines: Dict[tuple, StepEngine] = {}
        self._agreed: set = set()
        self._steps: Dict[Tuple[str, str], int] = {}
        self._restore: Dict[str, dict] = {}   # engine key -> checked state, for engines not built yet
        pipeline = build_pipeline(compression, path)
        self.identity = agreement.compressor_identity(pipeline)
        self.digest = pipeline.core.config_digest.hex()
        aggregation = pipeline.core.get_config().get("aggregation", {}).get("id")
        if aggregation not in AGGREGATIONS:
            raise ConfigError(f"deepreduce.torch.fsdp: aggregation {aggregation!r} is not supported over the "
                              "replicate group (allgather and sparse_allreduce are)")

    def engine(self, group, role: str, average: bool) -> StepEngine:
        key = (id(group), role, average)
        if key not in self._engines:
            communicator = TorchDistributedCommunicator()
            communicator.group = group
            engine = StepEngine(build_pipeline(self.compression, self.path, spare_buffers=False), communicator,
                                TorchTensors(), self._unused_allreduce, average=average, background=False)
            state = self._restore.pop(fsdp_checkpoint.engine_key(role, average), None)
            if state is not None:
                fsdp_checkpoint.apply(engine, state)
            self._engines[key] = engine
        return self._engines[key]

    @staticmethod
    def _unused_allreduce(tensor, item, average) -> Pending:
        raise CommunicationError(f"deepreduce.torch.fsdp: {item.name!r} would take a dense all-reduce route, "
                                 "which FSDP's comms do not offer")

    def step(self, engine: StepEngine, role: str, module: str, item_args: dict) -> None:
        """One engine step for ``module``'s tensor: agree its layout once, submit, finish."""
        grad = item_args["grad"]
        layout_key = (id(engine), module, grad.numel(), str(grad.dtype))
        if layout_key not in self._agreed:
            tensors = [(f"{role}:{module}", (grad.numel(),), str(grad.dtype).replace("torch.", ""))]
            engine.begin(agreement.Layout(self.identity, tensors, f"FSDP {role} input"), "deepreduce.torch.fsdp")
            self._agreed.add(layout_key)
        step = self._steps.get((role, module), 0)
        name = f"{role}:{module}:{grad.numel()}"
        try:
            engine.submit(Item(name, step, label=f"FSDP module {module or '<root>'!r} ({role})", **item_args))
            engine.finish(step, [name])
        finally:
            self._steps[(role, module)] = step + 1

    def reduce_scatter(self, module: str, output, input, group, op) -> None:
        engine = self.engine(group, "reduce_scatter", average=False)
        scaling = scaling_of(op, dist.get_world_size(group))
        self.step(engine, "reduce_scatter", module, dict(grad=input, target=output, key=scaling, route="shard"))

    def all_reduce(self, module: str, fsdp_module, group, shard: torch.Tensor) -> None:
        """The replicate all-reduce of ``shard`` (in place), averaged over ``group`` unless the
        module has a gradient divide factor (then FSDP's reduce-scatter applied the whole divisor)."""
        average = _param_group(fsdp_module).gradient_divide_factor is None
        engine = self.engine(group, "replicate", average=average)
        work = shard if shard.dtype == torch.float32 and shard.is_contiguous() else shard.float()
        written = None if work is shard else (lambda: shard.copy_(work))
        self.step(engine, "replicate", module, dict(grad=work, target=work, written=written))

    def stats(self) -> Dict[str, dict]:
        """``{"reduce_scatter": ..., "replicate": ...}``: the engines' figures by role."""
        out: Dict[str, dict] = {}
        for (_, role, _), engine in self._engines.items():
            out[role] = engine.stats()
        return out

    def state_bytes(self) -> int:
        """Persistent compressor state held by this rank, in bytes: the pipelines' residuals and
        adaptive state and the sparse all-reduce's owner residuals and shard bounds."""
        total = 0
        for engine in self._engines.values():
            total += fsdp_checkpoint.nbytes(engine.core.state_dict())
            if engine.protocol.sparse is not None:
                total += engine.protocol.sparse.state_bytes()
        return total

    def state_dict(self) -> dict:
        """This rank's compressor state for ``torch.distributed.checkpoint``: ``{"meta": {...},
        "rank<r>": bytes}`` (step counters, residuals, the sparse all-reduce's owner residuals
        and bounds; see :mod:`deepreduce.torch.fsdp_checkpoint`). State restored but not yet
        used by an engine is saved as it was loaded."""
        return fsdp_checkpoint.save(fsdp_checkpoint.by_state_key(self._engines), self._restore, self._steps, self.digest)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (as ``dcp.load`` hands it back), checked whole
        first: another config, world size or rank is a ConfigError naming it, on every rank."""
        engines, steps = fsdp_checkpoint.load(state, self.digest, self.compression, self.path)
        for key, engine in fsdp_checkpoint.by_state_key(self._engines).items():
            if key in engines:
                fsdp_checkpoint.apply(engine, engines.pop(key))
            else:   # the checkpoint predates this engine: it starts afresh, as it did then
                self._engines = {k: e for k, e in self._engines.items() if e is not engine}
                self._agreed = {k for k in self._agreed if k[0] != id(engine)}
                engine.close()
        self._restore = engines
        self._steps = dict(steps)

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()


def _param_group(fsdp_module):
    return fsdp_module._get_fsdp_state()._fsdp_param_groups[0]


def _make_comm(base, handle: FSDPCompression, module: str):
    class DeepReduceReduceScatter(base):
        """FSDP2's ``ReduceScatter`` comm of one module: deepreduce's compressed reduce-scatter."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            handle.reduce_scatter(module, output_tensor, input_tensor, group, op)
            return None   # done: the reduction ran synchronously
    return DeepReduceReduceScatter()


def register(model: torch.nn.Module, compression=None, replicate_group=None, *,
             path: str = "auto", reduce_scatter: bool = True) -> FSDPCompression:
    """Install deepreduce on every ``FSDPModule`` of ``model`` (see the module docstring).

    ``compression``: a config (YAML path, shipped name such as ``"fsdp_topk"``, dict) or built
    pipeline; None is lossless. ``replicate_group``: the replicate process group of HSDP built
    with the recipe in docs/fsdp.md; None: FSDP over one group. ``reduce_scatter=False`` leaves
    FSDP's own reduce-scatter (only the replicate all-reduce is compressed). Refused with a
    ConfigError: summable compressors, a module with several parameter groups, a native 2-D
    HSDP mesh (the hook cannot replace its all-reduce: the error says the recipe), an
    ``auto`` aggregation; a torch without the protocol is a BackendUnavailableError.
    """
    FSDPModule, base = _fsdp_api()
    if is_summable(compression):
        raise ConfigError("deepreduce.torch.fsdp: summable compressors (fp16, GradiVeQ) are not supported; "
                          "pass a deepreduce config")
    if replicate_group is not None and not isinstance(replicate_group, dist.ProcessGroup):
        raise ConfigError(f"deepreduce.torch.fsdp: replicate_group must be a ProcessGroup, got "
                          f"{type(replicate_group).__name__}")
    modules: List[tuple] = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ConfigError("deepreduce.torch.fsdp.register: the model has no FSDPModule; apply fully_shard first")
    for name, module in modules:
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ConfigError(f"deepreduce.torch.fsdp: FSDP module {name or '<root>'!r} has {len(groups)} "
                              "parameter groups (per-parameter meshes via shard_placement_fn); one per module "
                              "is supported")
        if groups and groups[0]._is_hsdp:
            raise ConfigError(f"deepreduce.torch.fsdp: FSDP module {name or '<root>'!r} uses native HSDP (a 2-D "
                              f"mesh given to fully_shard), whose all-reduce the hook cannot replace; {RECIPE}")
    handle = FSDPCompression(compression, path)
    for name, module in modules:
        if not module._get_fsdp_state()._fsdp_param_groups:
            continue   # a root without parameters of its own has nothing to reduce
        if reduce_scatter:
            module.set_custom_reduce_scatter(_make_comm(base, handle, name))
        if replicate_group is not None:
            module.set_all_reduce_hook(
                lambda shard, n=name, m=module: handle.all_reduce(n, m, replicate_group, shard))
    return handle
