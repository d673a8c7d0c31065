"""``deepreduce bench-stages``: where a config's encode and decode time goes, stage by stage.

Runs one config over a whole model's gradients, the way ``reproduce fig11`` exchanges them:
every tensor is encoded once and the containers of ``--ranks`` ranks (this rank's own and
``--ranks - 1`` copies of a peer's: a second pipeline of the config encoding the negated
gradient, untimed) are decoded with ``decode_sum``. The time of each stage is measured by
wrapping the pipeline's components for the run (nothing else changes):

* encode: ``select`` (the sparsifier), ``index.encode``, ``value.encode``, ``value.reconstruct``
  (the receiver's values for error feedback), ``permutation pack`` (``bitpack.pack``) and the
  rest of ``Pipeline.encode`` (memory, container packing);
* decode: ``index.decode``, ``value.decode``, ``permutation unpack`` (``bitpack.unpack`` with
  its check) and the rest (container parsing and checks, scatter-add).

Gradients: ``fig11`` (default) are the NCF recommender's gradients of one Fig. 11 iteration
(Zipf data, local batch 5,120 of rank 0 of 2, after ``--iteration`` Adam steps; needs torch),
or the name of a saved ResNet-20 gradient (``all`` for the whole set).
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Dict, List

import numpy as np

from ._bench_kernels import peer_payloads


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-stages", help="per-stage encode/decode time of a config (fig11 gradients)")
    parser.add_argument("config", nargs="?", default="configs/bfp2_polyfit.yaml", help="config file")
    parser.add_argument("--gradient", default="fig11", help="'fig11' (NCF gradients) or a saved gradient name")
    parser.add_argument("--iteration", type=int, default=2, help="fig11: Adam steps before the measured gradient")
    parser.add_argument("--ranks", type=int, default=2, help="containers summed per tensor in decode")
    parser.add_argument("--repeat", type=int, default=5, help="timed iterations (median per stage)")
    parser.set_defaults(func=run)


def fig11_gradients(iteration: int) -> Dict[str, np.ndarray]:
    """The NCF gradients of rank 0 (of 2) at ``iteration`` in ``reproduce fig11``'s setting."""
    import torch
    from torch.nn import functional as F

    from ..models.ncf import NCF
    from ..recsys_data import ZipfConfig, generate

    torch.manual_seed(0)
    data = generate(ZipfConfig())
    model = NCF(data.n_users, data.n_items)
    opt = torch.optim.Adam(model.parameters(), lr=0.002)
    stream = data.epoch(0, 5120, rank=0, size=2)
    for _ in range(iteration + 1):
        opt.zero_grad()
        users, items, labels = next(stream)
        loss = F.binary_cross_entropy_with_logits(model(torch.from_numpy(users), torch.from_numpy(items)),
                                                  torch.from_numpy(labels))
        loss.backward()
        grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
        opt.step()
    return grads


class StageTimer:
    """Accumulates wall time per stage name while the wrapped callables run.

    Only the outermost wrapped call counts: a value codec whose encode decodes its own
    payload (to hand back the receiver's values) books that decode under its encode.
    """

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}
        self._inside = False

    def wrap(self, stage: str, fn):
        def timed(*args, **kwargs):
            if self._inside:
                return fn(*args, **kwargs)
            self._inside = True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False
                self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0
        return timed


@contextmanager
def instrumented(pipe, timer: StageTimer):
    """Wrap the pipeline's components and the permutation packing for the duration."""
    from deepreduce.wire import bitpack

    patched = [(pipe.sparsifier, "select", "select"), (pipe.index, "encode", "index.encode"),
               (pipe.index, "decode", "index.decode"), (pipe.value, "encode", "value.encode"),
               (pipe.value, "decode", "value.decode"), (pipe.value, "reconstruct", "value.reconstruct")]
    for obj, attr, stage in patched:
        setattr(obj, attr, timer.wrap(stage, getattr(obj, attr)))
    originals = bitpack.pack, bitpack.unpack
    bitpack.pack = timer.wrap("permutation pack", bitpack.pack)
    bitpack.unpack = timer.wrap("permutation unpack", bitpack.unpack)
    try:
        yield
    finally:
        bitpack.pack, bitpack.unpack = originals
        for obj, attr, _ in patched:
            delattr(obj, attr)


