"""The launcher of the multi-process tests (conftest.spawn_ranks): a rank that dies without a
result fails the launch at once, a hang fails it at the timeout with every rank's stack, and
either failure shows each rank's exit code and the end of its log; a job launched by horovodrun that
outlives its timeout is ended with every rank it started. A CI run once waited 200 s on a hung
launch and reported only ``_queue.Empty``; these keep that from coming back."""
import os
import sys
import time

import pytest
from conftest import run_ranks, spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import harness_probe as probe  # noqa: E402


def test_every_rank_reports():
    results = spawn_ranks(probe.run_ok, world=2, timeout=60)
    assert {rank: r["rank"] for rank, r in results.items()} == {0: 0, 1: 1}
    assert results[0]["port"] == results[1]["port"]


def test_a_rank_that_dies_fails_the_launch_at_once_with_its_log():
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        spawn_ranks(probe.run_one_rank_dies, world=2, timeout=120)
    message = str(failure.value)
    assert "rank(s) [1] exited without a result" in message
    assert "exit codes [" in message and ", 3]" in message
    assert "rank 1 gives up" in message                      # the dead rank's own stderr
    assert "run_one_rank_dies" in message                    # the live rank's stack, asked for
    assert time.monotonic() - started < 60                   # not the 120 s timeout


def test_a_hang_fails_at_the_timeout_with_every_ranks_stack():
    with pytest.raises(pytest.fail.Exception) as failure:
        spawn_ranks(probe.run_hang, world=2, timeout=3)
    message = str(failure.value)
    assert "rank(s) [0, 1] still running after 3 s (a hang)" in message
    assert message.count("wait_for_a_peer_that_never_comes") >= 2   # both ranks' stacks


def _processes_running(script: str) -> list:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if script.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_a_hung_horovodrun_job_is_ended_with_every_rank_it_started():
    """horovodrun starts mpirun in a session of its own, and mpirun puts each rank in a process
    group of its own: only the process tree reaches the ranks (experiments.processes.kill_tree)."""
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks("horovodrun", "harness_hang.py", np_=2, timeout=20)
    message = str(failure.value)
    assert "still running after 20 s (a hang)" in message
    assert message.count("harness_hang: started") == 2      # both ranks were up when it was ended
    deadline = time.monotonic() + 10
    while _processes_running("harness_hang.py") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_running("harness_hang.py") == []


def test_the_rendezvous_port_is_free_and_below_the_ephemeral_range():
    """Below the range, neither another socket bound to port 0 nor a connection's source port can
    take it before rank 0 binds it (experiments.processes.rendezvous_port)."""
    import socket

    from experiments.processes import FALLBACK_EPHEMERAL_LOW, LOWEST_PORT, rendezvous_port

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:
        low = FALLBACK_EPHEMERAL_LOW
    ports = {rendezvous_port() for _ in range(20)}
    assert all(LOWEST_PORT <= port < low for port in ports)
    assert len(ports) > 1                                     # drawn, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))                    # free when handed out
