"""The project's lint and format rules hold: ruff (pyproject.toml's [tool.ruff]) over the Python
sources and clang-format (.clang-format) over csrc/. The tools are pinned in requirements.txt."""
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PYTHON_TREES = ["deepreduce", "experiments", "tests", "examples", "scripts", "setup.py"]


def tool(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def test_ruff_finds_nothing():
    proc = subprocess.run([tool("ruff"), "check", "--no-cache", *PYTHON_TREES], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_lints_every_python_file_of_the_library_and_the_harness():
    """No folder of deepreduce/ or experiments/ is skipped by an exclude rule (ruff's default list
    names common folder names such as dist, build and venv, and once hid deepreduce/dist/)."""
    proc = subprocess.run([tool("ruff"), "check", "--no-cache", "--show-files", "deepreduce", "experiments"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    linted = {Path(line).resolve() for line in proc.stdout.splitlines() if line.strip()}
    sources = {p.resolve() for tree in ("deepreduce", "experiments") for p in (ROOT / tree).rglob("*.py")}
    assert len(sources) > 100
    assert sorted(map(str, sources - linted)) == []


def test_csrc_is_clang_formatted():
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".h"))
    assert sources
    proc = subprocess.run([tool("clang-format"), "--dry-run", "--Werror", *sources], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
