"""Import policy for the optional C++ extensions (``deepreduce._<name>``).

``load("bloom")`` returns the compiled module, or None with one warning that says how to build
it; codecs then run their NumPy path, which produces the same bytes. Setting the environment
variable ``DEEPREDUCE_BACKEND=numpy`` forces every codec onto its NumPy path (tests compare
both). ``active_backends()`` reports what is loaded.
"""
from __future__ import annotations

import importlib
import os
import warnings
from typing import Dict, Optional

_cache: Dict[str, Optional[object]] = {}

BUILD_HINT = "build it with `make setup` (or `pip install -e . --no-build-isolation`) from the project root"


def forced_numpy() -> bool:
    return os.environ.get("DEEPREDUCE_BACKEND", "").lower() == "numpy"


def load(name: str):
    """The extension module ``deepreduce._<name>``, or None (NumPy fallback)."""
    if forced_numpy():
        return None
    if name not in _cache:
        try:
            _cache[name] = importlib.import_module(f"deepreduce._{name}")
        except ImportError as exc:
            warnings.warn(
                f"deepreduce C++ extension '_{name}' is not available ({exc}); using the slower NumPy path. "
                + BUILD_HINT,
                RuntimeWarning,
                stacklevel=2,
            )
            _cache[name] = None
    return _cache[name]


def active_backends() -> Dict[str, str]:
    """For each extension tried so far: "c++" or "numpy"."""
    return {name: ("numpy" if module is None or forced_numpy() else "c++") for name, module in _cache.items()}
