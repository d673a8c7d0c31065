"""Coverage-guided fuzzing of every decoder with atheris (``make fuzz``, docs/reliability.md).

Each input is taken as a container whose last four bytes are replaced by the right CRC-32, so
the fuzzer explores what lies behind the checksum: the header fields, every index and value
codec (chosen by the container's wire ids, so one receiver reaches every decoder), their C++
kernels (built with AddressSanitizer and UBSan by ``make fuzz``) and the v1 and v2 layouts.
Per input it calls ``inspect``, ``split``, ``decode`` without and with the expected shape and
``decode_sum``, and with ``FUZZ_TF=1`` the TensorFlow decode op (``DeepReduceDecode``, without
and with the expected shape) when TensorFlow and the ops load; anything but a DeepReduceError,
and a NaN/Inf decoded from a container without the non-finite flag, is a finding (atheris stops
and writes the input to the artifact prefix).

    python tests/fuzz/fuzz_decoders.py -keep_seed=1 -max_total_time=60 build/fuzz/corpus tests/fuzz_corpus
    FUZZ_TF=1 python tests/fuzz/fuzz_decoders.py ...   # the TF op too
    python tests/fuzz/fuzz_decoders.py --write-corpus tests/fuzz_corpus   # the seed set

``-keep_seed=1`` keeps every seed in the corpus: the hostile Bloom seeds (:func:`hostile_bloom_seeds`)
reach the same Python lines as the valid Bloom containers, so libFuzzer would otherwise drop them
after the first run and mutate only the others.
"""
import glob
import os
import sys
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LIMIT = 1 << 20     # the receiver's max_numel while fuzzing
EXPECTED = (600,)


def hostile_bloom_seeds() -> dict:
    """{name: container} of the hostile Bloom filters of issues 26 and 34, at shapes the fuzzed
    receiver accepts (at most LIMIT elements, or EXPECTED), so that the fuzzer starts from them:
    filters fuller than their k (refused by the rate check of every policy and family: the issue's
    100-byte SplitMix64 container, all 8 bits set, k = 7), and the fullest all-ones P2 filters the
    checks accept (every position a positive), blocked and SplitMix64, one block and several."""
    sys.path.insert(0, os.path.dirname(HERE))
    from hostile import bloom_container, splitmix_container

    seeds = {}
    for policy in ("p1", "middle", "p0", "p2"):
        for numel in (EXPECTED[0], LIMIT):
            seeds[f"splitmix-k7-full-{policy}-{numel}"] = splitmix_container(policy, 7, 8, 10, numel)
    seeds[f"blocked-k9-full-p1-{LIMIT}"] = bloom_container("p1", 9, 1, 57, LIMIT)
    # the fullest accepted: k = 1 with 64 keys per set bit (one 131 KB seed: its raw values), k = 2
    # with k r = 2 m; the other seeds carry fewer values (512 keys, one per set bit) to stay small
    seeds[f"blocked-k1-full-p2-{LIMIT}"] = bloom_container("p2", 1, 1, 64 * 512, LIMIT)
    for k, n in ((1, 512), (2, 512)):
        seeds[f"splitmix-k{k}-full-p2-{LIMIT}"] = splitmix_container("p2", k, 512, n, LIMIT)
        seeds[f"blocked-k{k}-full-p1-{LIMIT}"] = bloom_container("p1", k, 1, n, LIMIT)
    seeds[f"blocked-k2-full-p2-{LIMIT}"] = bloom_container("p2", 2, 1, 512, LIMIT)
    seeds[f"blocked-k2-full4-p2-{LIMIT}"] = bloom_container("p2", 2, 4, 4 * 512, LIMIT)
    seeds[f"blocked-k1-full-p2-{EXPECTED[0]}"] = bloom_container("p2", 1, 1, EXPECTED[0], EXPECTED[0])
    seeds[f"splitmix-k2-full-p2-{EXPECTED[0]}"] = splitmix_container("p2", 2, 512, 512, EXPECTED[0])
    return seeds


