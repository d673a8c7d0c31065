"""Helpers of the hostile-input tests: valid containers per config, CRC-valid rewrites of them,
hand-made hostile Bloom containers, and a child process that decodes under a memory cap.

A rewrite changes parsed fields (header numbers, params, sections) and packs again, so the CRC is
recomputed and every check behind it runs; :func:`pack_v1` writes the legacy layout for the
same purpose on format-1 containers. :func:`run_bounded` runs code in a child Python under an
address-space limit and a timeout, so that a regression fails a test instead of the machine, and
:func:`decode_everywhere` (run in such a child) decodes one container through every binding.
"""
import dataclasses
import glob
import os
import resource
import signal
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np

import deepreduce
from deepreduce.wire import container

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
GOLDEN_V1 = sorted(glob.glob(os.path.join(ROOT, "tests", "golden", "v1", "*.npz")))
NUMEL = 3000
CHILD_MEMORY = 3 << 30   # bytes of address space a hostile case may use
RECEIVER = os.path.join(ROOT, "configs", "topk_raw.yaml")   # decodes any codec (the wire ids choose)


def config_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def gradient(numel: int = NUMEL, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(numel) * rng.exponential(1.0, numel)).astype(np.float32)


def valid_container(path: str, numel: int = NUMEL):
    """(pipeline, one sparse container of a ``numel`` gradient) for a config file."""
    pipe = deepreduce.build(path)
    pipe.min_numel = min(pipe.min_numel, numel)
    return pipe, pipe.encode(gradient(numel), name="layer.weight", step=3)


def rewrite(payload, **fields) -> np.ndarray:
    """The container with some parsed fields replaced, packed again (v2, CRC recomputed)."""
    c = container.unpack(payload, max_numel=1 << 128)
    return container.pack(dataclasses.replace(c, **fields))


_V1 = struct.Struct("<4sBBBBBBHHHQQQQ")


def pack_v1(c: container.Container) -> bytes:
    """A format-1 container of ``c`` (fixed u16/u64 fields, no digest), CRC included."""
    body = _V1.pack(b"DPRD", 1, c.flags, c.index_id, c.value_id, len(c.shape), c.perm_width,
                    len(c.index_params), len(c.value_params), 0, c.n, len(c.index_section),
                    len(c.value_section), len(c.perm_section))
    body += struct.pack(f"<{len(c.shape)}Q", *c.shape)
    body += c.index_params + c.value_params + c.index_section + c.value_section + c.perm_section
    return body + struct.pack("<I", zlib.crc32(body))


def bloom_container(policy: str, k: int, blocks: int, n: int, numel: int, fill: int = 0xFF) -> bytes:
    """A CRC-valid container of shape ``(numel,)`` whose blocked Bloom filter of ``blocks`` blocks
    has every byte ``fill`` (0xFF: every position a positive) and claims ``n`` raw values."""
    from deepreduce.index import bloom

    _, payload = valid_container(os.path.join(ROOT, "configs", "bf_p2.yaml"))
    draw_seed = 5 if policy in bloom.DRAWING else 0
    return rewrite(payload, shape=(numel,), n=n, index_params=bloom.pack_params(policy, k, blocks, 0, draw_seed),
                   index_section=bytes([fill]) * (64 * blocks), value_section=bytes(4 * n)).tobytes()


