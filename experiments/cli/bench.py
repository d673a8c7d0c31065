"""``deepreduce bench``: one row per (config, tensor size): volume, speed, error, backend.

Each config runs as shipped (its error-feedback memory included) through the code the PyTorch
optimizer runs: ``deepreduce.torch.TorchPipeline`` (CPU tensors go to the core's C++ kernels
without a copy) when torch is installed, else the core ``Pipeline``; the first line of the
output names the path. Columns: relative volume of the index and value sections (bytes over
dense float32 bytes) and of the whole container, encode milliseconds as shipped, encode
milliseconds with the memory switched off and their ratio (the cost of error feedback), decode
milliseconds (medians of ``--repeat`` steps, single process), the relative L2 error of the
first step's reconstruction against the sparsifier's output (what the codecs were asked to
carry), and the backend each codec ran on ("c++" or "numpy").
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
    parser.add_argument("--threads", default=None,
                        help="override the configs' 'threads' option (a positive integer or 'auto')")
    parser.add_argument("--core", action="store_true",
                        help="time the core Pipeline even when torch is installed")
    parser.add_argument("--selection", action="store_true",
                        help="only time Top-r selection at each size (--ratio, default 0.01): C++ on 1 and "
                             "'auto' threads, NumPy, torch.topk, and the pipeline's fused compensation pass")
    parser.add_argument("--decode-sum", type=int, default=0, metavar="RANKS",
                        help="add a column: decode_sum of RANKS containers (one per simulated rank) into one buffer")
    parser.add_argument("--gradient", default=None, metavar="NAME",
                        help="use the saved real gradient NAME (experiments/data/gradients.npz, e.g. "
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


def with_threads(config: dict, threads) -> dict:
    """The config with its ``threads`` option replaced (``--threads``), when given."""
    if threads is None:
        return config
    return dict(config, threads=threads if threads == "auto" else int(threads))


def build_as_trained(config: dict, core_only: bool = False):
    """(pipeline, path name): the torch binding the optimizer uses when torch is installed."""
    from deepreduce.config import build

    if not core_only:
        try:
            from deepreduce.torch import build as build_torch
        except ImportError:
            pass
        else:
            return build_torch(config), "deepreduce.torch.TorchPipeline (the optimizer's encode/decode)"
    return build(config), "deepreduce.Pipeline (core" + ("" if core_only else "; torch is not installed") + ")"


def _encode_input(pipe, grad: np.ndarray):
    """The gradient as the pipeline takes it: a CPU torch tensor sharing memory for TorchPipeline."""
    if hasattr(pipe, "core"):
        import torch

        return torch.from_numpy(grad)
    return grad


def steps_after_warmup(pipe, repeat: int) -> range:
    """``repeat`` successive steps from the first after the config's dense ``warmup``: a benchmark
    measures the codec, not the warm-up's dense containers. ``pipe``: a core or binding pipeline."""
    first = getattr(pipe, "core", pipe).warmup
    return range(first, first + repeat)