def write_corpus(folder: str) -> None:
    """Valid containers of every config: two sparse gradients, one dense tensor, and the v1
    golden container, so the fuzzer starts inside every codec of both formats; and the hostile
    Bloom containers of :func:`hostile_bloom_seeds`."""
    import deepreduce

    os.makedirs(folder, exist_ok=True)
    for name, data in hostile_bloom_seeds().items():
        with open(os.path.join(folder, f"hostile-bloom-{name}.bin"), "wb") as out:
            out.write(data)
    rng = np.random.default_rng(13)
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        name = os.path.splitext(os.path.basename(path))[0]
        pipe = deepreduce.build(path)
        pipe.min_numel = 100
        grads = [(rng.standard_normal(EXPECTED) * rng.exponential(1.0, EXPECTED)).astype(np.float32)
                 for _ in range(2)] + [rng.standard_normal(10).astype(np.float32)]
        for i, grad in enumerate(grads):
            payload = pipe.encode(grad, name=f"layer{i}.weight", step=i)
            with open(os.path.join(folder, f"{name}-{i}.bin"), "wb") as out:
                out.write(payload.tobytes())
        v1 = os.path.join(ROOT, "tests", "golden", "v1", f"config_{name}.npz")
        if os.path.exists(v1):
            with open(os.path.join(folder, f"{name}-v1.bin"), "wb") as out:
                out.write(np.load(v1)["payload"].tobytes())


def tf_decoder(receiver):
    """decode(payload, expected shape or None) through the TensorFlow op, eagerly (an op error
    comes back as the deepreduce error it names); None without ``FUZZ_TF=1``, TensorFlow or the ops."""
    if os.environ.get("FUZZ_TF") != "1":
        return None
    try:
        import tensorflow as tf

        from deepreduce.tensorflow import ops

        op = ops.PipelineOps(receiver, ops.load())
    except Exception as exc:   # absent or not built: say so once, fuzz the rest
        print(f"fuzz_decoders: TF op not fuzzed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    from tensorflow.python.eager import context

    calls = [0]

    def decode(payload, shape):
        # TF's eager kernel cache keeps one kernel per distinct attribute set, and the expected
        # shape is an attribute: fuzzed shapes would grow it by ~38 KB each until the RSS limit
        # (a training job has one shape per tensor). Clearing it every 1000 calls keeps RSS flat.
        calls[0] += 1
        if calls[0] % 1000 == 0:
            context.context().clear_kernel_cache()
        return op.decode(tf.constant(payload), shape, None, True).numpy()
    return decode


def main() -> None:
    import atheris

    with atheris.instrument_imports(include=["deepreduce"]):
        import deepreduce
        from deepreduce import registry
        from deepreduce.errors import DeepReduceError
        from deepreduce.wire import container

        registry.load_builtin_components()   # every codec module, instrumented

    # nonfinite: raise, so a decode_sum whose finite summands overflow raises instead of giving Inf
    config = deepreduce.load_config(os.path.join(ROOT, "configs", "topk_raw.yaml"))
    receiver = deepreduce.build({**config, "nonfinite": "raise", "max_numel": LIMIT})
    # the ops propagate non-finite values (ops.unsupported): a receiver of its own for them
    tf_decode = tf_decoder(deepreduce.build({**config, "max_numel": LIMIT}))

    def check_finite(info, out):
        if out is not None and not info.get("nonfinite") and not np.isfinite(out).all():
            raise AssertionError("decoded NaN/Inf from a container without the non-finite flag")

    def attempt(call):
        try:
            return call()
        except DeepReduceError:
            return None

    def one_input(data: bytes) -> None:
        if len(data) < 9:
            return
        buf = bytearray(data)
        buf[-4:] = zlib.crc32(bytes(buf[:-4])).to_bytes(4, "little")
        payload = np.frombuffer(bytes(buf), dtype=np.uint8)
        info = attempt(lambda: container.inspect(payload, max_numel=LIMIT)) or {}
        attempt(lambda: container.split(payload))
        check_finite(info, attempt(lambda: receiver.decode(payload)))
        check_finite(info, attempt(lambda: receiver.decode(payload, expected_shape=EXPECTED)))
        check_finite(info, attempt(lambda: receiver.decode_sum([payload, payload], expected_shape=EXPECTED)))
        if tf_decode is not None:
            check_finite(info, attempt(lambda: tf_decode(payload, None)))
            check_finite(info, attempt(lambda: tf_decode(payload, EXPECTED)))

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write-corpus":
        sys.path.insert(0, ROOT)
        write_corpus(sys.argv[2])
    else:
        main()