def splitmix_container(policy: str, k: int, m: int, n: int, numel: int, fill: int = 0xFF) -> bytes:
    """A CRC-valid container of shape ``(numel,)`` whose SplitMix64 (format v1) Bloom filter of
    ``m`` bits has every byte ``fill`` (bits beyond ``m`` clear) and claims ``n`` raw values."""
    from deepreduce.index import bloom

    _, payload = valid_container(os.path.join(ROOT, "configs", "bf_p2.yaml"))
    params = struct.pack("<BBQQQ", bloom.POLICIES.index(policy), k, m, 0, 5)
    section = bytearray([fill]) * ((m + 7) // 8)
    if m % 8:
        section[-1] &= (1 << (m % 8)) - 1
    return rewrite(payload, shape=(numel,), n=n, index_params=params, index_section=bytes(section),
                   value_section=bytes(4 * n)).tobytes()


def run_bounded(code: str, timeout: float = 120.0, memory: int = CHILD_MEMORY, env: dict = None,
                check: bool = True) -> str:
    """Run ``code`` in a child Python limited to ``memory`` bytes of address space, with extra
    environment variables ``env``; its stdout (the test fails on a non-zero exit: an exception, a
    crash or an abort). ``check=False``: the stdout and, after a non-zero exit, how the child ended
    (its exit status or signal and the end of its stderr) instead."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit, env=env, cwd=ROOT)
    if check:
        assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    elif done.returncode:
        died = f"signal {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exit {done.returncode}"
        return done.stdout + f"child ended with {died}: {done.stderr[-300:]!r}"
    return done.stdout


BINDINGS = ("numpy", "torch-host", "torch-device", "tf-op")
#: BINDINGS and the C++ pipeline's own binding (deepreduce._pipeline, what the sparse all-reduce calls)
ALL_BINDINGS = ("numpy", "torch-host", "torch-device", "cpp-pipeline", "tf-op")


def _decoder(binding: str):
    """decode(payload bytes, expected shape or None) of one binding, or None where it is absent."""
    import deepreduce
    from deepreduce.errors import ContainerError

    pipe = deepreduce.build(RECEIVER)
    if binding == "numpy":
        return lambda data, shape: pipe.decode(np.frombuffer(data, dtype=np.uint8), expected_shape=shape)
    if binding == "cpp-pipeline":
        from deepreduce.backend import native_pipeline

        native = native_pipeline.module()
        if native is None:
            return None

        def decode(data, shape):
            try:
                return native.decode_sum(np.frombuffer(data, dtype=np.uint8), single=True, shape=shape,
                                         max_numel=pipe.max_numel)
            except ValueError as exc:   # ErrorKind::CONTAINER, as native_pipeline.decode_sum raises it
                raise ContainerError(str(exc)) from exc
        return decode
    if binding.startswith("torch"):
        try:
            import torch

            from deepreduce.torch.pipeline import TorchPipeline
        except ImportError:
            return None
        tp = TorchPipeline(pipe, path=binding.split("-")[1])
        return lambda data, shape: tp.decode(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                                             expected_shape=shape, device="cpu")
    try:
        import tensorflow as tf

        from deepreduce.tensorflow import ops
        op = ops.PipelineOps(pipe, ops.load())
    except Exception:   # no TensorFlow, or the ops are not built
        return None
    return lambda data, shape: op.decode(tf.constant(np.frombuffer(data, dtype=np.uint8)), shape, None, True)


def decode_everywhere(path: str, shapes, bindings=BINDINGS) -> None:
    """Decode the container in file ``path`` through every available binding of ``bindings``, with
    each expected shape of ``shapes`` (None: without one); print ``binding shape: outcome`` per
    decode, the outcome being the decoded shape or the deepreduce error's class and message. Any
    other exception propagates (the child exits non-zero)."""
    from deepreduce.errors import DeepReduceError

    with open(path, "rb") as handle:
        data = handle.read()
    for binding in bindings:
        decode = _decoder(binding)
        if decode is None:
            print(f"{binding}: absent")
            continue
        for shape in shapes:
            try:
                outcome = f"decoded {tuple(decode(data, shape).shape)}"
            except DeepReduceError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            print(f"{binding} {shape}: {outcome}", flush=True)


def zero_element_container(shape) -> bytes:
    """A CRC-valid container of a 0-element tensor of ``shape`` (some dimensions may be huge)."""
    _, payload = valid_container(RECEIVER)
    return rewrite(payload, shape=tuple(shape), n=0, index_section=b"", value_section=b"").tobytes()


def _status(*fields: str) -> dict:
    """Fields of /proc/self/status in bytes (VmRSS: resident now, VmHWM: its peak, VmSize: mapped)."""
    with open("/proc/self/status") as handle:
        found = dict(line.split(":", 1) for line in handle)
    return {name: int(found[name].split()[0]) << 10 for name in fields}


def decode_bounded(cases) -> None:
    """In this (capped child) process: decode each ``(path, binding, shape, headroom)`` of ``cases``
    and print one JSON line per decode: binding, shape, outcome (the decoded shape or the
    deepreduce error), its ``seconds`` and ``extra``, the peak resident bytes the decode added (VmHWM, reset before
    it, minus VmRSS then). ``headroom`` (bytes or None): the decode may map only this much more
    than the process has mapped before it (RLIMIT_AS lowered for it, never above the cap), to make
    it run out of memory. Any other exception propagates (the child exits non-zero). Each binding
    is imported at its first case, and TensorFlow maps about 2 GB when it is: put its cases last."""
    import json
    import time

    from deepreduce.errors import DeepReduceError

    decoders = {}
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    for path, binding, shape, headroom in cases:
        if binding not in decoders:
            decoders[binding] = _decoder(binding)
        if decoders[binding] is None:
            print(json.dumps({"path": path, "binding": binding, "shape": shape, "outcome": "absent"}), flush=True)
            continue
        with open(path, "rb") as handle:
            data = handle.read()
        with open("/proc/self/clear_refs", "w") as handle:   # VmHWM := VmRSS
            handle.write("5")
        base = _status("VmRSS", "VmSize")
        if headroom is not None:
            resource.setrlimit(resource.RLIMIT_AS, (min(base["VmSize"] + headroom, hard), hard))
        start = time.perf_counter()
        try:
            outcome = f"decoded {tuple(decoders[binding](data, shape).shape)}"
        except DeepReduceError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        seconds = time.perf_counter() - start
        extra = _status("VmHWM")["VmHWM"] - base["VmRSS"]
        print(json.dumps({"path": path, "binding": binding, "shape": shape, "outcome": outcome, "extra": extra,
                          "seconds": round(seconds, 3)}), flush=True)


def measure(path: str, binding: str, shape) -> None:
    """In this (capped child) process: decode the container in file ``path`` once through
    ``binding`` with expected shape ``shape`` and print one JSON line: the outcome, the decode's
    wall time, the process's peak RSS before and after it (``ru_maxrss``) and its CPU time."""
    import json
    import time

    from deepreduce.errors import DeepReduceError

    with open(path, "rb") as handle:
        data = handle.read()
    decode = _decoder(binding)
    if decode is None:
        print(json.dumps({"binding": binding, "outcome": "absent"}))
        return
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        outcome = f"decoded {tuple(decode(data, shape).shape)}"
    except DeepReduceError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"binding": binding, "shape": shape, "outcome": outcome, "wall_s": round(wall, 2),
                      "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "rss_before_mb": before >> 10,
                      "peak_rss_mb": usage.ru_maxrss >> 10}), flush=True)


