"""``deepreduce bench``: one row per (config, tensor size): volume, speed, error, backend.

Columns: relative volume of the index and value sections (bytes over dense float32 bytes),
of the whole container, encode and decode milliseconds (median of ``--repeat`` runs, single
process), the relative L2 error of the reconstruction against the sparsifier's output (what the
codecs were asked to carry), and the backend each codec ran on ("c++" or "numpy").
"""
from __future__ import annotations

import glob
import os
import statistics
import time

import numpy as np

DEFAULT_SIZES = "36864,1048576"


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark configs: volume, encode/decode time, error")
    parser.add_argument("configs", nargs="*", help="config files (default: every configs/*.yaml)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated tensor sizes (synthetic gradients)")
    parser.add_argument("--ratio", type=float, default=None,
                        help="override the sparsifier's ratio (configs whose sparsifier has one)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic gradients")
    parser.add_argument("--gradient", default=None, metavar="NAME",
                        help="use the saved real gradient NAME (deepreduce/data/gradients.npz, e.g. "
                             "layers.7.conv1.weight) instead of synthetic sizes; 'list' prints the names")
    parser.add_argument("--index-timing", action="store_true",
                        help="also time the index codec alone (encode + decode of the sparsifier's output) "
                             "and print its bits per index")
    parser.add_argument("--compare-numpy", action="store_true",
                        help="with --index-timing: rerun each index codec with DEEPREDUCE_BACKEND=numpy "
                             "(one repetition) and print the C++ speed-up")
    parser.add_argument("--topk-reference", action="store_true",
                        help="with --index-timing: add a 'topk-select' row timing NumPy's Top-r selection "
                             "(argpartition of |g|) at each size, the reference for the Bloom P0 target")
    parser.set_defaults(func=run)


def synthetic_gradient(size: int, seed: int) -> np.ndarray:
    """A heavy-tailed synthetic gradient (Laplace), the shape real gradients tend to have."""
    return np.random.default_rng(seed).laplace(scale=1e-3, size=size).astype(np.float32)


def with_ratio(config: dict, ratio) -> dict:
    """The config with its sparsifier's ratio replaced, when it has one."""
    if ratio is not None and "ratio" in config["sparsifier"]:
        config = dict(config, sparsifier=dict(config["sparsifier"], ratio=ratio))
    return config


def measure(pipe, grad: np.ndarray, name: str, repeat: int) -> dict:
    """Encode and decode ``grad`` ``repeat`` times; return the row's figures."""
    from ..container import unpack

    encode_s, decode_s = [], []
    for step in range(repeat):
        t0 = time.perf_counter()
        payload = pipe.encode(grad, name=name, step=step)
        t1 = time.perf_counter()
        decoded = pipe.decode(payload)
        t2 = time.perf_counter()
        encode_s.append(t1 - t0)
        decode_s.append(t2 - t1)
    target = np.zeros_like(grad.ravel())
    indices = pipe.sparsifier.select(grad.ravel(), pipe.context(name, repeat - 1))
    target[indices] = grad.ravel()[indices]
    c = unpack(payload)
    dense_bytes = 4 * grad.size
    norm = float(np.linalg.norm(target)) or 1.0
    return {
        "idx_vol": len(c.index_section) / dense_bytes,
        "val_vol": (len(c.value_section) + len(c.perm_section)) / dense_bytes,
        "total_vol": payload.size / dense_bytes,
        "encode_ms": 1e3 * statistics.median(encode_s),
        "decode_ms": 1e3 * statistics.median(decode_s),
        "rel_err": float(np.linalg.norm(decoded.ravel() - target)) / norm,
        "backend": f"{pipe.index.backend}/{pipe.value.backend}",
    }


def print_table(rows) -> None:
    header = f"{'config':<28} {'size':>10} {'idx_vol':>8} {'val_vol':>8} {'total':>8} " \
             f"{'enc_ms':>9} {'dec_ms':>9} {'rel_err':>9}  backend(idx/val)"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['config']:<28} {r['size']:>10} {r['idx_vol']:>8.4f} {r['val_vol']:>8.4f} {r['total_vol']:>8.4f} "
              f"{r['encode_ms']:>9.3f} {r['decode_ms']:>9.3f} {r['rel_err']:>9.2e}  {r['backend']}", flush=True)


