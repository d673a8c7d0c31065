"""2-rank worker: DistributedGradientTape steps vs one process stepping on the averaged gradient.

Launched by tests/test_tensorflow_distributed.py under ``horovodrun -np 2`` (one launch for
every check: TensorFlow starts slowly). Each rank holds different data; with lossless raw
codecs a few SGD steps through the tape (eager, inside ``tf.function`` with
``optimizer.iterations`` as the step, the wrapper created inside the compiled step from a config
path as Horovod's TF2 pattern does, and through DistributedOptimizer) must leave the weights
bit-identical on both ranks and equal to a single process that steps on the average of both
ranks' gradients; gradient accumulation must equal one step on the summed gradients. A Top-r
config must keep the ranks identical; GradiVeQ runs through Horovod's own tape; Keras
``model.fit`` with the broadcast callback starts from rank 0's weights. Ranks that disagree
(an extra variable, GradiVeQ against a config) fail together with the same CommunicationError;
under ``nonfinite: raise`` a NaN on one rank makes both ranks skip the step (issue 13 part 5).
Eager steps with the chains on worker threads send the same containers and reduce to the same
gradients as one tensor after another (with the custom ops and with numpy_function), report the
encode time hidden behind other tensors' communication, and a worker's exception reaches the
caller with its type while the next step still works (issue 12 part 2).
Rank 0 writes the results as JSON to the path given as the first argument.
"""
import json
import os
import re
import sys
import threading
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import deepreduce.tensorflow as drtf  # noqa: E402
import deepreduce.tensorflow.keras as drk  # noqa: E402
from deepreduce import CommunicationError, NonFiniteGradientError  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
LR = 0.1
STEPS = 3


def initial_weights():
    rng = np.random.default_rng(42)   # same on every rank
    return [rng.standard_normal((20, 64)).astype(np.float32) * 0.3, np.zeros(64, np.float32),
            rng.standard_normal((64, 3)).astype(np.float32) * 0.3, np.zeros(3, np.float32)]


def data(rank, step):
    rng = np.random.default_rng([rank, step])
    return rng.standard_normal((16, 20)).astype(np.float32), rng.integers(0, 3, 16)


def loss_fn(variables, x, y):
    w1, b1, w2, b2 = variables
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def local_grads(weights, x, y):
    variables = [tf.Variable(w) for w in weights]
    with tf.GradientTape() as tape:
        loss = loss_fn(variables, x, y)
    return [g.numpy() for g in tape.gradient(loss, variables)]


def reference(size, op="average"):
    """One process: SGD on the average (or sum) of every rank's gradient."""
    weights = initial_weights()
    for step in range(STEPS):
        per_rank = [local_grads(weights, *data(r, step)) for r in range(size)]
        for i in range(len(weights)):
            total = per_rank[0][i].copy()
            for r in range(1, size):
                total += per_rank[r][i]
            g = total * np.float32(1.0 / size) if op == "average" else total
            weights[i] = weights[i] - np.float32(LR) * g
    return weights


def reference_accumulated(size, passes, steps):
    """One process: SGD on the rank average of the sum of ``passes`` micro-batch gradients."""
    weights = initial_weights()
    for step in range(steps):
        grads = [local_grads(weights, *data(r, passes * step + p)) for r in range(size) for p in range(passes)]
        for i in range(len(weights)):
            total = grads[0][i].copy()
            for g in grads[1:]:
                total += g[i]
            weights[i] = weights[i] - np.float32(LR) * (total * np.float32(1.0 / size))
    return weights


def run_tape_inside_function(config, compiled=True):
    """Horovod's TF2 pattern: the wrapper is created inside the step from a config path or dict,
    with the pipeline's own step counter. Returns the weights and the deepreduce warnings."""
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = keras.optimizers.SGD(learning_rate=LR)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        tape = drtf.DistributedGradientTape(tape, compression=config)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    fn = tf.function(step_fn) if compiled else step_fn
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, y = data(hvd.rank(), step)
            fn(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in variables], [str(w.message) for w in caught if os.path.join("deepreduce", "tensorflow") in str(w.filename)]


def run_accumulation(config, passes=2, steps=2):
    """Keras DistributedOptimizer(backward_passes_per_step=passes) stepped passes x steps times."""
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = drtf.DistributedOptimizer(keras.optimizers.SGD(learning_rate=LR), compression=config,
                                    backward_passes_per_step=passes)

    @tf.function
    def micro_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    for i in range(passes * steps):
        x, y = data(hvd.rank(), i)
        micro_step(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in variables], int(opt.iterations.numpy())


