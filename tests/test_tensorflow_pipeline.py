"""The TensorFlow pipeline: graph ops eagerly and inside tf.function (tensor step), errors, op loading."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")

import deepreduce  # noqa: E402
import deepreduce.tensorflow as drtf  # noqa: E402
from deepreduce.tensorflow import ops  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANDOMK = {"sparsifier": {"id": "randomk", "ratio": 0.05}, "index": {"id": "raw"},
           "value": {"id": "raw"}, "memory": {"id": "residual"}}


def grad(seed, shape=(40, 60)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_encode_returns_1d_uint8_and_decode_restores_shape():
    pipe = drtf.build(os.path.join(ROOT, "configs", "topk_raw.yaml"))
    g = grad(0)
    payload = pipe.encode(tf.constant(g), name="w", step=0)
    assert payload.dtype == tf.uint8 and payload.shape.rank == 1
    dense = pipe.decode(payload)
    assert dense.dtype == tf.float32 and tuple(dense.shape) == g.shape
    core = deepreduce.build(os.path.join(ROOT, "configs", "topk_raw.yaml"))
    assert np.array_equal(payload.numpy(), core.encode(g, name="w", step=0))
    assert np.array_equal(dense.numpy(), core.decode(payload.numpy()))


def test_tf_function_with_tensor_step_matches_core_at_every_step():
    """randomk draws depend on the step: the traced graph must see each step's value."""
    pipe, core = drtf.build(RANDOMK), deepreduce.build(RANDOMK)
    step_var = tf.Variable(0, dtype=tf.int64)
    traces = []

    @tf.function
    def encode_step(x):
        traces.append(1)
        payload = pipe.encode(x, name="layer/kernel", step=step_var)
        dense = pipe.decode(payload, x.shape)
        step_var.assign_add(1)
        return payload, dense

    payloads = []
    for step in range(4):
        g = grad(step)
        payload, dense = encode_step(tf.constant(g))
        expected = core.encode(g, name="layer/kernel", step=step)
        assert np.array_equal(payload.numpy(), expected), f"step {step}"
        assert tuple(dense.shape) == g.shape
        np.testing.assert_array_equal(dense.numpy(), core.decode(expected))
        payloads.append(payload.numpy())
    assert len(traces) == 1                               # traced once, ran four times
    assert not np.array_equal(payloads[0], payloads[1])   # the step changed the draw
    # the residual memory advanced inside the graph exactly as in the core
    np.testing.assert_array_equal(pipe.residual("layer/kernel"), core.memory.residual("layer/kernel"))
    assert pipe.stats.tensors_encoded == 4


def test_keras_optimizer_iterations_as_step():
    keras = pytest.importorskip("keras")
    opt = keras.optimizers.SGD(0.1)
    var = tf.Variable(np.zeros((30, 50), np.float32))
    opt.build([var])
    pipe, core = drtf.build(RANDOMK), deepreduce.build(RANDOMK)

    @tf.function
    def f(x):
        return pipe.encode(x, name="v", step=opt.iterations)

    for step in range(2):
        g = grad(10 + step, (30, 50))
        assert np.array_equal(f(tf.constant(g)).numpy(), core.encode(g, name="v", step=step))
        opt.apply_gradients([(tf.constant(g), var)])


def test_decode_sum_of_concatenated_containers():
    pipe = drtf.build(os.path.join(ROOT, "configs", "none_raw.yaml"))
    a, b = grad(1, (3000,)), grad(2, (3000,))
    gathered = tf.concat([pipe.encode(a, name="g"), pipe.encode(b, name="g")], axis=0)

    @tf.function
    def f(buf):
        return pipe.decode_sum(buf, (3000,), count=2)

    np.testing.assert_array_equal(f(gathered).numpy(), a + b)
    np.testing.assert_array_equal(pipe.decode_sum(gathered, (3000,), count=2).numpy(), a + b)
    with pytest.raises(deepreduce.CommunicationError):
        pipe.decode_sum(gathered, (3000,), count=3)


def test_small_and_float16_tensors():
    pipe = drtf.build(os.path.join(ROOT, "configs", "topk_raw.yaml"))
    small = grad(3, (7, 3))
    np.testing.assert_array_equal(pipe.decode(pipe.encode(small, name="b")).numpy(), small)
    half = tf.constant(grad(4, (10,)), tf.float16)
    np.testing.assert_array_equal(pipe.decode(pipe.encode(half, name="h")).numpy(),
                                  half.numpy().astype(np.float32))


def test_errors_keep_their_type_eagerly_and_name_the_problem_in_graphs():
    pipe = drtf.build(os.path.join(ROOT, "configs", "topk_raw.yaml"))
    payload = pipe.encode(grad(5), name="w").numpy()
    bad = payload.copy()
    bad[60] ^= 0xFF
    with pytest.raises(deepreduce.ContainerError, match="checksum"):
        pipe.decode(bad)
    with pytest.raises(deepreduce.CommunicationError, match="expected"):
        pipe.decode(payload, (10, 10))
    with pytest.raises(deepreduce.DeepReduceError, match="dtype"):
        pipe.encode(tf.constant([1, 2, 3]), name="ints")

    @tf.function
    def f(buf):
        return pipe.decode(buf)

    with pytest.raises(tf.errors.OpError, match="checksum"):
        f(tf.constant(bad))