def encode_ms(pipe, grad: np.ndarray, name: str, repeat: int):
    """Median encode (wall, process CPU) milliseconds over ``repeat`` successive steps."""
    tensor = _encode_input(pipe, grad)
    wall, cpu = [], []
    for step in steps_after_warmup(pipe, repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        pipe.encode(tensor, name=name, step=step)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def measure(pipe, grad: np.ndarray, name: str, repeat: int) -> dict:
    """Encode and decode ``grad`` at ``repeat`` successive steps; return the row's figures.

    ``pipe`` is a core Pipeline or a TorchPipeline. Volume and error come from the first step
    (after any dense warm-up; an error-feedback memory is still empty there, so every config sees
    the same input).
    """
    from deepreduce.config import build
    from deepreduce.wire.container import unpack

    core = getattr(pipe, "core", pipe)
    tensor = _encode_input(pipe, grad)
    encode_s, encode_cpu, decode_s, first = [], [], [], None
    for step in steps_after_warmup(pipe, repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        payload = pipe.encode(tensor, name=name, step=step)
        t1, c1 = time.perf_counter(), time.process_time()
        decoded = pipe.decode(payload)
        t2 = time.perf_counter()
        encode_s.append(t1 - t0)
        encode_cpu.append(c1 - c0)
        decode_s.append(t2 - t1)
        if first is None:
            first = (np.asarray(payload), np.asarray(decoded))
    payload, decoded = first
    flat = grad.ravel()
    target = np.zeros_like(flat)
    indices = build(core.get_config()).sparsifier.select(flat, core.context(name, 0))  # fresh state: step 0
    target[indices] = flat[indices]
    c = unpack(payload)
    dense_bytes = 4 * grad.size
    norm = float(np.linalg.norm(target)) or 1.0
    return {
        "idx_vol": len(c.index_section) / dense_bytes,
        "val_vol": (len(c.value_section) + len(c.perm_section)) / dense_bytes,
        "total_vol": payload.size / dense_bytes,
        "encode_ms": 1e3 * statistics.median(encode_s),
        "encode_cpu_ms": 1e3 * statistics.median(encode_cpu),
        "decode_ms": 1e3 * statistics.median(decode_s),
        "rel_err": float(np.linalg.norm(decoded.ravel() - target)) / norm,
        "backend": f"{core.index.backend}/{core.value.backend}",
    }


def print_table(rows) -> None:
    header = f"{'config':<28} {'size':>10} {'idx_vol':>8} {'val_vol':>8} {'total':>8} " \
             f"{'enc_ms':>9} {'nomem_ms':>9} {'mem_x':>6} {'dec_ms':>9} {'rel_err':>9}  backend(idx/val)"
    print(header)
    print("-" * len(header))
    for r in rows:
        extra = f"  mem_x(cpu) {r['encode_cpu_ms'] / max(r['nomem_cpu_ms'], 1e-9):.2f}"
        extra += f"  decode_sum {r['decode_sum_ms']:.3f} ms" if "decode_sum_ms" in r else ""
        print(f"{r['config']:<28} {r['size']:>10} {r['idx_vol']:>8.4f} {r['val_vol']:>8.4f} {r['total_vol']:>8.4f} "
              f"{r['encode_ms']:>9.3f} {r['nomem_ms']:>9.3f} {r['encode_ms'] / max(r['nomem_ms'], 1e-9):>6.2f} "
              f"{r['decode_ms']:>9.3f} {r['rel_err']:>9.2e}  {r['backend']}{extra}", flush=True)


def run(args) -> int:
    from deepreduce.config import load_config

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
    if getattr(args, "selection", False):
        from ._bench_kernels import print_selection, selection_rows

        grads = [real if real is not None else synthetic_gradient(int(label), args.seed) for label, real in inputs]
        print_selection(selection_rows([g.ravel() for g in grads], args.ratio or 0.01, args.repeat))
        return 0
    rows, path_name = [], ""
    for path in paths:
        config = with_threads(with_ratio(load_config(path), args.ratio), getattr(args, "threads", None))
        for label, real in inputs:
            grad = real if real is not None else synthetic_gradient(int(label), args.seed)
            pipe, path_name = build_as_trained(config, getattr(args, "core", False))
            row = measure(pipe, grad, "bench", args.repeat)
            if pipe.get_config()["memory"]["id"] != "none":
                bare, _ = build_as_trained(dict(config, memory={"id": "none"}), getattr(args, "core", False))
                row["nomem_ms"], row["nomem_cpu_ms"] = encode_ms(bare, grad, "bench", args.repeat)
            else:
                row["nomem_ms"], row["nomem_cpu_ms"] = row["encode_ms"], row["encode_cpu_ms"]
            if getattr(args, "decode_sum", 0):
                from ._bench_kernels import decode_sum_ms

                others = [grad.ravel()] + [synthetic_gradient(grad.size, args.seed + k).reshape(grad.shape).ravel()
                                           for k in range(1, args.decode_sum)]
                row["decode_sum_ms"] = decode_sum_ms(pipe, others, args.repeat)
            rows.append(dict(row, config=os.path.splitext(os.path.basename(path))[0], size=grad.size))
    print(f"path: {path_name}; configs as shipped (error-feedback memory included); "
          "nomem_ms: the same config with memory 'none'; mem_x = enc_ms / nomem_ms (wall), mem_x(cpu): "
          "the same ratio of process CPU times (steadier on a shared machine)")
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
    from deepreduce.sparsify import count_for

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
    from deepreduce.config import build, load_config

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
                from ._bench_kernels import numpy_backend
                with numpy_backend():
                    slow = measure_index(pipe, grad, 1)
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
