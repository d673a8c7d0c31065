"""The DDP hook on the torch device path, 2 real gloo ranks (torch.multiprocessing spawn), with the
model on the CPU and, where a GPU is present, on CUDA (both ranks on cuda:0; workers/torch_ddp_device.py)."""
import os
import sys

import numpy as np
import pytest
import torch
from conftest import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import torch_ddp_device as worker  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def ranks(request):
    return request.param, spawn_ranks(worker.run, request.param)


def test_lossless_hook_on_the_device_matches_ddp_allreduce(ranks):
    _, results = ranks
    assert results[0]["lossless_max_diff"] < 1e-5 and results[1]["lossless_max_diff"] < 1e-5


def test_sparse_hook_on_the_device_trains_alike_on_both_ranks(ranks):
    device, results = ranks
    r0, r1 = results[0], results[1]
    assert r0["param_devices"] == r1["param_devices"] == [device]
    assert r0["pipeline_path"] == "device"
    np.testing.assert_array_equal(r0["sparse_params"], r1["sparse_params"])
    assert np.isfinite(r0["sparse_losses"]).all() and np.isfinite(r1["sparse_losses"]).all()
    # Top-5% with a P0 Bloom index and raw values has a device implementation end to end
    assert r0["host_fallback_warnings"] == [] and r1["host_fallback_warnings"] == []
