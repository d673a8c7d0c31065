"""The ``deepreduce`` command line finds its commands: the library's own modules, and the
sub-commands that installed distributions declare in the entry point group ``deepreduce.commands``
(the experiment harness does, in a development checkout set up by ``make setup``)."""
import re
import subprocess
import sys
import tomllib

import pytest
from conftest import ROOT

from deepreduce.cli import COMMANDS, build_parser, main, plugins


def install_plugin(site, dist: str, entry: str, module: str = "", code: str = "") -> None:
    """A distribution as an installer leaves it: ``<dist>-1.0.dist-info`` with its entry points, and
    its code, in a folder that the test puts on ``sys.path``."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{COMMANDS}]\n{entry}\n")
    if module:
        (site / f"{module}.py").write_text(code)


HELLO = '''
def register(subparsers):
    parser = subparsers.add_parser("hello-plugin", help="a plugin's command")
    parser.add_argument("--code", type=int, default=0)
    parser.set_defaults(func=lambda args: args.code)
'''


def commands_in_usage(text: str) -> list:
    """The sub-command names of argparse's usage line ``{a,b,c}``."""
    match = re.search(r"\{([\w,-]+)\}", text)
    assert match, text
    return match.group(1).split(",")


def test_a_plugin_entry_point_adds_its_commands_beside_the_library_own(tmp_path, monkeypatch):
    install_plugin(tmp_path, "hello_plugin", "hello = hello_cmds:register", "hello_cmds", HELLO)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "hello" in [entry.name for entry in plugins()]
    assert main(["hello-plugin", "--code", "7"]) == 7
    assert {"inspect", "hello-plugin"} <= set(commands_in_usage(build_parser().format_usage()))


def test_a_plugin_whose_module_is_gone_is_skipped_with_a_note_that_names_it(tmp_path, monkeypatch, capsys):
    install_plugin(tmp_path, "stale_plugin", "stale = no_such_module_anywhere:register")
    monkeypatch.syspath_prepend(str(tmp_path))
    commands = commands_in_usage(build_parser().format_usage())
    assert "inspect" in commands
    err = capsys.readouterr().err
    assert "plugin 'stale'" in err and "stale_plugin" in err and "no_such_module_anywhere" in err
    assert "pip uninstall stale_plugin" in err


def test_a_plugin_that_fails_otherwise_raises(tmp_path, monkeypatch):
    """A bug in a plugin is not hidden behind the note for a missing checkout."""
    install_plugin(tmp_path, "buggy_plugin", "buggy = buggy_cmds:register", "buggy_cmds",
                   "def register(subparsers):\n    raise RuntimeError('the plugin is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="the plugin is broken"):
        build_parser()


def test_the_harness_declares_its_commands_in_the_group_the_cli_reads():
    with open(ROOT / "scripts" / "harness" / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["entry-points"] == {COMMANDS: {"experiments": "experiments.cli:register"}}


def test_the_development_checkout_lists_the_harness_commands():
    """``python -m deepreduce --help`` in this checkout: the library's ``inspect`` and every command of
    experiments/cli/, through the registration ``make setup`` installs (re-run it if this fails)."""
    import argparse

    import experiments.cli

    harness = argparse.ArgumentParser().add_subparsers()
    experiments.cli.register(harness)
    expected = {"inspect", *harness.choices}
    assert {"bench", "bench-step", "bench-scaling", "reproduce"} <= expected
    proc = subprocess.run([sys.executable, "-m", "deepreduce", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(commands_in_usage(proc.stdout)) == expected, (
        "the harness's commands are missing: run `make setup` (it installs scripts/harness)\n" + proc.stderr[-2000:])