def run_gradiveq(tape_class):
    """GradiVeQ as a summable compressor: warm-up 1, sampling 2, then 3 compressed steps of w1."""
    gvq = drtf.GradiVeQ(warmup=1, sample_iters=2, compress_iters=3, slice_size=64, min_numel=1024)
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = keras.optimizers.SGD(learning_rate=LR)

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        tape = tape_class(tape, compression=gvq)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    for step in range(6):
        x, y = data(hvd.rank(), step)
        step_fn(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in variables], gvq.compression_stats()


def run_fit(config):
    """Keras model.fit from different initial weights per rank, with the broadcast callback."""
    keras.utils.set_random_seed(100 + hvd.rank())
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    initial = np.concatenate([w.ravel() for w in model.get_weights()])
    rank0_initial = hvd.broadcast(tf.constant(initial), root_rank=0, name="fit_initial").numpy()
    opt = drk.DistributedOptimizer(keras.optimizers.SGD(learning_rate=LR, momentum=0.9), compression=config)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    seen = {}

    class FirstStepWeights(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.setdefault("start", np.concatenate([w.ravel() for w in self.model.get_weights()]))

    batches = [data(hvd.rank(), i) for i in range(4)]
    x, y = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[drk.BroadcastGlobalVariablesCallback(0), drk.MetricAverageCallback(),
                                       FirstStepWeights()])
    final = np.concatenate([w.ravel() for w in model.get_weights()])
    gathered = hvd.allgather(tf.constant(np.concatenate([final, history.history["loss"]])[None, :])).numpy()
    return {"start_is_rank0": bool(np.array_equal(seen["start"], rank0_initial)),
            "ranks_started_apart": bool(hvd.allreduce(tf.constant(float(np.max(np.abs(initial - rank0_initial)))),
                                                      op=hvd.Max, name="fit_apart").numpy() > 0),
            "ranks_identical": bool(np.array_equal(gathered[0], gathered[1])),
            "changed": float(np.max(np.abs(final - rank0_initial))),
            "wire_bytes": opt.compression_stats()["wire_bytes"],
            "warnings": [str(w.message) for w in caught if os.path.join("deepreduce", "tensorflow") in str(w.filename)]}


def run_tape(config, mode, op=None):
    pipe = drtf.build(config) if config is not None else None   # None: the hvd.allreduce baseline
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = keras.optimizers.SGD(learning_rate=LR)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        tape = drtf.DistributedGradientTape(tape, compression=pipe, op=op, step=opt.iterations)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    fn = tf.function(step_fn) if mode == "function" else step_fn
    for step in range(STEPS):
        x, y = data(hvd.rank(), step)
        fn(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in variables], pipe


def run_optimizer(config):
    pipe = drtf.build(config)
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = drtf.DistributedOptimizer(keras.optimizers.SGD(learning_rate=LR), compression=pipe)

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    for step in range(STEPS):
        x, y = data(hvd.rank(), step)
        step_fn(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in variables], pipe


def run_legacy_optimizer(config):
    """A tf.compat.v1 optimizer wrapped by DistributedOptimizer, stepped eagerly with minimize()."""
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = drtf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), compression=drtf.build(config))
    for step in range(STEPS):
        x, y = data(hvd.rank(), step)
        opt.minimize(lambda: loss_fn(variables, tf.constant(x), tf.constant(y)), var_list=variables)
    return [v.numpy() for v in variables]


def local_source_check(config):
    """One gradient() call with a registered local source: it is not averaged but scaled by 1/size."""
    weights = initial_weights()
    variables = [tf.Variable(w) for w in weights]
    x, y = data(hvd.rank(), 0)
    with tf.GradientTape() as tape:
        loss = loss_fn(variables, tf.constant(x), tf.constant(y))
    tape = drtf.DistributedGradientTape(tape, compression=drtf.build(config))
    tape.register_local_source(variables[3])
    grads = [g.numpy() for g in tape.gradient(loss, variables)]
    mine = local_grads(weights, x, y)
    every = [local_grads(weights, *data(r, 0)) for r in range(hvd.size())]
    averaged = [sum(e[i] for e in every) / hvd.size() for i in range(3)]
    return {"global_max_abs_diff": float(max(np.max(np.abs(grads[i] - averaged[i])) for i in range(3))),
            "local_max_abs_diff": float(np.max(np.abs(grads[3] - mine[3] / hvd.size())))}


