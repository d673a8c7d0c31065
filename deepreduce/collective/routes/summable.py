"""A summable compressor's codes (GradiVeQ, fp16), all-reduced and decompressed: the Horovod
``Compressor`` contract, ``compress(tensor) -> (codes, ctx)`` then ``decompress(codes, ctx)``.
The codes are averaged by the all-reduce itself, as Horovod's own optimizer does, so the result
equals ``hvd.DistributedOptimizer(compression=...)``'s bit for bit; the engine's divisor is not
applied again (a binding whose all-reduce only sums, DDP's, has each decompressed sum divided).
The parts of an item (a DDP bucket's parameters) are compressed each and summed in one all-reduce. The codes travel with the all-reduce routes' failure flag
(:func:`deepreduce.collective.routes.dense.flagged`)."""
from __future__ import annotations

from ...errors import ConfigError
from ._base import Outcome, Route
from .dense import flagged, nonfinite_report, unflagged


class Summable(Route):
    id = "summable"
    ORDER = 0

    def __init__(self, engine) -> None:
        self.engine = engine
        # name -> (the number of elements, the dtype's name) of the last codes sent: a failed rank
        # sends zeros of that size. Only these: the codes themselves (for fp16 half a gradient)
        # are not kept between steps.
        self._code_layout = {}

    def start(self, engine, item):
        compressor = engine.compressor
        named = getattr(compressor, "accepts_name", False)
        pairs = [compressor.compress(t, name=n) if named else compressor.compress(t) for n, t, _ in item.parts]
        codes, contexts = [code for code, _ in pairs], [ctx for _, ctx in pairs]
        if len({str(code.dtype) for code in codes}) != 1:   # one all-reduce sums them
            raise ConfigError(f"{compressor!r} returned codes of several dtypes "
                              f"({sorted({str(code.dtype) for code in codes})}) for {item.label}; "
                              "a summable compressor must use one dtype")
        self._code_layout[item.name] = (sum(engine.tensors.numel(code) for code in codes), _dtype_name(codes[0]))
        sent = flagged(engine.tensors, codes, "same", failed=False)
        return codes, contexts, sent, engine.allreduce(sent, item, engine.average)

    def fail(self, engine, item, error):
        """Zeros of the last step's codes' size and dtype (the gradient's on the first step) and the flag."""
        grads = [tensor for _, tensor, _ in item.parts]
        last = self._code_layout.get(item.name)
        if last is None:
            sent = flagged(engine.tensors, grads, "same", failed=True)
        else:
            sent = flagged(engine.tensors, _spanning(engine.tensors, grads, last[0]), last[1], failed=True)
        return None, None, sent, engine.allreduce(sent, item, engine.average)

    def finish(self, engine, item, started):
        codes, contexts, sent, pending = started
        pending.wait()
        tensors = engine.tensors
        summed = unflagged(tensors, sent, item)

        def write(divisor: int) -> None:
            at = 0
            for (_, _, target), code, ctx in zip(item.parts, codes, contexts):
                numel = tensors.numel(code)
                tensors.copy(target, engine.compressor.decompress(tensors.like(summed[at:at + numel], code), ctx))
                at += numel
                if not engine.allreduce_averages and divisor != 1:   # else the all-reduce averaged
                    tensors.divide(target, divisor)
        return Outcome(write, nonfinite_report(tensors, summed))


def _dtype_name(tensor) -> str:
    """A NumPy or torch dtype as the tensor port takes it (``float16``, not ``torch.float16``)."""
    return str(tensor.dtype).replace("torch.", "")


def _spanning(tensors, grads, numel: int) -> list:
    """Slices of the item's flat gradients, end to end and repeated as needed, holding ``numel``
    elements in all: the port's ``with_flag`` sizes a failed rank's zeros by them (their values
    are never read), so no codes need be kept to size them. The gradients themselves when they
    hold no element (their codes then hold none either)."""
    flat = [g.reshape(-1) for g in grads if tensors.numel(g)]
    out, left = [], numel
    while flat and left > 0:
        for part in flat:
            take = min(left, tensors.numel(part))
            out.append(part[:take])
            left -= take
    return out or grads
