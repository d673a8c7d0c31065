"""Real multi-process runs: 2 ranks under horovodrun and under mpirun."""
import pytest
from conftest import run_ranks


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_lossless_optimizer_matches_single_process_on_averaged_gradient(launcher):
    out = run_ranks(launcher, "torch_optimizer_equivalence.py", "configs/none_raw.yaml")
    assert out.stdout.count("OK") == 2


def test_topk_bytes_on_the_wire_equal_documented_size():
    out = run_ranks("horovodrun", "topk_wire_bytes.py")
    assert out.stdout.count("OK") == 2


def test_mpi4py_communicator_gathers_variable_sizes():
    out = run_ranks("mpirun", "mpi_communicator.py")
    assert out.stdout.count("OK") == 2


@pytest.fixture(scope="module")
def agreement_run():
    """One launch of workers/rank_agreement.py (every scenario); a hang fails at the timeout."""
    return run_ranks("horovodrun", "rank_agreement.py", timeout=240).stdout


@pytest.mark.parametrize("scenario", ["wider_layer", "extra_layer", "mixed_compressors"])
def test_ranks_that_disagree_fail_together_within_seconds(agreement_run, scenario):
    # the worker checks the message (the first difference), the time and that both ranks raised it
    assert agreement_run.count(f" {scenario} ") == 2


def test_nonfinite_step_is_skipped_on_every_rank_and_training_goes_on(agreement_run):
    assert agreement_run.count(" nonfinite_skip ") == 2


def test_background_encoder_and_device_path_match_synchronous_path_and_surface_worker_errors():
    out = run_ranks("horovodrun", "torch_background_encode.py")
    assert out.stdout.count("OK") == 2


def test_bucketed_optimizer_sends_each_bucket_as_one_container_of_its_concatenated_gradient():
    out = run_ranks("horovodrun", "torch_buckets.py")
    assert out.stdout.count("OK") == 2


def test_one_ranks_caught_encode_error_keeps_every_rank_in_phase():
    """A float64 gradient beyond float32's range on one rank: every rank raises from step(), the
    user's skip-the-step loop goes on, the next steps work and the ranks stay identical."""
    out = run_ranks("horovodrun", "torch_caught_error.py")
    assert out.stdout.count("OK caught_error") == 2



def test_nonfinite_policy_and_caught_encode_error_give_one_outcome_on_every_route():
    """Horovod optimizer, 2 ranks, every route of the step engine (allgather, sparse_allreduce after backward and started during it,
    dense, fp16, entries, summable) under ``propagate`` and ``raise``: one rank's NaN gradient and
    one rank's encode error end the same way on every route and every rank, and the ranks stay
    in phase (workers/torch_engine_policies.py)."""
    out = run_ranks("horovodrun", "torch_engine_policies.py", timeout=400).stdout
    for route in ("allgather", "sparse_allreduce", "sparse_allreduce_early", "dense", "fp16", "entries", "summable"):
        for policy in (("propagate",) if route == "summable" else ("propagate", "raise")):
            for scenario in ("nan", "encode_error"):
                assert out.count(f"OK {scenario} {route} {policy} ") == 2, (route, policy, scenario, out[-2000:])
