"""A summable compressor's codes (GradiVeQ, fp16), all-reduced and decompressed: the Horovod
``Compressor`` contract, ``compress(tensor) -> (codes, ctx)`` then ``decompress(codes, ctx)``.
The codes are averaged by the all-reduce itself, as Horovod's own optimizer does, so the result
equals ``hvd.DistributedOptimizer(compression=...)``'s bit for bit; the engine's divisor is not
applied again."""
from __future__ import annotations

from . import Outcome, Route


class Summable(Route):
    id = "summable"
    ORDER = 0

    def __init__(self, engine) -> None:
        self.engine = engine
        self._last_codes = {}   # name -> the last codes sent (a failed rank sends NaN codes of that shape)

    def start(self, engine, item):
        compressor = engine.compressor
        if getattr(compressor, "accepts_name", False):
            codes, ctx = compressor.compress(item.grad, name=item.name)
        else:
            codes, ctx = compressor.compress(item.grad)
        self._last_codes[item.name] = codes
        return codes, ctx, engine.allreduce(codes, item.name, engine.average)

    def fail(self, engine, item, error):
        """NaN codes of the last step's shape (the gradient's on the first step): every rank stays
        in phase and sees a non-finite result; the rank raises its own error."""
        like = self._last_codes.get(item.name, item.grad)
        codes = engine.tensors.cast(like, "same")
        engine.tensors.fill_nan(codes)
        return codes, None, engine.allreduce(codes, item.name, engine.average)

    def finish(self, engine, item, started):
        codes, ctx, pending = started
        summed = pending.wait()
        flat = engine.tensors.host(summed)
        found = None if engine.tensors.all_finite(summed) else (-1, int((flat != flat).sum()), 0)

        def write(_divisor: int) -> None:
            engine.tensors.copy(item.target, engine.compressor.decompress(summed, ctx))
        return Outcome(write, found)
