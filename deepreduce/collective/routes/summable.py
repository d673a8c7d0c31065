"""A summable compressor's codes (GradiVeQ, fp16), all-reduced and decompressed: the Horovod
``Compressor`` contract, ``compress(tensor) -> (codes, ctx)`` then ``decompress(codes, ctx)``.
The codes are averaged by the all-reduce itself, as Horovod's own optimizer does, so the result
equals ``hvd.DistributedOptimizer(compression=...)``'s bit for bit; the engine's divisor is not
applied again. The codes travel with the all-reduce routes' failure flag
(:func:`deepreduce.collective.routes.dense.flagged`)."""
from __future__ import annotations

from ._base import Outcome, Route
from .dense import flagged, nonfinite_report, unflagged


class Summable(Route):
    id = "summable"
    ORDER = 0

    def __init__(self, engine) -> None:
        self.engine = engine
        self._last_codes = {}   # name -> the last codes sent (a failed rank sends zeros of that shape)

    def start(self, engine, item):
        compressor = engine.compressor
        if getattr(compressor, "accepts_name", False):
            codes, ctx = compressor.compress(item.grad, name=item.name)
        else:
            codes, ctx = compressor.compress(item.grad)
        self._last_codes[item.name] = codes
        sent = flagged(engine.tensors, codes, "same", failed=False)
        return codes, ctx, sent, engine.allreduce(sent, item.name, engine.average)

    def fail(self, engine, item, error):
        """Zero codes of the last step's shape (the gradient's on the first step) and the flag."""
        codes = self._last_codes.get(item.name, item.grad)
        sent = flagged(engine.tensors, codes, "same", failed=True)
        return codes, None, sent, engine.allreduce(sent, item.name, engine.average)

    def finish(self, engine, item, started):
        codes, ctx, sent, pending = started
        pending.wait()
        summed = engine.tensors.like(unflagged(engine.tensors, sent, item), codes)

        def write(_divisor: int) -> None:
            engine.tensors.copy(item.target, engine.compressor.decompress(summed, ctx))
        return Outcome(write, nonfinite_report(engine.tensors, summed))
