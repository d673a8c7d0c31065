"""The DDP hook on the torch device path, real ranks (torch.multiprocessing spawn; workers/torch_ddp_device.py):
2 gloo ranks with the model on the CPU and, where a GPU is present, 2 gloo ranks on cuda:0 and one
NCCL rank on it (NCCL takes one rank per GPU: the containers travel as CUDA tensors through NCCL's
all-gather and all-to-all)."""
import os
import sys

import numpy as np
import pytest
import torch
from conftest import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import torch_ddp_device as worker  # noqa: E402

LAYOUTS = [("cpu", "gloo", 2)] + ([("cuda", "gloo", 2), ("cuda", "nccl", 1)] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda layout: f"{layout[0]}-{layout[1]}-{layout[2]}")
def ranks(request):
    device, backend, world = request.param
    return device, spawn_ranks(worker.run, device, backend, world=world)


def test_lossless_hook_on_the_device_matches_ddp_allreduce(ranks):
    _, results = ranks
    for result in results.values():
        assert result["lossless_max_diff"] < 1e-5 and result["sparse_allreduce_max_diff"] < 1e-5


def test_sparse_hook_on_the_device_trains_alike_on_every_rank(ranks):
    device, results = ranks
    for result in results.values():
        assert result["param_devices"] == [device] and result["pipeline_path"] == "device"
        np.testing.assert_array_equal(result["sparse_params"], results[0]["sparse_params"])
        assert np.isfinite(result["sparse_losses"]).all()
        # per_parameter=False: one container per DDP bucket (the fast layout on a GPU)
        np.testing.assert_array_equal(result["bucketed_params"], results[0]["bucketed_params"])
        assert np.isfinite(result["bucketed_losses"]).all()
        assert not np.array_equal(result["bucketed_params"], result["sparse_params"])   # another selection
        # Top-5% with a P0 Bloom index and raw values has a device implementation end to end
        assert result["host_fallback_warnings"] == []


def test_diloco_on_the_device_keeps_every_worker_on_the_same_global_parameters(ranks):
    device, results = ranks
    for result in results.values():
        assert np.isfinite(result["diloco_losses"]).all()
        assert result["diloco_devices"] == [device] and result["diloco_outer_steps"] >= 4
        # θ_global after 6 inner steps (H = 2, 2 fragments applied a step late) is every worker's
        np.testing.assert_array_equal(result["diloco_globals"], results[0]["diloco_globals"])
