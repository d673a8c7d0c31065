"""``deepreduce bench-chunks``: chunk-local index codes and 2-8-bit values for chunked Top-k.

Index table: for a synthetic Laplace gradient of each ``--sizes`` and each ``k`` of ``--chunk``,
the chunked Top-k selection (``chunk_topk``) coded by ``chunk_fixed`` and ``chunk_enum``: bits
per index of the index section, encode and decode CPU time of the process (median of ``--repeat``), beside the
information limit ``log2 C(C, k) / k`` and the sizes two simpler per-chunk codes would have on
the same set, computed exactly from it (not implemented as codecs): Elias-Fano per chunk
(``k L + k + ((C - 1) >> L)`` bits, ``L = floor(log2(C / k))``) and Rice coding of the gaps with
the best single parameter per message. Each codec is timed on its C++ path (when the extensions
are built) and on its Python definition (``DEEPREDUCE_BACKEND=numpy`` for that row), the same
bytes, one row each (``backend``).

Value table (``--values``): relative L2 error and bits per value of the value codecs at 2-8 bits
on the chunked Top-k values of the saved ResNet-20 gradients and of Laplace and Gaussian ones.

DCT table (``--dct``): the fraction of a gradient's energy the chunked Top-k of each 64 x 64 block
keeps, before and after the block DCT-II (``deepreduce.sparsify.dct``), on the saved ResNet-20
layers whose matrix (output channels x the rest) is made of whole 64 x 64 blocks.

Figures in docs/values.md and docs/chunked.md ("Semi-synchronous recipes")::

    python -m deepreduce bench-chunks --sizes 1048576,10485760 --repeat 5 --values --dct
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-chunks", help="chunk-local index codecs and b-bit values (chunked Top-k)")
    parser.add_argument("--sizes", default="1048576,10485760", help="comma-separated gradient lengths")
    parser.add_argument("--chunk", type=int, default=4096, help="chunk length C")
    parser.add_argument("--ks", default="32,64", help="comma-separated k per chunk")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per codec (median reported)")
    parser.add_argument("--values", action="store_true", help="also the value-codec error table")
    parser.add_argument("--dct", action="store_true",
                        help="also the energy a chunked Top-k keeps with and without DeMo's 64x64 block DCT")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def elias_fano_bits(chunk: int, k: int) -> int:
    """Elias-Fano bits of one chunk of ``chunk`` elements holding ``k``."""
    low = (chunk // k).bit_length() - 1 if 0 < k < chunk else 0
    return k * low + k + ((chunk - 1) >> low)


def rice_bits(local: np.ndarray, k: int) -> int:
    """Bits of Rice-coded gaps (offset minus previous offset minus 1, per chunk) with the best
    parameter for the whole message."""
    offsets = local.reshape(-1, k)
    gaps = np.diff(offsets, axis=1, prepend=-1) - 1
    return min(int(np.sum(gaps >> p)) + gaps.size * (1 + p) for p in range(16))


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()    # CPU time of this process: the machine may be shared
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def index_rows(sizes, chunk: int, ks, repeat: int, seed: int):
    """One dict per (size, k, codec, backend)."""
    from deepreduce.backend import _native
    from deepreduce.registry import create
    from deepreduce.sparsify.chunked import chunk_topk_positions
    from deepreduce.wire.seeding import EncodeContext

    from ._bench_kernels import numpy_backend

    rng = np.random.default_rng(seed)
    ctx = EncodeContext(bytes(32), "bench", 0)
    rows = []
    for size in sizes:
        flat = rng.laplace(scale=1e-3, size=size).astype(np.float32)
        for k in ks:
            positions = chunk_topk_positions(flat, chunk, k)
            n = positions.shape[0]
            full = size // chunk
            local = positions[:full * k] % chunk
            limit = (math.lgamma(chunk + 1) - math.lgamma(k + 1) - math.lgamma(chunk - k + 1)) / math.log(2) / k
            common = dict(size=size, k=k, n=n, limit=limit, elias_fano=elias_fano_bits(chunk, k) / k,
                          rice=rice_bits(local, k) / (full * k))
            values = flat[positions]
            backends = ("c++", "python") if _native.load("chunk_enum") is not None else ("python",)
            for codec_id in ("chunk_fixed", "chunk_enum"):
                codec = create("index", {"id": codec_id, "chunk": chunk})
                sections = set()
                for backend in backends:
                    with numpy_backend(backend == "python"):
                        enc = codec.encode(positions, values, flat, ctx)
                        encode_s = _median_seconds(lambda: codec.encode(positions, values, flat, ctx), repeat)
                        decode_s = _median_seconds(lambda: codec.decode(enc.params, enc.payload, n, size), repeat)
                        assert np.array_equal(codec.decode(enc.params, enc.payload, n, size), positions)
                    sections.add(bytes(enc.payload))
                    rows.append(dict(common, codec=codec_id, backend=backend, bits=8 * len(enc.payload) / n,
                                     encode_ms=1e3 * encode_s, decode_ms=1e3 * decode_s))
                assert len(sections) == 1, f"{codec_id}: the backends wrote different sections"
    return rows


def value_rows(chunk: int, seed: int):
    """One dict per (gradient, codec): relative L2 error and bits per value."""
    from deepreduce.registry import create
    from deepreduce.sparsify.chunked import chunk_topk_positions
    from deepreduce.wire.seeding import EncodeContext
    from experiments import gradients

    rng = np.random.default_rng(seed)
    saved = sorted(gradients.load().items(), key=lambda kv: -kv[1].size)[:4]
    sets = {"ResNet-20 (4 largest layers)": np.concatenate([v.ravel() for _, v in saved]),
            "Laplace 1M": rng.laplace(size=1 << 20).astype(np.float32),
            "Gaussian 1M": rng.standard_normal(1 << 20).astype(np.float32)}
    codecs = ([("uniform", {"bits": b}) for b in (2, 3, 4, 8)] + [("binmean", {"bits": b}) for b in (2, 3, 4, 8)]
              + [("binmean", {"bits": 2, "iterations": 0}),
                 ("sketchml", {"buckets": 4, "sketch": False, "separate_signs": False}),
                 ("qsgd", {"levels": 1})])
    ctx = EncodeContext(bytes(32), "bench", 0)
    rows = []
    for name, flat in sets.items():
        v = flat[chunk_topk_positions(flat, chunk, 64)]
        for codec_id, params in codecs:
            codec = create("value", dict(id=codec_id, **params))
            enc = codec.encode(v, ctx)
            out = codec.reconstruct(enc, v.shape[0])
            rows.append(dict(gradient=name, codec=codec_id, params=params,
                             bits=8 * (len(enc.payload) + len(enc.params)) / v.shape[0],
                             error=float(np.linalg.norm(out - v) / np.linalg.norm(v))))
    return rows


def dct_rows():
    """One dict per (saved layer made of 64 x 64 blocks, k): energy kept without and with the DCT."""
    from deepreduce.sparsify.chunked import chunk_topk_positions, to_blocks
    from deepreduce.sparsify.dct import block_dct
    from experiments import gradients

    rows = []
    for name, grad in sorted(gradients.load().items()):
        matrix = grad.reshape(grad.shape[0], -1) if grad.ndim > 1 else None
        if name == "all" or matrix is None or matrix.shape[0] % 64 or matrix.shape[1] % 64:
            continue
        flat = to_blocks(matrix.astype(np.float32), 64)
        for k in (32, 64):
            kept = []
            for x in (flat, block_dct(flat, 64)):
                chosen = x[chunk_topk_positions(x, 4096, k)].astype(np.float64)
                kept.append(float(np.sum(chosen ** 2) / np.sum(x.astype(np.float64) ** 2)))
            rows.append(dict(layer=name, shape=matrix.shape, k=k, raw=kept[0], dct=kept[1]))
    return rows


def run(args) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    print(f"| elements | k of {args.chunk} | codec | backend | bits/index | limit | EF/chunk | Rice | encode CPU ms "
          "| decode CPU ms |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in index_rows(sizes, args.chunk, ks, args.repeat, args.seed):
        print(f"| {r['size']:,} | {r['k']} | {r['codec']} | {r['backend']} | {r['bits']:.3f} | {r['limit']:.3f} | "
              f"{r['elias_fano']:.3f} | {r['rice']:.3f} | {r['encode_ms']:.1f} | {r['decode_ms']:.1f} |")
    if args.values:
        print()
        print("| values of | codec | params | bits/value | relative L2 error |")
        print("|---|---|---|---:|---:|")
        for r in value_rows(args.chunk, args.seed):
            params = ", ".join(f"{k}={v}" for k, v in r["params"].items())
            print(f"| {r['gradient']} | {r['codec']} | {params} | {r['bits']:.3f} | {r['error']:.4f} |")
    if args.dct:
        print()
        print("| layer | matrix | k of 4096 | energy kept | after the block DCT |")
        print("|---|---|---:|---:|---:|")
        for r in dct_rows():
            print(f"| {r['layer']} | {r['shape'][0]}x{r['shape'][1]} | {r['k']} | {r['raw']:.3f} | {r['dct']:.3f} |")
    return 0