def main(argv=None) -> None:
    """``python tests/hostile.py --family splitmix --policy p1 --k 7 --size 8 --n 10 --numel 268435456
    [--expected] [--bindings numpy,tf-op] [--memory-gib 3] [--backend numpy]``: one hand-made Bloom
    container decoded through each binding, each in a fresh child under the memory cap; prints the
    figures of :func:`measure` per binding, or how the child died (docs/reliability.md, Round 3)."""
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--family", choices=("blocked", "splitmix"), default="blocked")
    parser.add_argument("--policy", default="p2")
    parser.add_argument("--k", type=int, required=True)
    parser.add_argument("--size", type=int, required=True, help="blocks (blocked) or m (splitmix)")
    parser.add_argument("--n", type=int, required=True, help="the header's value count")
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--expected", action="store_true", help="decode with the expected shape (numel,)")
    parser.add_argument("--bindings", default=",".join(ALL_BINDINGS))
    parser.add_argument("--memory-gib", type=float, default=CHILD_MEMORY / 2**30)
    parser.add_argument("--backend", default="", help="DEEPREDUCE_BACKEND for the child (numpy: no C++ kernels)")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    make = bloom_container if args.family == "blocked" else splitmix_container
    data = make(args.policy, args.k, args.size, args.n, args.numel)
    shape = (args.numel,) if args.expected else None
    memory = int(args.memory_gib * 2**30)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "container.bin")
        with open(path, "wb") as handle:
            handle.write(data)
        for binding in args.bindings.split(","):
            env = {"DEEPREDUCE_BACKEND": args.backend} if args.backend else {}
            try:
                out = run_bounded(f"import hostile; hostile.measure({path!r}, {binding!r}, {shape!r})",
                                  timeout=args.timeout, memory=memory, env=env, check=False)
            except subprocess.TimeoutExpired:
                out = json.dumps({"binding": binding, "outcome": f"timed out after {args.timeout} s"})
            print(f"{len(data)} bytes, {args.family} {args.policy} k={args.k} size={args.size} n={args.n} "
                  f"numel={args.numel} expected={args.expected}: {out.strip()}", flush=True)


if __name__ == "__main__":
    main()
