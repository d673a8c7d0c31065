"""Ranks over a shaped link: network namespaces, token-bucket shaping and the rank launcher.

Shared by the experiments that measure training over a constrained network (fig11: time per
iteration; quality: validation loss against wall-clock time). :class:`ShapedLink` creates two
fresh network namespaces joined by one veth pair with private addresses (``10.213.0.1/30`` and
``10.213.0.2/30``) that exist only inside those namespaces, so no traffic can reach any other
interface or host, and ``tc`` shapes both ends with a token bucket (``tbf``).
:func:`launch_ranks` starts one worker process per rank (inside the namespaces when a link is
given, one or several ranks per namespace, over loopback otherwise), each in a session of its own, waits with a deadline and kills
what is left on any exit. Creating namespaces needs root and iproute2;
:func:`namespaces_available` says whether this process can, and if not, why.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from typing import Callable, List, Optional, Sequence, Tuple

NS_ADDRS = ("10.213.0.1", "10.213.0.2")   # a private /30 that exists only inside the namespaces
PREFIX = 30
CMD_TIMEOUT = 20.0
POLL_S = 0.5


def _ip(*args: str, timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise RuntimeError(f"shaped link: {what} failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")


def namespaces_available() -> Tuple[bool, str]:
    """Whether this process can create network namespaces and veth pairs, and if not, why."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "not running as root (network namespaces need CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found (install iproute2)"
    probe = f"drprobe{uuid.uuid4().hex[:8]}"
    try:
        proc = _ip("netns", "add", probe)
        if proc.returncode != 0:
            return False, f"'ip netns add' failed: {proc.stderr.strip()}"
        return True, "ok"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"'ip netns add' failed: {exc}"
    finally:
        try:
            _ip("netns", "del", probe)
        except (OSError, subprocess.TimeoutExpired):
            pass


class ShapedLink:
    """Two network namespaces joined by a veth pair; ``shape(rate)`` sets tbf on both ends.

    Use as a context manager: the namespaces (and with them the veth pair and its qdiscs) are
    deleted on exit, whatever happened inside.
    """

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = (f"drns0-{tag}", f"drns1-{tag}")
        self.dev = (f"drv0{tag}", f"drv1{tag}")   # <= 15 characters
        self.created: List[str] = []

    def __enter__(self) -> "ShapedLink":
        try:
            for ns in self.ns:
                _check(_ip("netns", "add", ns), f"ip netns add {ns}")
                self.created.append(ns)
            _check(_ip("link", "add", self.dev[0], "netns", self.ns[0], "type", "veth",
                       "peer", "name", self.dev[1], "netns", self.ns[1]), "creating the veth pair")
            for ns, dev, addr in zip(self.ns, self.dev, NS_ADDRS):
                _check(_ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", dev), f"address on {dev}")
                _check(_ip("-n", ns, "link", "set", dev, "up"), f"bringing {dev} up")
                _check(_ip("-n", ns, "link", "set", "lo", "up"), f"bringing lo up in {ns}")
        except BaseException:
            self.close()
            raise
        return self

    def shape(self, rate_bits: float) -> None:
        """Token bucket at ``rate_bits`` bit/s on both ends.

        The bucket holds 0.5 ms of traffic (at least 16 KiB): tokens saved while a rank computes
        let that much pass at line rate, so a small bucket keeps the link honest.
        """
        burst = max(int(rate_bits / 8 * 0.0005), 16 * 1024)
        for ns, dev in zip(self.ns, self.dev):
            proc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                                   "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "100ms"],
                                  capture_output=True, text=True, timeout=CMD_TIMEOUT)
            _check(proc, f"tc tbf on {dev}")

    def qdisc(self) -> str:
        proc = subprocess.run(["ip", "netns", "exec", self.ns[0], "tc", "qdisc", "show", "dev", self.dev[0]],
                              capture_output=True, text=True, timeout=CMD_TIMEOUT)
        return proc.stdout.strip()

    def close(self) -> None:
        for ns in reversed(self.created):
            try:
                _ip("netns", "del", ns)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.created = []

    def __exit__(self, *exc) -> None:
        self.close()


def namespaces_of_ours() -> set:
    """The network namespaces that exist now with the names this module gives them (a
    :class:`ShapedLink`'s or the probe's): what tests check is gone after a run."""
    try:
        out = _ip("netns", "list").stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {line.split()[0] for line in out.splitlines() if line.startswith(("drns0-", "drns1-", "drprobe"))}


def package_root() -> str:
    """The directory holding ``experiments/`` (and, in a checkout, ``deepreduce/``)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def master_addr(link: Optional[ShapedLink]) -> str:
    """Rank 0's address as the other rank reaches it: inside the namespaces, else loopback."""
    return NS_ADDRS[0] if link is not None else "127.0.0.1"


def tail(path: str, n: int = 1500) -> str:
    """The last ``n`` characters of a log file (for error messages)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()[-n:]
    except OSError:
        return "(no log)"


def namespace_of(rank: int, per_namespace: int, namespaces: int = 2) -> int:
    """The namespace index of ``rank`` when ``per_namespace`` consecutive ranks share one."""
    if per_namespace < 1:
        raise ValueError(f"shaped link: ranks per namespace must be at least 1, got {per_namespace}")
    index = rank // per_namespace
    if index >= namespaces:
        raise ValueError(f"shaped link: rank {rank} needs namespace {index}, but the link has {namespaces} "
                         f"({per_namespace} rank(s) each)")
    return index


def launch_ranks(link: Optional[ShapedLink], commands: Sequence[List[str]], log_prefix: str, timeout: float,
                 what: str, poll: Optional[Callable[[], None]] = None, per_namespace: int = 1) -> None:
    """Run one command per rank, wait for all; raise if any fails.

    Rank ``r`` runs in ``link.ns[r // per_namespace]``: with ``per_namespace`` 2, four ranks are
    two hosts of two ranks each, and only the traffic between the hosts crosses the shaped veth
    pair (the ranks of one namespace talk over its loopback, as on one machine). Each rank gets
    this checkout on PYTHONPATH, one OpenMP thread, ``LOCAL_WORLD_SIZE`` (all
    ranks share this host: deepreduce's ``threads: auto`` then gives each its share) and
    ``GLOO_SOCKET_IFNAME`` naming its end of the link (``lo`` without one). Output goes to
    ``<log_prefix>.rank<r>.log``. ``poll`` is called every half second while the ranks run
    (progress bars). On a timeout, an error or an interrupt every rank's session is killed.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root(), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(len(commands)))
    procs, logs = [], []
    try:
        for rank, cmd in enumerate(commands):
            where = namespace_of(rank, per_namespace, len(link.ns)) if link is not None else 0
            rank_env = dict(env, GLOO_SOCKET_IFNAME=link.dev[where] if link is not None else "lo")
            if link is not None:
                cmd = ["ip", "netns", "exec", link.ns[where]] + list(cmd)
            log = open(f"{log_prefix}.rank{rank}.log", "w", encoding="utf-8")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for proc in procs):
            failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                rank, code = failed[0]
                raise RuntimeError(f"{what}: rank {rank} exited with {code}: {tail(f'{log_prefix}.rank{rank}.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: ran past {timeout:.0f}s (logs: {log_prefix}.rank*.log)")
            if poll is not None:
                poll()
            time.sleep(POLL_S)
        if poll is not None:
            poll()
        for rank, proc in enumerate(procs):
            if proc.returncode != 0:
                raise RuntimeError(f"{what}: rank {rank} exited with {proc.returncode}: "
                                   f"{tail(f'{log_prefix}.rank{rank}.log')}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait(timeout=CMD_TIMEOUT)
        for log in logs:
            log.close()


def python_module(module: str, *args: str) -> List[str]:
    """The command that runs ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]