def test_ops_load_error_says_how_to_rebuild(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPREDUCE_BACKEND", raising=False)
    monkeypatch.setattr(ops, "_state", {"module": None, "error": None, "warned": False})
    monkeypatch.setattr(ops, "LIBRARY_PATH", str(tmp_path / "missing.so"))
    with pytest.raises(deepreduce.BackendUnavailableError, match="build_tf_ops.sh"):
        ops.load()
    assert not ops.available()
    # a library built for another TensorFlow (here: not a library at all) fails to load
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setattr(ops, "_state", {"module": None, "error": None, "warned": False})
    monkeypatch.setattr(ops, "LIBRARY_PATH", str(broken))
    with pytest.raises(deepreduce.BackendUnavailableError, match="rebuild"):
        ops.load()
    # the pipeline warns once with the same instruction and falls back to numpy_function (same bytes)
    config = os.path.join(ROOT, "configs", "bf_p0.yaml")
    with pytest.warns(RuntimeWarning, match="build_tf_ops.sh"):
        pipe = drtf.build(config)
    assert pipe.backend == "numpy_function"
    g = grad(7)
    assert np.array_equal(pipe.encode(g, name="w", step=1).numpy(), deepreduce.build(config).encode(g, name="w", step=1))
    with pytest.raises(deepreduce.BackendUnavailableError, match="build_tf_ops.sh"):
        drtf.build(config, backend="tf-ops")


def test_tape_arguments_are_checked_without_running_collectives():
    pytest.importorskip("horovod.tensorflow")
    import horovod.tensorflow as hvd

    topk = os.path.join(ROOT, "configs", "topk_raw.yaml")
    with tf.GradientTape() as tape:
        pass
    # a config path resolves to the process-wide pipeline of that config, every time
    first = drtf.DistributedGradientTape(tape, compression=topk)
    assert drtf.DistributedGradientTape(tape, compression=topk).pipeline is first.pipeline is drtf.shared(topk)
    pipe = drtf.build(topk)
    wrapped = drtf.DistributedGradientTape(tape, compression=pipe, op=hvd.Sum)
    assert isinstance(wrapped, tf.GradientTape) and wrapped.pipeline is pipe
    with pytest.raises(deepreduce.ConfigError, match="Adasum"):
        drtf.DistributedGradientTape(tape, compression=pipe, op=hvd.Adasum)
    with pytest.raises(deepreduce.ConfigError, match="predivide"):
        drtf.DistributedGradientTape(tape, compression=pipe, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(deepreduce.ConfigError, match="background must be True, False or a positive number"):
        drtf.DistributedGradientTape(tape, compression=pipe, background=0)
    assert drtf.DistributedGradientTape(tape, compression=pipe, background=3)._deepreduce.workers == 3
    keras = pytest.importorskip("keras")
    with pytest.raises(deepreduce.ConfigError, match="backward_passes_per_step"):
        drtf.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=pipe, backward_passes_per_step=0)
    with pytest.raises(deepreduce.ConfigError, match="DistributedOptimizer: background must be"):
        drtf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), background="yes")
    with pytest.raises(deepreduce.ConfigError, match="Keras optimizer"):
        drtf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), compression=pipe,
                                  backward_passes_per_step=2)
    wrapped_opt = drtf.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), compression=pipe)
    assert isinstance(wrapped_opt, keras.optimizers.SGD) and wrapped_opt.get_config()["momentum"] == 0.5


def test_tf_resnet20_matches_the_torch_model_size():
    """The TF jobs' ResNet-20 has the paper's 269,722 trainable parameters, as the torch model."""
    keras = pytest.importorskip("keras")
    from experiments import tf_job as job

    model = job.resnet20(keras)
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == 269_722
    assert tuple(model(np.zeros((2, 32, 32, 3), np.float32)).shape) == (2, 10)
    from experiments import train as torch_job

    record = job.epoch_record(3, 0.25, 0.9, 0.03, 1.5)
    assert job.epoch_line(record) == torch_job.EPOCH_LINE.format(acc_pct=90.0, **record)   # the PyTorch job's line


def test_tf_jobs_take_the_torch_jobs_options():
    """One definition of the common job options: the TF jobs parse them as the torch job does."""
    import argparse

    from experiments import tf_job as job
    from experiments import train as torch_job

    argv = ["--config", "configs/bf_p2.yaml", "--epochs", "3", "--lr", "0.1", "--max-steps", "5", "--seed", "4",
            "--threads", "2", "--metrics-json", "m.json", "--baseline"]
    tf_args = vars(job.add_job_arguments(argparse.ArgumentParser()).parse_args(argv + ["--tf-backend", "tf-ops"]))
    torch_args = vars(torch_job.parse_args(argv))
    assert tf_args.pop("tf_backend") == "tf-ops"
    assert tf_args == {key: torch_args[key] for key in tf_args}


