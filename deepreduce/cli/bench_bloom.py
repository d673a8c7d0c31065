"""``deepreduce bench-bloom``: Bloom index codec cost against the Top-r selection it follows.

For one synthetic gradient of ``--size`` entries (default 25,557,032, ResNet-50's size), in one
process on the same array, the median over ``--repeat`` runs of:

* Top-r selection (the ``topk`` sparsifier as the pipeline runs it) at ``--ratio``;
* Bloom P0 encode + decode of those r indices at ``--fpr`` (build, the sender's query of all d
  positions, the receiver's query), the codec as the pipeline runs it;
* one query of all d positions, in ns per position, for the blocked family (format v2) and, for
  comparison, the SplitMix64 family of format v1 on a filter of the same r and rate;
* P2's conflict-set selection (``select_conflict``) on ``--p2-positives`` positives at fpr 0.01
  (the size of the recommender gradient of ``reproduce fig11``).

each with 1 thread and with ``--threads`` (default: the CPUs this process may use, what the
pipeline's ``threads: auto`` gives one rank per host). Targets (issue 12): Bloom P0 encode+decode
at most the Top-r time with 1 thread and under half of it with the default threads; a query at
most 1 ns per position with 1 thread. Timings on a shared machine are noisy: run it quietly.

    python -m deepreduce bench-bloom
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

DEFAULT_SIZE = 25_557_032


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-bloom", help="Bloom P0 encode+decode and query cost vs Top-r selection")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="gradient length d")
    parser.add_argument("--ratio", type=float, default=0.01, help="Top-r ratio (r = ratio * d)")
    parser.add_argument("--fpr", type=float, default=0.001, help="Bloom false-positive rate")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="the multi-threaded runs' thread count (default: usable CPUs)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per row (median reported)")
    parser.add_argument("--p2-positives", type=int, default=250_000, help="positives of the P2 selection row")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def median_seconds(fn, repeat: int) -> float:
    fn()   # warm-up (caches, sizing tables, thread start-up paths)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args) -> int:
    from .. import _native, registry
    from ..index import bloom
    from ..seeding import EncodeContext, config_digest
    from .bench_sparsify import synthetic

    native = _native.load("bloom")
    if native is None:
        print("deepreduce._bloom is not built: build the C++ extensions first (make setup)")
        return 1
    d = args.size
    grad = synthetic(d, "laplace", args.seed)
    ctx = EncodeContext(config_digest({"bench": "bloom"}), "bench", 0)
    sparsifier = registry.create("sparsifier", {"id": "topk", "ratio": args.ratio})
    indices = sparsifier.select(grad, ctx)
    r = int(indices.size)
    blocks, k = bloom.filter_params(r, args.fpr)
    thread_counts = sorted({1, max(1, args.threads)})
    print(f"d = {d:,}, r = {r:,} (ratio {args.ratio}), fpr {args.fpr}: {blocks:,} blocks of 512 bits, k = {k}; "
          f"median of {args.repeat} runs; threads {thread_counts}")
    header = f"{'row':<44} {'threads':>7} {'ms':>9} {'ns/pos':>7} {'/ Top-r':>8}"
    print(header)
    print("-" * len(header))

    def row(label, threads, seconds, base=None, per=None):
        ns = f"{1e9 * seconds / per:>7.2f}" if per else f"{'':>7}"
        ratio = f"{seconds / base:>8.2f}" if base else f"{'':>8}"
        print(f"{label:<44} {threads:>7} {1e3 * seconds:>9.1f} {ns} {ratio}", flush=True)

    codec = bloom.BloomIndex(policy="p0", fpr=args.fpr)
    receiver = bloom.BloomIndex()
    payload = native.build(indices.astype(np.uint64), blocks, k, 0, 1)
    m1 = max(1, int(np.ceil(np.log2(1 / args.fpr) * r / np.log(2))))
    k1 = max(1, int(np.ceil(np.log2(1 / args.fpr))))
    rng = np.random.default_rng(args.seed)
    v1_bits = rng.random(m1) < 0.5   # a v1 filter filled as its sizing fills it (half the bits set)
    v1_payload = np.packbits(v1_bits, bitorder="little").tobytes()
    p2_d = args.p2_positives * 40
    p2_P = np.sort(rng.choice(p2_d, args.p2_positives, replace=False)).astype(np.uint64)
    p2_blocks, p2_k = bloom.filter_params(args.p2_positives, 0.01)
    for threads in thread_counts:
        if hasattr(sparsifier, "threads"):
            sparsifier.threads = threads
        codec.threads = receiver.threads = threads
        topr = median_seconds(lambda: sparsifier.select(grad, ctx), args.repeat)
        row("Top-r selection", threads, topr)

        def p0_round_trip():
            enc = codec.encode(indices, grad[indices], grad, ctx)
            receiver.decode(enc.params, enc.payload, len(enc.indices), d)

        row("Bloom P0 encode+decode", threads, median_seconds(p0_round_trip, args.repeat), base=topr)
        row("  query of d positions, blocked (v2)", threads,
            median_seconds(lambda: native.query(payload, blocks, k, 0, d, d, threads), args.repeat), per=d)
        row("  query of d positions, SplitMix64 (v1)", threads,
            median_seconds(lambda: native.query(v1_payload, m1, k1, 0, d, d, threads, "splitmix"), args.repeat),
            per=d)
        row("  build of r indices", threads,
            median_seconds(lambda: native.build(indices.astype(np.uint64), blocks, k, 0, threads), args.repeat))
        row(f"P2 select_conflict, {args.p2_positives:,} positives", threads,
            median_seconds(lambda: native.select_conflict(p2_P, args.p2_positives - args.p2_positives // 100,
                                                          p2_blocks, p2_k, 0, 1), args.repeat))
    return 0
