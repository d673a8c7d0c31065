"""What ``horovod.torch.DistributedOptimizer`` promises its user, apart from how it reduces.

:func:`graft` grafts the methods of :class:`HorovodOptimizer` onto the wrapped optimizer's
class, as Horovod does, so the result is still an instance of that class with its ``step`` and
state. :class:`HorovodOptimizer` keeps Horovod's semantics and holds a
:class:`~deepreduce.torch.reduction.Reduction` (what moves the gradients; the step engine's is
:class:`deepreduce.torch.optimizer.EngineReduction`), no base class:

* a gradient is handed over (``Reduction.submit``) once ``backward_passes_per_step`` passes
  accumulated it, a further pass is refused before it accumulates, and ``synchronize()`` hands
  over the parameters no pass reached, then ``Reduction.finish`` ends the step;
* ``step()`` synchronizes first unless inside ``skip_synchronize()``; the local step by which
  ``hvd.broadcast_optimizer_state`` initialises a fresh rank's state runs no collective;
* ``zero_grad()`` and ``state_dict()`` are refused while gradients are in flight; a checkpoint
  carries the reduction's state;
* ``op``, ``gradient_predivide_factor`` and ``process_set`` apply to every all-reduce
  (:meth:`HorovodOptimizer.allreduce`, the port the reduction is given), and a rank outside the
  process set applies its own gradients; ``sparse_as_dense`` reduces a sparse gradient dense and
  hands it back sparse.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Dict, List, Optional

import torch

from ..errors import ConfigError, DeepReduceError
from .arguments import horovod
from .reduction import Reduction


def graft(optimizer: torch.optim.Optimizer) -> type:
    """A subclass of ``optimizer``'s class holding :class:`HorovodOptimizer`'s methods;
    ``_optimizer_class`` names the wrapped class, whose methods the grafted ones call however the
    result is subclassed."""
    methods = dict(vars(HorovodOptimizer))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    cls._optimizer_class = optimizer.__class__
    return cls


class HorovodOptimizer(torch.optim.Optimizer):
    """Horovod's optimizer contract (see the module docstring); its methods are grafted onto the
    wrapped optimizer's class by :func:`graft`."""

    def __init__(self, params, reduction: Callable[["HorovodOptimizer"], Reduction], backward_passes_per_step: int,
                 op, predivide: float, process_set, sparse_as_dense: bool) -> None:
        """The wrapped optimizer over ``params``, Horovod's arguments and per-step state, the
        reduction ``reduction(self)`` builds, and the hooks."""
        self._optimizer_class.__init__(self, params)
        self._hvd = horovod()
        self._op, self._predivide, self._process_set = op, predivide, process_set
        # Horovod's semantics: a rank outside the process set takes no part in its collectives
        # and applies its own gradients (no hooks, synchronize() returns at once)
        self._member = process_set is None or bool(process_set.included())
        self.backward_passes_per_step = backward_passes_per_step
        self._delay: Dict[torch.Tensor, int] = {}   # backward passes still to come, per parameter
        self._hook_handles: List = []
        self._handed: set = set()                   # parameters whose gradient went to the reduction this step
        self._sparse_as_dense = sparse_as_dense
        self._densified: Dict[torch.Tensor, int] = {}   # sparse_as_dense: parameter -> its gradient's sparse_dim
        self._step_count = 0                        # the compression step counter (checkpointed)
        self._should_synchronize, self._synchronized, self._warned_resynchronize = True, False, False
        self._reduction = reduction(self)
        self._register_hooks()

    def trainable(self) -> List[torch.Tensor]:
        """The parameters whose gradients are reduced, in the param groups' order."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def add_param_group(self, param_group) -> None:
        self._optimizer_class.add_param_group(self, param_group)
        if hasattr(self, "_reduction"):   # the wrapped __init__ adds its groups before the reduction exists
            self._reduction.parameters_changed()

    def _register_hooks(self) -> None:
        """On a member of the process set, the hooks on every trainable parameter."""
        for p in self.trainable() if self._member else ():
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
                self._hand_over(p)
        return hook

    def _hand_over(self, p: torch.Tensor) -> None:
        """Submit ``p``'s gradient; from then on the step has gradients in flight."""
        if p.grad.is_sparse:
            self._sparse_gradient(p, self._reduction.sparse_refusal(p))
        self._reduction.submit(p, self._step_count)
        self._handed.add(p)

    def _hand_over_the_rest(self) -> None:
        """As Horovod's ``synchronize()``: the parameters no backward pass reached this step are
        reduced too (a zero gradient where they have none), so every rank sends every tensor."""
        for p in self.trainable():
            if p not in self._handed:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._hand_over(p)

    def _sparse_gradient(self, p: torch.Tensor, refusal: Optional[str]) -> None:
        """With ``sparse_as_dense``, ``p``'s sparse gradient is reduced dense (handed back sparse
        by :meth:`_end_passes`); else a ConfigError where ``refusal`` says why it cannot travel sparse."""
        if self._sparse_as_dense:
            self._densified[p] = p.grad.sparse_dim()
            p.grad = p.grad.to_dense()
        elif refusal is not None:
            raise ConfigError(f"parameter {self._reduction.name(p)!r} has a sparse gradient, but {refusal}: "
                              "pass sparse_as_dense=True")

    def _end_passes(self) -> None:
        """After a step: densified gradients handed back sparse, and every parameter waits for
        backward_passes_per_step passes (and a new hand-over) again."""
        self._handed.clear()
        for p, sparse_dim in self._densified.items():
            p.grad = p.grad.to_sparse(sparse_dim)
        self._densified.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def allreduce(self, name: str, tensor: torch.Tensor, average: bool):
        """Start Horovod's in-place all-reduce of ``tensor`` on the process set (averaging with
        the configured op and predivide factor where ``average``, else a sum); return its handle."""
        op = self._op if average else self._hvd.Sum
        kwargs = {} if self._process_set is None else {"process_set": self._process_set}
        if op == self._hvd.Average:
            kwargs.update(prescale_factor=1.0 / self._predivide, postscale_factor=self._predivide)
        return self._hvd.allreduce_async_(tensor, name=f"deepreduce.{name}", op=op, **kwargs)

    def synchronize(self) -> None:
        """Wait for every parameter's encode and collective and write the aggregated gradients.

        An error of any parameter (raised on the worker, by the collective or by decoding) is
        re-raised here, with its type and message, once every other collective of the step
        finished; the next step works as usual. Under ``nonfinite: raise`` a NaN/Inf gradient on
        any rank makes every rank raise the same NonFiniteGradientError here with nothing written
        and the residuals restored, so catching it skips the step (see README).
        """
        if not self._member:
            self._synchronized = True
            return
        self._hand_over_the_rest()
        try:
            self._reduction.finish(self._step_count)
        finally:
            self._end_passes()
            self._step_count += 1
        self._synchronized = True

    def compression_stats(self) -> dict:
        """The reduction's figures (bytes before and after compression, encode / wait / decode
        seconds, routes taken, the aggregation's figures)."""
        return self._reduction.stats()

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
        if self._handed or any(d != self.backward_passes_per_step for d in self._delay.values()):
            return False
        if any(self.state.get(p) for group in self.param_groups for p in group["params"]):
            return False
        grads = [p.grad for p in self._delay]
        return all(g is not None and not (g.coalesce().values() if g.is_sparse else g).any() for g in grads)

    def zero_grad(self, set_to_none: bool = True):
        if self._handed:
            raise DeepReduceError("optimizer.zero_grad() called after backward() but before step() or synchronize()")
        return self._optimizer_class.zero_grad(self, set_to_none=set_to_none)

    def state_dict(self):
        """The wrapped optimizer's state dict plus, under ``"deepreduce"``, the reduction's state:
        the step counter, the pipeline's residuals and learned state (or the summable
        compressor's, e.g. GradiVeQ models).

        Save it as usual (``torch.save(optimizer.state_dict(), ...)``); a run resumed with
        ``load_state_dict`` sends byte-identical containers to one that never stopped.
        """
        if self._handed:
            raise DeepReduceError("optimizer.state_dict() called after backward() but before step()")
        out = self._optimizer_class.state_dict(self)
        out["deepreduce"] = self._reduction.state_dict(self._step_count)
        return out

    def load_state_dict(self, state_dict):
        """Restore both parts of :meth:`state_dict`; a plain torch optimizer state dict (no
        ``"deepreduce"`` entry) restores the optimizer and leaves the compression state as it is."""
        state_dict = dict(state_dict)
        compression = state_dict.pop("deepreduce", None)
        if compression is not None:
            self._step_count = self._reduction.load_state_dict(compression)
        self._optimizer_class.load_state_dict(self, state_dict)
