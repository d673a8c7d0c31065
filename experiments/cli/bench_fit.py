"""``deepreduce bench-fit``: the curve-fit value codecs against DeepReduce's Fig. 10 targets.

Two measurements, both on saved real ResNet-20 gradients (``deepreduce capture-gradients``):

* **volume**: the whole container (and, in brackets, only its index + value + permutation
  sections, the paper's accounting) of ``topk -> raw index -> {polyfit, dexp}`` against the Top-r
  container (``raw/raw``) at Top-r ``--ratio`` (default 1%) of one conv gradient (default the
  36,864-element ``layers.7.conv1.weight``), with the relative L2 error of the values
  (``||decoded - topr|| / ||topr||``) and encode+decode time;
* **speed**: Fit-Poly encode + decode of ``--count`` values (default 255,570 = 1% of ResNet-50's
  25,557,032) with the C++ kernel (single thread) and the NumPy path. The values are the
  ``--count`` largest-magnitude entries of every ResNet-20 gradient concatenated (``all``);
* **at scale**: on the Top-r ``--ratio`` values of synthetic gradients of ``--scale-size``
  entries (default 25,557,032; Laplace, generalised Pareto, Student-t as in
  ``bench-sparsify``): the relative L2 error and value-section bytes of Fit-Poly with the old
  fixed segmentation (4 per sign, >= 20 points) and the automatic one, and the Deflate value
  section in tensor order (the old codec), with a free reorder (order-keeping index codec) and
  with a carried permutation (set index codec). ``--scale-size 0`` skips it.
"""
from __future__ import annotations

import statistics
import time
import zlib

import numpy as np


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-fit", help="Fit-Poly / Fit-DExp volume, error and speed (Fig. 10 targets)")
    parser.add_argument("--gradient", default=None, help="saved gradient for the volume rows")
    parser.add_argument("--ratio", type=float, default=0.01, help="Top-r ratio of the volume rows")
    parser.add_argument("--count", type=int, default=255_570, help="values in the speed rows")
    parser.add_argument("--repeat", type=int, default=7, help="timed repetitions (median reported)")
    parser.add_argument("--scale-size", type=int, default=25_557_032,
                        help="gradient size of the error-at-scale rows (0: skip them)")
    parser.set_defaults(func=run)


def _times_ms(fn, repeat, clock=time.perf_counter):
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(1e3 * (clock() - t0))
    return times


def _median_ms(fn, repeat):
    return statistics.median(_times_ms(fn, repeat))


def volume_rows(grad: np.ndarray, ratio: float, repeat: int):
    from deepreduce import registry
    from deepreduce.config import build
    from deepreduce.wire.container import unpack

    base = {"sparsifier": {"id": "topk", "ratio": ratio}, "memory": {"id": "none"}, "min_numel": 0}
    flat = grad.ravel()
    rows, reference, ref_sections = [], None, None
    cases = [("Top-r raw/raw", "raw", {"id": "raw"}),
             ("Fit-Poly (deg 5, auto seg/sign)", "raw", {"id": "polyfit"}),
             ("Fit-Poly (deg 5, <=2 seg/sign)", "raw", {"id": "polyfit", "segments": 2}),
             ("Fit-DExp", "raw", {"id": "dexp"})]
    if "elias_fano" in registry.ids("index"):   # a set code: the permutation travels too
        cases += [("Fit-Poly + Elias-Fano idx + perm", "elias_fano", {"id": "polyfit"}),
                  ("Fit-DExp + Elias-Fano idx + perm", "elias_fano", {"id": "dexp"})]
    for label, index, value in cases:
        pipe = build(dict(base, index={"id": index}, value=value))
        payload = pipe.encode(grad, "conv", 0)
        out = pipe.decode(payload).ravel()
        keep = pipe.sparsifier.select(flat, pipe.context("conv", 0))
        target = np.zeros_like(flat)
        target[keep] = flat[keep]
        ms = _median_ms(lambda: pipe.decode(pipe.encode(grad, "conv", 0)), repeat)
        c = unpack(payload)
        sections = len(c.index_section) + len(c.value_section) + len(c.perm_section)
        if reference is None:
            reference, ref_sections = payload.size, sections
        rows.append((label, payload.size, 1 - payload.size / reference, 1 - sections / ref_sections,
                     float(np.linalg.norm(out - target) / np.linalg.norm(target)), ms, pipe.value.backend))
    return rows


