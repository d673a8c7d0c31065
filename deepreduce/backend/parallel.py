"""How many threads the C++ kernels of one rank may use (the pipeline option ``threads``).

``threads: auto`` (the default) gives each rank its share of the CPUs this process may run
on: ``len(os.sched_getaffinity(0)) // ranks on this host``, at least 1. The number of ranks on
the host is read from the variables the launchers set: ``OMPI_COMM_WORLD_LOCAL_SIZE``
(mpirun / horovodrun with Open MPI), ``LOCAL_WORLD_SIZE`` (torchrun), ``HOROVOD_LOCAL_SIZE``
(horovodrun with Gloo); without any of them the process is taken to be alone on the host.

Threads only split passes over a tensor into chunks whose results are combined in a fixed
order: the thread count never changes a selected position, a value or a container byte.
"""
from __future__ import annotations

import os
from typing import Union

from ..errors import ConfigError, quote

AUTO = "auto"
MAX_THREADS = 256   # the C++ kernels' bound (csrc/common/checks.h MAX_THREADS; tested equal)
LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE")

ThreadsOption = Union[int, str]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def local_ranks() -> int:
    """Ranks sharing this host, from the launcher's environment (1 when launched alone)."""
    for name in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def check_threads(value: ThreadsOption, owner: str = "config") -> ThreadsOption:
    """``value`` if it is a valid ``threads`` option (a positive int or "auto"), else ConfigError."""
    if isinstance(value, str) and value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ConfigError(f"{owner}: 'threads' must be an integer in [1, {MAX_THREADS}] or 'auto', got {quote(value)}")
    return value


def resolve_threads(value: ThreadsOption) -> int:
    """The thread count an option stands for on this host."""
    value = check_threads(value)
    if value == AUTO:
        return min(MAX_THREADS, max(1, usable_cpus() // local_ranks()))
    return value