def run(args) -> int:
    from ..config import build, load_config

    paths = args.configs or sorted(glob.glob(os.path.join("configs", "*.yaml")))
    if getattr(args, "gradient", None):
        from ..gradients import get, load

        if args.gradient == "list":
            for name, grad in sorted(load().items()):
                print(f"{name:<28} {grad.size:>8}  {tuple(grad.shape)}")
            return 0
        inputs = [(args.gradient, get(args.gradient))]
    else:
        inputs = [(str(int(s)), None) for s in args.sizes.split(",") if s]
    rows = []
    for path in paths:
        config = with_ratio(load_config(path), args.ratio)
        for label, real in inputs:
            # No error feedback: each repetition must see the same input.
            pipe = build(dict(config, min_numel=0, memory={"id": "none"}))
            grad = real if real is not None else synthetic_gradient(int(label), args.seed)
            row = measure(pipe, grad, "bench", args.repeat)
            rows.append(dict(row, config=os.path.splitext(os.path.basename(path))[0], size=grad.size))
    if getattr(args, "gradient", None):
        print(f"input: saved real gradient {args.gradient!r} ({inputs[0][1].size} elements)")
    print_table(rows)
    if getattr(args, "index_timing", False):
        print()
        print_index_table(index_rows(paths, inputs, args))
    return 0


def measure_index(pipe, grad: np.ndarray, repeat: int) -> dict:
    """Time the index codec alone on the sparsifier's output (median of ``repeat`` runs)."""
    flat = np.ascontiguousarray(grad, dtype=np.float32).ravel()
    ctx = pipe.context("bench", 0)
    indices = pipe.sparsifier.select(flat, ctx)
    values = flat[indices]
    encode_s, decode_s = [], []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        enc = pipe.index.encode(indices, values, flat, ctx)
        t1 = time.perf_counter()
        pipe.index.decode(enc.params, enc.payload, len(enc.indices), flat.size)
        t2 = time.perf_counter()
        encode_s.append(t1 - t0)
        decode_s.append(t2 - t1)
    return {"idx_enc_ms": 1e3 * statistics.median(encode_s), "idx_dec_ms": 1e3 * statistics.median(decode_s),
            "bits_per_index": 8 * len(enc.payload) / max(1, len(indices)), "r": len(indices),
            "backend": pipe.index.backend}


def topk_select_ms(grad: np.ndarray, ratio: float, repeat: int) -> float:
    """NumPy's Top-r selection (argpartition of |g|), median milliseconds."""
    from ..sparsify import count_for

    flat = grad.ravel()
    r = count_for(ratio, flat.size)
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        np.argpartition(np.abs(flat), flat.size - r)[flat.size - r:]
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def index_rows(paths, inputs, args) -> list:
    """Rows of the index-codec table (``--index-timing``), with NumPy reruns and Top-r reference."""
    from ..config import build, load_config

    rows = []
    for label, real in inputs:
        grad = real if real is not None else synthetic_gradient(int(label), args.seed)
        if getattr(args, "topk_reference", False):
            ms = topk_select_ms(grad, args.ratio if args.ratio is not None else 0.01, args.repeat)
            rows.append({"config": "topk-select", "size": grad.size, "idx_enc_ms": ms, "idx_dec_ms": 0.0,
                         "bits_per_index": float("nan"), "backend": "numpy", "speedup": ""})
        for path in paths:
            config = with_ratio(load_config(path), args.ratio)
            pipe = build(dict(config, min_numel=0, memory={"id": "none"}))
            row = measure_index(pipe, grad, args.repeat)
            row.update(config=os.path.splitext(os.path.basename(path))[0], size=grad.size, speedup="")
            if getattr(args, "compare_numpy", False) and row["backend"] == "c++":
                previous = os.environ.get("DEEPREDUCE_BACKEND")
                os.environ["DEEPREDUCE_BACKEND"] = "numpy"
                try:
                    slow = measure_index(pipe, grad, 1)
                finally:
                    if previous is None:
                        del os.environ["DEEPREDUCE_BACKEND"]
                    else:
                        os.environ["DEEPREDUCE_BACKEND"] = previous
                fast_ms = row["idx_enc_ms"] + row["idx_dec_ms"]
                slow_ms = slow["idx_enc_ms"] + slow["idx_dec_ms"]
                row["speedup"] = f"numpy {slow_ms:.1f} ms = {slow_ms / max(fast_ms, 1e-9):.1f}x"
            rows.append(row)
    return rows


def print_index_table(rows) -> None:
    header = f"{'index codec alone':<28} {'size':>10} {'enc_ms':>9} {'dec_ms':>9} {'enc+dec':>9} " \
             f"{'bits/idx':>9}  backend  vs numpy"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['config']:<28} {r['size']:>10} {r['idx_enc_ms']:>9.3f} {r['idx_dec_ms']:>9.3f} "
              f"{r['idx_enc_ms'] + r['idx_dec_ms']:>9.3f} {r['bits_per_index']:>9.3f}  {r['backend']:<7}  "
              f"{r['speedup']}", flush=True)
