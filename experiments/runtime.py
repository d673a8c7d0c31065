"""Runtime settings that keep Horovod's background machinery from competing with compute.

Horovod's background thread runs a negotiation cycle every ``HOROVOD_CYCLE_TIME`` ms, and Open
MPI, by default, busy-polls while it waits. When ranks share few cores (here: 2 ranks on a
2-core machine) that polling takes CPU time from the forward and backward passes. The values
below were measured on the main job (docs/benchmarks.md, "Runtime settings").

:func:`apply_defaults` sets each variable only where the environment does not already set it,
so anything a user exported wins. It must run before ``hvd.init()`` (which initialises MPI and
reads the Horovod variables).
"""
from __future__ import annotations

import os
from typing import Dict, MutableMapping, Optional

DEFAULTS: Dict[str, str] = {
    # Open MPI: yield the core while waiting in MPI instead of spinning on it.
    "OMPI_MCA_mpi_yield_when_idle": "1",
}


def apply_defaults(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set every :data:`DEFAULTS` entry missing from ``environ`` (default ``os.environ``); return those set."""
    env = os.environ if environ is None else environ
    applied = {key: value for key, value in DEFAULTS.items() if key not in env}
    env.update(applied)
    return applied
