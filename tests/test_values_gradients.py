"""Saved real gradients: the committed file, the capture function and ``bench --gradient``."""
from __future__ import annotations

import os

import numpy as np
import pytest

from deepreduce.cli import main
from deepreduce.errors import ConfigError, DeepReduceError
from experiments import gradients


def test_committed_file_holds_the_fig10_conv_gradient():
    assert os.path.getsize(gradients.DEFAULT_PATH) < 5 * 2**20
    grads = gradients.load()
    conv = grads[gradients.DEFAULT_GRADIENT]
    assert conv.shape == (64, 64, 3, 3) and conv.size == 36_864 and conv.dtype == np.float32
    assert np.isfinite(conv).all() and np.count_nonzero(conv) > 0.9 * conv.size
    assert grads["all"].size == 269_722          # every ResNet-20 parameter


def test_unknown_names_and_missing_files_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="available"):
        gradients.get("no.such.layer")
    with pytest.raises(DeepReduceError, match="capture-gradients"):
        gradients.load(str(tmp_path / "missing.npz"))


def test_capture_and_save_round_trip(tmp_path):
    pytest.importorskip("torch")
    grads = gradients.capture(steps=1, batch_size=8)
    assert grads["layers.7.conv1.weight"].shape == (64, 64, 3, 3)
    assert grads["all"].size == sum(g.size for k, g in grads.items() if k != "all")
    path = gradients.save(grads, str(tmp_path / "g.npz"))
    back = gradients.load(path)
    np.testing.assert_array_equal(back["fc.weight"], grads["fc.weight"])


def test_bench_uses_a_real_gradient(capsys):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert main(["bench", os.path.join(root, "configs", "polyfit.yaml"), "--gradient",
                 gradients.DEFAULT_GRADIENT, "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "layers.7.conv1.weight" in out and "polyfit" in out and "36864" in out
    assert main(["bench", "--gradient", "list"]) == 0
    assert "all" in capsys.readouterr().out