def test_shared_pipeline_one_per_config_and_per_core_pipeline():
    path = os.path.join(ROOT, "configs", "topk_raw.yaml")
    pipe = drtf.shared(path)
    assert drtf.shared(path) is pipe
    assert drtf.shared(deepreduce.load_config(path)) is pipe     # equal configs, one pipeline
    assert drtf.shared(RANDOMK) is not pipe
    core = deepreduce.build(path)
    assert drtf.shared(core) is drtf.shared(core) and drtf.shared(core).core is core
    assert drtf.shared(pipe) is pipe and drtf.build(path) is not pipe    # build() always makes a new one


def test_pipeline_built_inside_tf_function_traces_twice_without_new_variables():
    """A TFPipeline resolved inside a traced step (as the tape does) is created once: a retrace
    (another input shape) finds it again, so no tf.Variable is created on a later call."""
    traces = []

    @tf.function
    def step(x):
        pipe = drtf.shared(RANDOMK)
        traces.append(pipe)
        counter = pipe.iterations
        payload = pipe.encode(x, name=f"retrace_{x.shape[0]}", step=counter)
        counter.assign_add(1)
        return pipe.decode(payload, x.shape)

    for shape in ((30, 40), (30, 40), (50, 20)):
        g = grad(len(traces), shape)
        assert step(tf.constant(g)).shape == shape
    # traced again for the new shape (and once more on the first call, where TF saw a variable created)
    assert len(traces) >= 2 and all(pipe is traces[0] for pipe in traces)
    assert int(traces[0].iterations.numpy()) == 3


def test_numpy_stages_keep_denormals_inside_tf_function():
    """TF's op threads flush denormals to zero; the core's stages must not (same bytes as eager)."""
    from deepreduce.tensorflow.pipeline import numpy_op

    def scaled():
        return np.array([np.float32(1e-40) * np.float32(1.0)], np.float32)

    @tf.function
    def f():
        return numpy_op(scaled, [], tf.float32, "denormal")

    assert f().numpy()[0] == scaled()[0] > 0


CHECKPOINTED = [
    RANDOMK,   # the numpy_function backend: the core holds the residuals
    {"sparsifier": {"id": "topk", "ratio": 0.05}, "index": {"id": "bloom", "policy": "p2", "fpr": 0.01},
     "value": {"id": "polyfit"}, "memory": {"id": "residual"}},   # the ops hold them (when built)
]


@pytest.mark.parametrize("cfg", CHECKPOINTED, ids=("numpy_function", "auto"))
def test_checkpoint_resumes_byte_identically(cfg):
    """A pipeline restored from state_dict sends what one that never stopped sends, on either backend."""
    steady = drtf.build(cfg)
    encode = tf.function(lambda p, x: p.encode(x, name="layer/kernel", step=p.iterations))
    for step in range(3):
        encode(steady, tf.constant(grad(step)))
        steady.iterations.assign_add(1)
    state = steady.state_dict()
    assert state["step"] == 3 and set(state["compression"]["memory"]["residuals"]) == {"layer/kernel"}
    resumed = [drtf.build(cfg, backend=backend) for backend in ("numpy_function", "auto")]
    for pipe in resumed:
        pipe.load_state_dict(state)
        assert int(pipe.iterations.numpy()) == 3
        np.testing.assert_array_equal(pipe.residual("layer/kernel"), steady.residual("layer/kernel"))
    for step in range(3, 6):
        expected = encode(steady, tf.constant(grad(step))).numpy()
        for pipe in resumed:
            assert np.array_equal(encode(pipe, tf.constant(grad(step))).numpy(), expected), f"step {step}"
            pipe.iterations.assign_add(1)
        steady.iterations.assign_add(1)
    with pytest.raises(deepreduce.ConfigError, match="another config"):
        drtf.build(RANDOMK if cfg is not RANDOMK else CHECKPOINTED[1]).load_state_dict(state)


def test_ops_update_the_residual_in_place():
    """The encode op writes into its residual variable: no assignment of a new residual per step,
    and a residual read before a step keeps its values (the op copies a buffer a reader shares)."""
    cfg = CHECKPOINTED[1]
    try:
        pipe = drtf.build(cfg, backend="tf-ops")
    except deepreduce.BackendUnavailableError as exc:
        pytest.skip(f"TensorFlow custom ops are not available: {exc}")
    encode = tf.function(lambda x, s: pipe.encode(x, name="w", step=s))
    encode(tf.constant(grad(0)), tf.constant(0, tf.int64))
    before = pipe._ops._residuals["w"].read_value()   # a live tensor sharing the variable's buffer
    snapshot = before.numpy().copy()
    encode(tf.constant(grad(1)), tf.constant(1, tf.int64))
    np.testing.assert_array_equal(before.numpy(), snapshot)
    assert not np.array_equal(pipe.residual("w"), snapshot)
    graph = encode.get_concrete_function(tf.TensorSpec((40, 60)), tf.TensorSpec([], tf.int64)).graph.as_graph_def()
    kinds = [node.op for node in graph.node]
    assert "AssignVariableOp" not in kinds and "ReadVariableOp" not in kinds
