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


def test_shape_mismatch_across_ranks_is_reported():
    out = run_ranks("horovodrun", "shape_mismatch.py")
    assert out.stdout.count("OK") == 2


def test_background_encoder_and_device_path_match_synchronous_path_and_surface_worker_errors():
    out = run_ranks("horovodrun", "torch_background_encode.py")
    assert out.stdout.count("OK") == 2