def same_on_every_rank(text, tag):
    data = np.frombuffer(text.encode().ljust(600)[:600], dtype=np.uint8)
    gathered = hvd.allgather(tf.constant(data[None, :]), name=f"same_{tag}").numpy()
    return bool(all(np.array_equal(gathered[0], row) for row in gathered))


def disagreement(compression, extra):
    """The CommunicationError text (and seconds) of a compiled tape step whose ranks disagree."""
    variables = [tf.Variable(w) for w in initial_weights()] + ([tf.Variable(tf.zeros((3, 3)))] if extra else [])

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables[:4], x, y) + sum(tf.reduce_sum(v) for v in variables[4:])
        tape = drtf.DistributedGradientTape(tape, compression=compression, name_prefix="disagree")
        return tape.gradient(loss, variables)

    start = time.perf_counter()
    try:
        step_fn(*(tf.constant(a) for a in data(hvd.rank(), 0)))
    except CommunicationError as exc:
        return {"message": str(exc), "seconds": time.perf_counter() - start}
    return {"message": "no error", "seconds": time.perf_counter() - start}


def nonfinite_skip(config, compiled):
    """nonfinite: raise; rank 1's gradient is NaN at step 1: every rank skips it (the docs' loop)."""
    pipe = drtf.build(config)
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = keras.optimizers.SGD(learning_rate=LR)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        tape = drtf.DistributedGradientTape(tape, compression=pipe, step=opt.iterations)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    step_fn = tf.function(step_fn) if compiled else step_fn
    skipped, unchanged, kinds = [], [], []
    for step in range(4):
        x, y = data(hvd.rank(), step)
        if step == 1 and hvd.rank() == 1:
            x[0, 0] = np.nan
        weights = [v.numpy() for v in variables]
        kept = pipe.core.state_dict()["memory"]["residuals"]
        try:
            step_fn(tf.constant(x), tf.constant(y))
        except (NonFiniteGradientError, tf.errors.OpError) as exc:   # tf.function re-raises it as UnknownError
            if "NonFiniteGradientError" not in f"{type(exc).__name__}: {exc}":
                raise
            now = pipe.core.state_dict()["memory"]["residuals"]
            unchanged.append(all(np.array_equal(a, v.numpy()) for a, v in zip(weights, variables))
                             and sorted(now) == sorted(kept) and all(np.array_equal(now[k], kept[k]) for k in kept))
            found = re.search(r"gradient '[^']*' at step \d+ has \d+ NaN and \d+ Inf entries on rank \d+", str(exc))
            skipped.append([step, found.group(0) if found else str(exc)])
            kinds.append(type(exc).__name__)
    out = compare([v.numpy() for v in variables])
    out.update(skipped=skipped, unchanged=unchanged, kinds=kinds,
               same_message=same_on_every_rank(skipped[0][1] if skipped else "", f"nonfinite_{compiled}"))
    return out


class InjectedError(RuntimeError):
    """Raised by a wrapped encode to check that a worker's exception reaches the caller as it is."""


def record_encodes(pipe, sent, delay_first=False):
    """Wrap ``pipe.encode`` to keep every container's bytes by (step, name). ``delay_first``: rank 1
    encodes grad_0 200 ms late, so rank 0's allgather of grad_0 is in flight meanwhile."""
    encode = pipe.encode

    def recording(tensor, name="", step=0, on_error=None):
        if delay_first and hvd.rank() == 1 and name == "grad_0":
            time.sleep(0.2)
        payload = encode(tensor, name=name, step=step, on_error=on_error)
        sent[(int(step), name)] = payload.numpy().tobytes()
        return payload

    pipe.encode = recording


def eager_steps(pipe, background):
    """STEPS eager tape steps from the same weights; returns (weights, every applied step's reduced
    gradients, [step, type name, message] of each InjectedError, after which the step is skipped)."""
    variables = [tf.Variable(w) for w in initial_weights()]
    opt = keras.optimizers.SGD(learning_rate=LR)
    grads_seen, errors = [], []
    for step in range(STEPS):
        x, y = data(hvd.rank(), step)
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, tf.constant(x), tf.constant(y))
        tape = drtf.DistributedGradientTape(tape, compression=pipe, step=opt.iterations, background=background)
        try:
            grads = tape.gradient(loss, variables)
        except InjectedError as exc:
            errors.append([step, type(exc).__name__, str(exc)])
            opt.iterations.assign_add(1)
            continue
        grads_seen.append([g.numpy() for g in grads])
        opt.apply_gradients(zip(grads, variables))
    return [v.numpy() for v in variables], grads_seen, errors


