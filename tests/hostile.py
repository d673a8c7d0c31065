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


def run_bounded(code: str, timeout: float = 120.0, memory: int = CHILD_MEMORY, env: dict = None) -> str:
    """Run ``code`` in a child Python limited to ``memory`` bytes of address space, with extra
    environment variables ``env``; its stdout (the test fails on a non-zero exit: an exception, a
    crash or an abort)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit, env=env, cwd=ROOT)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


BINDINGS = ("numpy", "torch-host", "torch-device", "tf-op")


def _decoder(binding: str):
    """decode(payload bytes, expected shape or None) of one binding, or None where it is absent."""
    import deepreduce

    pipe = deepreduce.build(RECEIVER)
    if binding == "numpy":
        return lambda data, shape: pipe.decode(np.frombuffer(data, dtype=np.uint8), expected_shape=shape)
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
