"""2-rank horovodrun test of the TensorFlow tape, optimizer, Keras callbacks and GradiVeQ, in one launch
(TensorFlow starts slowly; worker: tests/workers/tf_tape_equivalence.py)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)


def _horovodrun():
    candidate = os.path.join(VENV_BIN, "horovodrun")
    return candidate if os.path.exists(candidate) else shutil.which("horovodrun")


def run_workers(script, out_path, timeout=600):
    """Run a worker under ``horovodrun -np 2``; it writes rank 0's results as JSON to ``out_path``."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    cmd = [_horovodrun(), "-np", "2", "-H", "localhost:2", sys.executable, os.path.join(ROOT, "tests", "workers", script),
           str(out_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and os.path.exists(out_path), \
        f"horovodrun failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(out_path, encoding="utf-8") as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    pytest.importorskip("horovod.tensorflow")
    if _horovodrun() is None:
        pytest.skip("horovodrun is not installed (run `make setup`)")
    return run_workers("tf_tape_equivalence.py", tmp_path_factory.mktemp("tf_tape") / "result.json")


def test_two_ranks_ran(result):
    assert result["size"] == 2


@pytest.mark.parametrize("mode", ["eager", "function", "optimizer", "legacy_optimizer", "allreduce",
                                  "sparse_allreduce_eager", "sparse_allreduce_function"])
def test_raw_codecs_equal_single_process_on_averaged_gradient(result, mode):
    r = result[mode]
    assert r["ranks_identical"]
    assert r["changed"] > 1e-3          # the steps did move the weights
    assert r["max_abs_diff"] <= 1e-6    # and exactly as one process on the average would


def test_sum_op_equals_single_process_on_summed_gradient(result):
    assert result["sum"]["ranks_identical"]
    assert result["sum"]["max_abs_diff"] <= 1e-6


def test_encode_runs_every_step_inside_tf_function(result):
    # 3 steps x 4 variables: the numpy_function encode is a graph op, not a trace-time call
    assert result["function_tensors_encoded"] == 12
    assert result["function_wire_bytes"] > 0


def test_topk_keeps_ranks_identical_and_compresses(result):
    assert result["topk"]["ranks_identical"]
    assert result["topk"]["changed"] > 1e-3
    assert result["topk_relative_volume"] < 0.5


def test_registered_local_source_is_not_communicated(result):
    assert result["local_source"]["global_max_abs_diff"] <= 1e-6
    assert result["local_source"]["local_max_abs_diff"] <= 1e-7


def test_bloom_config_keeps_ranks_identical(result):
    assert result["bloom"]["ranks_identical"]
    assert result["bloom"]["changed"] > 1e-3
    assert result["bloom_backend"] in ("tf-ops", "numpy_function")


@pytest.mark.parametrize("mode", ["inside_function", "inside_eager_dict"])
def test_tape_created_inside_the_step_from_a_config(result, mode):
    """Horovod's TF2 pattern: the wrapper is created in the (compiled) step from a path or dict."""
    r = result[mode]
    assert r["ranks_identical"] and r["changed"] > 1e-3 and r["max_abs_diff"] <= 1e-6
    assert result[f"{mode}_warnings"] == []


def test_tape_inside_function_keeps_one_counter(result):
    # the pipeline's own counter advanced once per step: one variable, created on the first trace
    assert result["inside_function_counter"] == 3


def test_gradient_accumulation_equals_one_step_on_the_summed_gradients(result):
    r = result["accumulation"]
    assert r["ranks_identical"] and r["changed"] > 1e-3
    assert r["max_abs_diff"] <= 1e-6


def test_accumulation_counts_applied_steps(result):
    assert result["accumulation_iterations"] == 2   # 4 micro-batches, 2 passes each


def test_gradiveq_is_a_summable_compressor_in_horovods_own_tape(result):
    r = result["gradiveq"]
    assert r["ranks_identical"] and r["changed"] > 1e-3
    stats = r["stats"]
    # warm-up 1 + sampling 2, then trained once and w1 sent as codes in the last 3 steps
    assert stats["trainings"] == 1 and stats["compressed"] == 3
    assert stats["sent_elements"] < stats["dense_elements"]


def test_keras_fit_starts_from_rank0_weights_and_ends_identical(result):
    r = result["fit"]
    assert r["ranks_started_apart"]          # the ranks built different weights ...
    assert r["start_is_rank0"]               # ... and the first step started from rank 0's
    assert r["ranks_identical"] and r["changed"] > 1e-3   # weights and averaged losses agree at the end
    assert r["wire_bytes"] > 0 and r["warnings"] == []


@pytest.mark.parametrize("case, expected", [
    ("extra_variable", "rank 1 has gradient 'disagree_4' (3, 3) float32 that rank 0 lacks"),
    ("mixed", "rank 1 uses GradiVeQ(")])
def test_ranks_that_disagree_fail_together_within_seconds(result, case, expected):
    r = result[case]
    assert "deepreduce.tensorflow: " in r["message"] and expected in r["message"], r["message"]
    assert r["same_on_every_rank"] and r["seconds"] < 20


@pytest.mark.parametrize("mode, kind", [("function", "UnknownError"), ("eager", "NonFiniteGradientError")])
def test_nonfinite_step_is_skipped_on_every_rank(result, mode, kind):
    r = result[f"nonfinite_{mode}"]
    assert [s for s, _ in r["skipped"]] == [1] and r["same_message"] and r["kinds"] == [kind]
    assert "at step 1 has" in r["skipped"][0][1] and "on rank 1" in r["skipped"][0][1]
    assert r["unchanged"] == [True]            # nothing applied, residuals as before the step
    assert r["ranks_identical"] and r["changed"] > 1e-3     # the other steps ran, ranks agree


@pytest.mark.parametrize("backend", ["auto", "numpy_function"])
def test_pipelined_eager_steps_send_the_sequential_bytes(result, backend):
    """Issue 12 part 2: eager chains on 2 worker threads = one tensor after another, byte for byte."""
    r = result[f"pipelined_{backend}"]
    assert r["containers"] == 12              # 3 steps x 4 tensors, every one recorded
    assert r["same_containers"] and r["same_gradients"]
    assert r["ranks_identical"] and r["changed"] > 1e-3
    if backend == "numpy_function":
        assert r["backend"] == "numpy_function"


def test_pipelined_eager_steps_report_hidden_encode_time(result):
    # rank 1 encodes grad_0 late, so rank 0's later encodes run while grad_0's allgather waits
    for backend in ("auto", "numpy_function"):
        r = result[f"pipelined_{backend}"]
        assert 0 < r["hidden"] <= r["eager_encode"]
        assert r["sequential_hidden"] == 0 and r["sequential_encode"] > 0


def test_worker_error_reaches_the_caller_and_the_next_step_works(result):
    r = result["worker_error"]
    assert [e[:2] for e in r["errors"]] == [[1, "InjectedError"]]
    assert "injected in thread deepreduce-chain" in r["errors"][0][2]    # raised on a worker thread
    assert r["steps_applied"] == 2 and r["ranks_identical"] and r["changed"] > 1e-3


@pytest.mark.parametrize("backend", ["auto", "numpy_function"])
def test_compiled_step_encodes_every_tensor_before_the_first_decode(result, backend):
    """TF chains stateful ops without resources (encode, decode) in program order; with every
    encode first, an allgather (no control input) runs while later tensors encode."""
    ops = result[f"graph_order_{backend}"]
    assert [kind for kind, _ in ops].count("encode") == 4 and [kind for kind, _ in ops].count("decode") == 4
    encodes = [i for i, (kind, _) in enumerate(ops) if kind == "encode"]
    decodes = [i for i, (kind, _) in enumerate(ops) if kind == "decode"]
    assert max(encodes) < min(decodes)
    assert all(inputs in ([], ["encode"]) for kind, inputs in ops if kind == "encode")
    assert all(inputs == [] for kind, inputs in ops if kind == "gather")


def test_ranks_with_different_background_settings_meet(result):
    r = result["mixed_background"]
    assert r["ranks_identical"] and r["changed"] > 1e-3 and r["max_abs_diff"] <= 1e-6


def test_buckets_reduce_like_the_core_pipeline_on_the_concatenation(tmp_path):
    pytest.importorskip("horovod.tensorflow")
    r = run_workers("tf_buckets.py", tmp_path / "buckets.json")
    assert r["lossless"] == {"eager": True, "function": True}
    assert r["topk_max_diff"] == 0.0          # the same containers and sums as the NumPy core's
    assert "CommunicationError" == r["mixed"][0] and "bucket" in r["mixed"][1]
    assert "ConfigError" == r["summable"][0] and "bucket_cap_mb" in r["summable"][1]
