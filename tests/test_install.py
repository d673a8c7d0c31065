"""A wheel of deepreduce, installed with its ``torch`` extra into a user's own environment that
already has torch.

pip builds the wheel from a copy of the sources with build isolation (pyproject.toml's build
requirements), so the checkout gets no build outputs; the wheel file must hold the shipped
configs as package data. A fresh venv sees this machine's torch through a .pth file (as a user's
environment would have its own), and the wheel is installed into it. The installed package must leave torch
alone, carry its compiled extensions and the shipped configs (loadable by name), import without
Horovod or TensorFlow, and hold the library only: the experiment harness (``experiments/``, in
the sources beside it) is not installed, and the ``deepreduce`` command offers the library's own
commands only.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from conftest import ROOT

CHECK = r"""
import importlib.abc, json, sys

class NoHorovodNoTensorFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("horovod", "tensorflow"):
            raise ImportError(f"{name} is not installed in this environment")
        return None

sys.meta_path.insert(0, NoHorovodNoTensorFlow())
import deepreduce, deepreduce.torch, deepreduce.torch.ddp, torch
from deepreduce.backend import _native
from deepreduce.config import shipped_configs
natives = sys.argv[1].split(",")
configs = {name: deepreduce.build(name).get_config()["sparsifier"]["id"] for name in shipped_configs()}
print(json.dumps({"deepreduce": deepreduce.__file__, "torch": torch.__file__, "torch_version": torch.__version__,
                  "native": {n: _native.load(n) is not None for n in natives}, "configs": sorted(configs)}))
"""


def copy_sources(dest: Path) -> None:
    """What a source distribution holds, without this checkout's build outputs."""
    dest.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("*.so", "*.o", "__pycache__", "build")
    for folder in ("csrc", "deepreduce", "experiments"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)


def test_wheel_with_torch_extra_installs_into_an_environment_that_has_torch(tmp_path):
    src = tmp_path / "src"
    copy_sources(src)
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "users_torch.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-input", "--no-deps", "-w", str(wheels), str(src)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("deepreduce-*.whl")
    shipped = sorted(p.stem for p in (ROOT / "deepreduce" / "configs").glob("*.yaml"))
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = sorted(Path(n).stem for n in archive.namelist() if n.startswith("deepreduce/configs/")
                          and n.endswith(".yaml"))
    assert in_wheel == shipped
    with zipfile.ZipFile(wheel) as archive:                            # the harness registers no command here
        (entry_points,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        assert archive.read(entry_points).decode().split() == ["[console_scripts]", "deepreduce", "=",
                                                               "deepreduce.cli:main"]
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-input",
                              f"deepreduce[torch] @ {wheel.as_uri()}"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    natives = sorted(p.parent.name for p in (ROOT / "csrc").glob("*/py_module.cpp"))
    check = subprocess.run([str(python), "-c", CHECK, ",".join(natives)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    result = json.loads(check.stdout.strip().splitlines()[-1])
    assert Path(result["deepreduce"]).is_relative_to(site)           # the installed copy, not the checkout
    assert (result["torch"], result["torch_version"]) == (torch.__file__, torch.__version__)
    assert not (site / "torch").exists()                              # pip left the user's torch alone
    assert result["native"] == {n: True for n in natives}            # the C++ extensions were built
    assert result["configs"] == shipped and len(shipped) > 20          # every shipped config by name
    assert not (site / "experiments").exists()                         # the harness stays in the sources
    usage = subprocess.run([str(venv / "bin" / "deepreduce"), "--help"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert usage.returncode == 0, usage.stderr[-3000:]
    assert "{inspect}" in usage.stdout                                 # the console command: the library's own only