def pipelined_vs_sequential(config, backend):
    """The same eager steps with background=False and with 2 worker threads: the containers each
    rank sent and the reduced gradients must be identical; the statistics report the hidden time."""
    runs = {}
    for label, background in (("sequential", False), ("pipelined", 2)):
        pipe, sent = drtf.build(config, backend=backend), {}
        record_encodes(pipe, sent, delay_first=bool(background))
        weights, grads, _ = eager_steps(pipe, background)
        runs[label] = (weights, grads, sent, pipe.compression_stats())
    (_, grads_a, sent_a, stats_a), (weights, grads_b, sent_b, stats_b) = runs["sequential"], runs["pipelined"]
    out = compare(weights)
    out.update(backend=drtf.build(config, backend=backend).backend, containers=len(sent_b),
               same_containers=sorted(sent_a) == sorted(sent_b) and all(sent_a[k] == sent_b[k] for k in sent_a),
               same_gradients=len(grads_a) == len(grads_b) == STEPS and all(
                   np.array_equal(a, b) for ga, gb in zip(grads_a, grads_b) for a, b in zip(ga, gb)),
               sequential_hidden=stats_a["encode_hidden_seconds"], sequential_encode=stats_a["eager_encode_seconds"],
               hidden=stats_b["encode_hidden_seconds"], eager_encode=stats_b["eager_encode_seconds"])
    return out


def worker_error(config):
    """grad_2's encode raises on every rank at step 1 (2 workers): the caller gets InjectedError,
    every other tensor's collective completed, and the next step works."""
    pipe = drtf.build(config)
    encode = pipe.encode

    def failing(tensor, name="", step=0, on_error=None):
        if int(step) == 1 and name == "grad_2":
            raise InjectedError(f"injected in thread {threading.current_thread().name}")
        return encode(tensor, name=name, step=step, on_error=on_error)

    pipe.encode = failing
    weights, grads, errors = eager_steps(pipe, 2)
    out = compare(weights)
    out.update(errors=errors, steps_applied=len(grads))
    return out


def graph_order(config, backend):
    """The encode, allgather and decode ops of a traced tape step, each with the kinds of the ops
    it has control inputs from ("encode", "gather", "decode" or another op type)."""
    pipe = drtf.build(config, backend=backend)
    variables = [tf.Variable(w) for w in initial_weights()]

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, x, y)
        return drtf.DistributedGradientTape(tape, compression=pipe, step=0).gradient(loss, variables)

    def kind(op):   # a decode runs inside the cond that skips it when a rank failed: the cond counts
        if op.type == "HorovodAllgather":
            return "gather"
        if op.type == "DeepReduceEncode" or op.name.startswith("deepreduce_encode"):
            return "encode"
        if op.type in ("If", "StatelessIf") and op.name.startswith("deepreduce_decode"):
            return "decode"
        return op.type

    graph = step_fn.get_concrete_function(*(tf.TensorSpec(a.shape, a.dtype) for a in data(0, 0))).graph
    return [[kind(op), sorted(kind(c) for c in op.control_inputs)] for op in graph.get_operations()
            if kind(op) in ("encode", "gather", "decode")]


def compare(weights, expected=None):
    """Bit-identity across ranks (allgather) and the largest deviation from ``expected``."""
    flat = np.concatenate([w.ravel() for w in weights])
    gathered = hvd.allgather(tf.constant(flat[None, :])).numpy()
    same = bool(all(np.array_equal(gathered[0], gathered[r]) for r in range(gathered.shape[0])))
    out = {"ranks_identical": same}
    if expected is not None:
        ref = np.concatenate([w.ravel() for w in expected])
        out["max_abs_diff"] = float(np.max(np.abs(flat - ref)))
    out["changed"] = float(np.max(np.abs(flat - np.concatenate([w.ravel() for w in initial_weights()]))))
    return out


