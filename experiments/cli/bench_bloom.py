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

each with 1 thread and with ``--threads`` (default: what the pipeline's ``threads: auto`` resolves
to, ``deepreduce.backend.parallel.resolve_threads``: usable CPUs over local ranks). ``ms`` is wall time; ``cpu_ms`` is the
process's CPU time over the same runs (all threads together), which a loaded machine inflates
less than wall time for the single-thread rows. Targets (issue 12): Bloom P0 encode+decode
at most the Top-r time with 1 thread and under half of it with the default threads (column
``/ Top-r``, wall time against the Top-r row of the same thread count); a query at most 1 ns per
position with 1 thread. Timings on a shared machine are noisy: run it quietly.

    python -m deepreduce bench-bloom
"""
from __future__ import annotations

import statistics
import time

import numpy as np

DEFAULT_SIZE = 25_557_032


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-bloom", help="Bloom P0 encode+decode and query cost vs Top-r selection")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="gradient length d")
    parser.add_argument("--ratio", type=float, default=0.01, help="Top-r ratio (r = ratio * d)")
    parser.add_argument("--fpr", type=float, default=0.001, help="Bloom false-positive rate")
    parser.add_argument("--threads", type=int, default=None,
                        help="the multi-threaded runs' thread count (default: the pipeline's threads: auto)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per row (median reported)")
    parser.add_argument("--p2-positives", type=int, default=250_000, help="positives of the P2 selection row")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def median_seconds(fn, repeat: int):
    """(median wall seconds, median process CPU seconds) over ``repeat`` runs after a warm-up."""
    fn()   # warm-up (caches, sizing tables, thread start-up paths)
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def run(args) -> int:
    from deepreduce import registry
    from deepreduce.backend import _native, parallel
    from deepreduce.index import bloom
    from deepreduce.wire.seeding import EncodeContext, config_digest

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
    default = parallel.resolve_threads(parallel.AUTO) if args.threads is None else args.threads
    thread_counts = sorted({1, max(1, default)})
    print(f"d = {d:,}, r = {r:,} (ratio {args.ratio}), fpr {args.fpr}: {blocks:,} blocks of 512 bits, k = {k}; "
          f"median of {args.repeat} runs; threads {thread_counts}")
    header = f"{'row':<44} {'threads':>7} {'ms':>9} {'cpu_ms':>9} {'ns/pos':>7} {'cpu_ns':>7} {'/ Top-r':>8}"
    print(header)
    print("-" * len(header))

    def row(label, threads, times, base=None, per=None):
        (wall, cpu), blank = times, f"{'':>7}"
        ns = f"{1e9 * wall / per:>7.2f} {1e9 * cpu / per:>7.2f}" if per else f"{blank} {blank}"
        ratio = f"{wall / base[0]:>8.2f}" if base else f"{'':>8}"
        print(f"{label:<44} {threads:>7} {1e3 * wall:>9.1f} {1e3 * cpu:>9.1f} {ns} {ratio}", flush=True)
        return times

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
        topr = row("Top-r selection", threads, median_seconds(lambda: sparsifier.select(grad, ctx), args.repeat))

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