ENCODE_STAGES = ("select", "index.encode", "value.encode", "value.reconstruct", "permutation pack")
DECODE_STAGES = ("index.decode", "value.decode", "permutation unpack")


def measure(pipe, peer, grads: Dict[str, np.ndarray], ranks: int, repeat: int) -> Dict[str, List[float]]:
    """Per-iteration milliseconds of every stage (and the encode/decode totals), ``repeat`` times.

    ``peer``: a second pipeline of the same config, standing for the other ranks."""
    rows: Dict[str, List[float]] = {}
    for it in range(repeat + 1):
        received = dict(zip(grads, peer_payloads(peer, grads.items(), it)))
        timer = StageTimer()
        with instrumented(pipe, timer):
            t0 = time.perf_counter()
            payloads = {name: pipe.encode(g, name=name, step=it) for name, g in grads.items()}
            t1 = time.perf_counter()
            for name, g in grads.items():
                pipe.decode_sum([payloads[name]] + [received[name]] * (ranks - 1), g.shape)
            t2 = time.perf_counter()
        if it == 0:
            continue                      # warm-up (native modules loaded, caches filled)
        enc, dec = t1 - t0, t2 - t1
        s = timer.seconds
        stages = {f"encode: {k}": s.get(k, 0.0) for k in ENCODE_STAGES}
        stages["encode: rest (memory, container)"] = enc - sum(stages.values())
        dec_stages = {f"decode: {k}": s.get(k, 0.0) for k in DECODE_STAGES}
        dec_stages["decode: rest (parse, checks, scatter-add)"] = dec - sum(dec_stages.values())
        stages.update(dec_stages)
        stages.update({"encode total": enc, "decode total": dec, "encode + decode": enc + dec})
        for k, v in stages.items():
            rows.setdefault(k, []).append(1e3 * v)
    return rows


def run(args) -> int:
    from deepreduce.config import build

    from .. import gradients

    if args.gradient == "fig11":
        grads = fig11_gradients(args.iteration)
        source = f"fig11 NCF gradients (rank 0 of 2, batch 5120, iteration {args.iteration})"
    elif args.gradient == "all":
        grads = {k: v for k, v in gradients.load().items() if k != "all"}
        source = "every saved ResNet-20 gradient"
    else:
        grads = {args.gradient: gradients.get(args.gradient)}
        source = f"saved gradient {args.gradient!r}"
    pipe = build(args.config)
    nonzero = sum(int(np.count_nonzero(g)) for g in grads.values())
    numel = sum(g.size for g in grads.values())
    print(f"{args.config} on {source}: {len(grads)} tensors, {numel:,} entries, {nonzero:,} non-zero; "
          f"decode sums {args.ranks} containers per tensor; {args.repeat} iterations, wall ms "
          f"(the minimum is the better figure on a busy machine)")
    rows = measure(pipe, build(args.config), grads, args.ranks, args.repeat)
    print(f"  {'stage':<44} {'median':>9} {'min':>9}")
    for stage, values in rows.items():
        print(f"  {stage:<44} {statistics.median(values):9.2f} {min(values):9.2f}")
    s = pipe.stats
    print(f"  wire bytes per iteration: {s.wire_bytes // max(1, args.repeat + 1):,} "
          f"(index {s.index_bytes // (args.repeat + 1):,}, values {s.value_bytes // (args.repeat + 1):,}, "
          f"permutation {s.permutation_bytes // (args.repeat + 1):,}); dense {4 * numel:,}")
    return 0