def run(args) -> int:
    from deepreduce.backend import _native
    from deepreduce.values import polyfit

    from .. import gradients

    name = args.gradient or gradients.DEFAULT_GRADIENT
    grad = gradients.get(name)
    print(f"volume: Top-r {args.ratio:g} of {name!r} ({grad.size} elements), whole containers")
    print(f"{'codec':<32} {'bytes':>7} {'cut vs Top-r':>12} {'(sections)':>10} {'rel_err':>9} {'enc+dec ms':>10}  backend")
    for label, size, cut, cut_sections, err, ms, backend in volume_rows(grad, args.ratio, args.repeat):
        print(f"{label:<32} {size:>7} {100 * cut:>11.1f}% {100 * cut_sections:>9.1f}% {err:>9.4f} {ms:>10.3f}  {backend}")

    allg = gradients.get("all")
    count = min(args.count, allg.size)
    values = allg[np.argsort(-np.abs(allg), kind="stable")[:count]].astype(np.float32)
    values = values[np.random.default_rng(0).permutation(count)]     # transmission order is not sorted
    seg, minp = polyfit.PolyFit.PARAMS["segments"].default, polyfit.PolyFit.PARAMS["min_points"].default
    print(f"\nspeed: Fit-Poly (degree 5, {polyfit.auto_segments(count)} segments per sign (automatic), "
          f"float32 coefficients) on {count} real values")
    native = _native.load("fit")
    if native is not None:
        _, payload = native.encode(values, 5, seg, minp, 4)
        both = _times_ms(lambda: native.decode(native.encode(values, 5, seg, minp, 4)[1], count, 5, 4), args.repeat)
        enc = _median_ms(lambda: native.encode(values, 5, seg, minp, 4), args.repeat)
        dec = _median_ms(lambda: native.decode(payload, count, 5, 4), args.repeat)
        cpu = _times_ms(lambda: native.decode(native.encode(values, 5, seg, minp, 4)[1], count, 5, 4), args.repeat,
                        clock=time.thread_time)
        print(f"C++ (1 thread):  encode {enc:8.2f} ms  decode {dec:8.2f} ms  total {enc + dec:8.2f} ms (wall medians)")
        print(f"C++ encode+decode: wall min {min(both):.2f} / median {statistics.median(both):.2f} ms; "
              f"thread CPU time min {min(cpu):.2f} / median {statistics.median(cpu):.2f} ms ({args.repeat} runs)")
    else:
        print("C++ kernel deepreduce._fit not built: " + _native.BUILD_HINT)
    enc = _median_ms(lambda: polyfit.encode_numpy(values, 5, seg, minp, 4), max(1, args.repeat // 2))
    _, payload = polyfit.encode_numpy(values, 5, seg, minp, 4)
    dec = _median_ms(lambda: polyfit.decode_numpy(payload, count, 5, 4), max(1, args.repeat // 2))
    print(f"NumPy:           encode {enc:8.2f} ms  decode {dec:8.2f} ms  total {enc + dec:8.2f} ms")
    if args.scale_size:
        print(f"\nat scale: Top-r {args.ratio:g} of synthetic gradients of {args.scale_size:,} entries")
        print(f"{'gradient':<10} {'values':>8} {'codec':<52} {'value bytes':>11} {'perm bytes':>10} {'rel_err':>9}")
        for dist, count, label, nbytes, perm, err in scale_rows(args.scale_size, args.ratio):
            print(f"{dist:<10} {count:>8} {label:<52} {nbytes:>11} {perm:>10} {err:>9.5f}")
    return 0


SCALE_CASES = (("4 per sign, >= 20 points", 4, 20), ("automatic (default)", None, None))


def scale_rows(size: int, ratio: float):
    """(gradient, n, codec, value-section bytes, permutation bytes, relative error) of Fit-Poly
    and Deflate on the Top-r values of each synthetic gradient of ``size`` entries."""
    from deepreduce.values import deflate, polyfit
    from deepreduce.wire.seeding import EncodeContext

    from .bench_sparsify import synthetic

    ctx, rows = EncodeContext(b"\x00" * 16, "bench", 0), []
    for dist in ("laplace", "gpareto", "student-t"):
        g = synthetic(size, dist, 0)
        k = max(1, int(ratio * size))
        values = g[np.sort(np.argpartition(np.abs(g), size - k)[size - k:])]
        del g
        for label, segments, min_points in SCALE_CASES:
            params = {} if segments is None else {"segments": segments, "min_points": min_points}
            codec = polyfit.PolyFit(**params)
            enc = codec.encode(values, ctx)
            out = codec.decode(enc.params, enc.payload, values.size)
            err = float(np.linalg.norm(out - values[enc.order]) / np.linalg.norm(values))
            rows.append((dist, values.size, f"Fit-Poly, {label}", len(enc.payload), 0, err))
        rows.append((dist, values.size, "Deflate, tensor order (before)",
                     len(zlib.compress(values.tobytes(), 6)), 0, 0.0))
        for label, free in (("Deflate, order-keeping index (reorder free)", True),
                            ("Deflate, set index (permutation carried)", False)):
            codec = deflate.DeflateValues()
            codec.reorder_is_free = free
            enc = codec.encode(values, ctx)
            perm = 0 if free or enc.order is None else deflate.permutation_bytes(values.size)
            rows.append((dist, values.size, label + (", sorted" if enc.order is not None else ""),
                         len(enc.payload), perm, 0.0))
    return rows
