"""The TensorFlow reducer on real ranks (mpirun; each worker arms a watchdog, so a hang fails with
the ranks' stacks): one rank's caught encode error (workers/tf_caught_error.py) and native
IndexedSlices gradients (workers/tf_indexed_slices.py), the ``auto`` aggregation on 2 ranks and the
sparse all-reduce against the allgather on 4 (workers/tf_aggregations.py)."""
from conftest import run_ranks


def test_one_ranks_caught_encode_error_skips_the_step_everywhere_and_the_next_is_in_phase():
    out = run_ranks("mpirun", "tf_caught_error.py", timeout=280).stdout
    for mode in ("eager", "function", "optimizer"):
        for config in ("raise", "propagate"):
            assert out.count(f"OK caught_error {mode} {config} ") == 2, (mode, config, out[-2000:])


def test_indexed_slices_travel_as_entries_and_equal_horovods_result():
    out = run_ranks("mpirun", "tf_indexed_slices.py", timeout=280).stdout
    for case in ("tape", "optimizer", "fit", "residual"):
        assert out.count(f"OK slices {case} ") == 2, (case, out[-2000:])


def test_auto_aggregation_plans_once_the_same_everywhere_and_is_followed():
    out = run_ranks("mpirun", "tf_aggregations.py", "auto", timeout=280).stdout
    for mode in ("eager", "function"):
        assert out.count(f"OK auto {mode} ") == 2, (mode, out[-2000:])
    assert out.count("deepreduce auto aggregation, after step 0:") == 2   # once per run, by rank 0 only


def test_four_ranks_sparse_allreduce_without_reselection_equals_the_allgather():
    out = run_ranks("mpirun", "tf_aggregations.py", "exact", np_=4, timeout=280).stdout
    for mode in ("eager", "function"):
        assert out.count(f"OK exact {mode} ") == 4, (mode, out[-2000:])


def test_tape_routes_follow_the_nonfinite_policy_and_survive_a_caught_error():
    """TF tape, 2 ranks, eagerly and in tf.function: one rank's NaN gradient under ``propagate``
    and ``raise``, and one rank's error in the step engine's host routes, end the same way on
    the allgather, entries (IndexedSlices), sparse_allreduce (after backward and started during it),
    dense and fp16 routes; a summable
    compressor (Horovod's fp16, GradiVeQ) on the engine's summable route equals Horovod's own tape
    bit for bit, propagates a NaN, and one rank's compress error makes every rank raise with the
    weights unchanged and the next step in phase (workers/tf_engine_policies.py)."""
    out = run_ranks("mpirun", "tf_engine_policies.py", timeout=600).stdout
    for route in ("summable_fp16", "summable_gradiveq"):
        for mode in ("eager", "function"):
            assert out.count(f"OK tf {route} {mode} ") == 2, (route, mode, out[-2000:])
    for route in ("allgather", "entries", "sparse_allreduce", "sparse_allreduce_early", "dense", "fp16"):
        for policy in ("propagate", "raise"):
            for mode in ("eager", "function"):
                assert out.count(f"OK tf {route} {policy} {mode} ") == 2, (route, policy, mode, out[-2000:])