def main():
    hvd.init()
    raw = os.path.join(ROOT, "configs", "none_raw.yaml")
    topk = os.path.join(ROOT, "configs", "topk_raw.yaml")
    ref_avg, ref_sum = reference(hvd.size()), reference(hvd.size(), "sum")
    results = {"size": hvd.size()}
    results["eager"] = compare(run_tape(raw, "eager")[0], ref_avg)
    weights, pipe = run_tape(raw, "function")
    results["function"] = compare(weights, ref_avg)
    results["function_wire_bytes"] = pipe.stats.wire_bytes
    results["function_tensors_encoded"] = pipe.stats.tensors_encoded
    results["sum"] = compare(run_tape(raw, "function", op=hvd.Sum)[0], ref_sum)
    results["optimizer"] = compare(run_optimizer(raw)[0], ref_avg)
    results["legacy_optimizer"] = compare(run_legacy_optimizer(raw), ref_avg)
    results["allreduce"] = compare(run_tape(None, "function")[0], ref_avg)
    exact_sparse = {"sparsifier": {"id": "topk", "ratio": 1.0}, "index": {"id": "raw"}, "value": {"id": "raw"},
                    "memory": {"id": "none"}, "min_numel": 0,
                    "aggregation": {"id": "sparse_allreduce", "reselect": "none"}}
    results["sparse_allreduce_eager"] = compare(run_tape(exact_sparse, "eager")[0], ref_avg)
    results["sparse_allreduce_function"] = compare(run_tape(exact_sparse, "function")[0], ref_avg)
    results["local_source"] = local_source_check(raw)
    weights, pipe = run_tape(topk, "function")
    results["topk"] = compare(weights)
    results["topk_relative_volume"] = pipe.stats.relative_volume
    # Bloom P2 (custom ops when built): ranks stay identical
    weights, pipe = run_tape({"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "bloom", "policy": "p2"},
                              "value": {"id": "raw"}, "memory": {"id": "residual"}}, "function")
    results["bloom"] = compare(weights)
    results["bloom_backend"] = pipe.backend
    weights, caught = run_tape_inside_function(raw)
    results["inside_function"] = compare(weights, ref_avg)
    results["inside_function_warnings"] = caught
    results["inside_function_counter"] = int(drtf.shared(raw).iterations.numpy())
    weights, caught = run_tape_inside_function({"sparsifier": {"id": "none"}, "index": {"id": "raw"},
                                                "value": {"id": "raw"}, "memory": {"id": "none"}}, compiled=False)
    results["inside_eager_dict"] = compare(weights, ref_avg)
    results["inside_eager_dict_warnings"] = caught
    weights, iterations = run_accumulation(raw)
    results["accumulation"] = compare(weights, reference_accumulated(hvd.size(), 2, 2))
    results["accumulation_iterations"] = iterations
    weights, stats = run_gradiveq(hvd.DistributedGradientTape)   # Horovod's own, unmodified tape
    results["gradiveq"] = compare(weights)
    results["gradiveq"]["stats"] = {k: v for k, v in stats.items() if k != "dims"}
    results["fit"] = run_fit(topk)
    for case, compression, extra in (("extra_variable", raw, True),
                                     ("mixed", drtf.GradiVeQ() if hvd.rank() else raw, False)):
        results[case] = disagreement(compression, extra and hvd.rank() == 1)
        results[case]["same_on_every_rank"] = same_on_every_rank(results[case]["message"], case)
    for mode, compiled in (("function", True), ("eager", False)):
        results[f"nonfinite_{mode}"] = nonfinite_skip({"sparsifier": {"id": "topk", "ratio": 0.1},
                                                       "index": {"id": "raw"}, "value": {"id": "raw"},
                                                       "memory": {"id": "residual"}, "min_numel": 10,
                                                       "nonfinite": "raise"}, compiled)
    pipelined = {"sparsifier": {"id": "topk", "ratio": 0.1}, "index": {"id": "bloom", "policy": "p2"},
                 "value": {"id": "raw"}, "memory": {"id": "residual"}, "min_numel": 10}
    for backend in ("auto", "numpy_function"):
        results[f"pipelined_{backend}"] = pipelined_vs_sequential(pipelined, backend)
    results["worker_error"] = worker_error(raw)
    # rank 0 one tensor after another, rank 1 on 2 threads: the allgathers still meet by name
    results["mixed_background"] = compare(eager_steps(drtf.build(raw), 2 if hvd.rank() else False)[0], ref_avg)
    for backend in ("auto", "numpy_function"):
        results[f"graph_order_{backend}"] = graph_order(pipelined, backend)
    if hvd.rank() == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main()
