"""What ``horovod.torch.DistributedOptimizer`` promises its user, apart from how it reduces.

:func:`check_arguments` checks the factory's Horovod arguments; :func:`graft` grafts the methods
of a reducing subclass of :class:`HorovodOptimizer` onto the wrapped optimizer's class, as
Horovod does, so the result is still an instance of that class with its ``step`` and state.
:class:`HorovodOptimizer` holds Horovod's semantics:

* a gradient is handed over (``_submit``) once ``backward_passes_per_step`` passes accumulated
  it, a further pass is refused before it accumulates, and ``synchronize()`` hands over the
  parameters no pass reached;
* ``step()`` synchronizes first unless inside ``skip_synchronize()``; the local step by which
  ``hvd.broadcast_optimizer_state`` initialises a fresh rank's state runs no collective;
* ``zero_grad()`` and ``state_dict()`` are refused while gradients are in flight; a checkpoint
  carries the compression state;
* ``op``, ``gradient_predivide_factor`` and ``process_set`` apply to every all-reduce, and a rank
  outside the process set applies its own gradients; ``sparse_as_dense`` reduces a sparse
  gradient dense and hands it back sparse.

The reducing subclass (:mod:`deepreduce.torch.optimizer`) provides ``_submit``, ``synchronize``,
``_names`` and the ``_pipeline``, ``_compressor`` and ``_protocol`` whose state the checkpoint holds.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Dict, List, Optional

import torch

from ..collective import buckets
from ..collective.comm.horovod import HorovodCommunicator
from ..errors import BackendUnavailableError, ConfigError, DeepReduceError
from .checkpoint import compression_state_dict, load_compression_state_dict


def horovod():
    """``horovod.torch``, or a BackendUnavailableError saying how to build it."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise BackendUnavailableError(f"deepreduce.torch.DistributedOptimizer needs horovod.torch: {exc}. "
                                      "Run `make setup` to build Horovod.") from exc
    return hvd


def check_arguments(op, backward_passes_per_step, gradient_predivide_factor: float, num_groups: int, groups):
    """The factory's Horovod arguments checked (ConfigErrors naming the argument); returns ``op``
    (default ``hvd.Average``)."""
    hvd = horovod()
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
    return op


def graft(optimizer: torch.optim.Optimizer, reducer: type) -> type:
    """A subclass of ``optimizer``'s class holding the methods of ``reducer`` and of its bases up
    to :class:`HorovodOptimizer` (the subclass's win); ``_optimizer_class`` names the wrapped
    class, whose methods the grafted ones call however the result is subclassed."""
    methods: dict = {}
    for klass in reversed(reducer.__mro__[:reducer.__mro__.index(torch.optim.Optimizer)]):
        methods.update(vars(klass))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    cls._optimizer_class = optimizer.__class__
    return cls


class HorovodOptimizer(torch.optim.Optimizer):
    """Horovod's optimizer contract (see the module docstring); its methods are grafted."""

    def _init_contract(self, backward_passes_per_step: int, op, predivide: float, process_set,
                       sparse_as_dense: bool) -> None:
        """Horovod's arguments and per-step state (the hooks come last: :meth:`_register_hooks`)."""
        self._hvd = horovod()
        self._op, self._predivide, self._process_set = op, predivide, process_set
        # Horovod's semantics: a rank outside the process set takes no part in its collectives
        # and applies its own gradients (no hooks, synchronize() returns at once)
        self._member = process_set is None or bool(process_set.included())
        self.backward_passes_per_step = backward_passes_per_step
        self._delay: Dict[torch.Tensor, int] = {}   # backward passes still to come, per parameter
        self._hook_handles: List = []
        self._handed: set = set()                   # parameters whose gradient went to _submit this step
        self._sparse_as_dense = sparse_as_dense
        self._densified: Dict[torch.Tensor, int] = {}   # sparse_as_dense: parameter -> its gradient's sparse_dim
        self._step_count = 0                        # the compression step counter (checkpointed)
        self._should_synchronize, self._synchronized, self._warned_resynchronize = True, False, False

    def _register_hooks(self) -> None:
        """On a member of the process set, the hooks on every trainable parameter."""
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        for p in trainable if self._member else ():
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
        """``_submit`` ``p``'s gradient; from then on the step has gradients in flight."""
        self._submit(p)
        self._handed.add(p)

    def _hand_over_the_rest(self) -> None:
        """As Horovod's ``synchronize()``: the parameters no backward pass reached this step are
        reduced too (a zero gradient where they have none), so every rank sends every tensor."""
        for p in (p for group in self.param_groups for p in group["params"] if p.requires_grad):
            if p not in self._handed:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._hand_over(p)

    def _horovod_communicator(self, configured):
        """The communicator the config names, else Horovod's allgather; a Horovod one gathers
        within the process set."""
        comm = HorovodCommunicator() if configured is None else configured
        if isinstance(comm, HorovodCommunicator):
            comm.process_set = self._process_set
        return comm

    def _sparse_gradient(self, p: torch.Tensor, refusal: Optional[str]) -> None:
        """With ``sparse_as_dense``, ``p``'s sparse gradient is reduced dense (handed back sparse
        by :meth:`_end_passes`); else a ConfigError where ``refusal`` says why it cannot travel sparse."""
        if self._sparse_as_dense:
            self._densified[p] = p.grad.sparse_dim()
            p.grad = p.grad.to_dense()
        elif refusal is not None:
            raise ConfigError(f"parameter {self._names[p]!r} has a sparse gradient, but {refusal}: "
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

    def _allreduce(self, name: str, tensor: torch.Tensor, op):
        """Start Horovod's in-place all-reduce of ``tensor`` on the process set (``op=Average``
        with the predivide factor as Horovod applies it); return its handle."""
        kwargs = {} if self._process_set is None else {"process_set": self._process_set}
        if op == self._hvd.Average:
            kwargs.update(prescale_factor=1.0 / self._predivide, postscale_factor=self._predivide)
        return self._hvd.allreduce_async_(tensor, name=f"deepreduce.{name}", op=op, **kwargs)

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
        """The wrapped optimizer's state dict plus, under ``"deepreduce"``, the step counter, the
        pipeline's residuals and learned state (or the summable compressor's, e.g. GradiVeQ models).

        Save it as usual (``torch.save(optimizer.state_dict(), ...)``); a run resumed with
        ``load_state_dict`` sends byte-identical containers to one that never stopped.
        """
        if self._handed:
            raise DeepReduceError("optimizer.state_dict() called after backward() but before step()")
        out = self._optimizer_class.state_dict(self)
        sparse = None if self._protocol is None else self._protocol.sparse
        out["deepreduce"] = compression_state_dict(self._pipeline, self._compressor, self._step_count,
                                                   None if sparse is None else sparse.state_dict())
        return out

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
