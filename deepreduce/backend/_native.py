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


_VARIABLE = "DEEPREDUCE_BACKEND"
# ``load`` runs several times per tensor per step, and ``os.environ.get`` of an unset variable
# costs about a microsecond (a KeyError raised and caught inside the mapping). CPython's
# ``os.environ`` keeps its entries in the dict ``_data`` under encoded keys, updated by every
# assignment, ``del``, ``monkeypatch.setenv`` and ``mock.patch.dict``; reading that dict gives
# the same answer in a tenth of the time. Elsewhere the public mapping is read.
_ENV_DATA = getattr(os.environ, "_data", None)
try:
    _ENV_KEY = os.environ.encodekey(_VARIABLE)
    _decode_value = os.environ.decodevalue
except AttributeError:
    _ENV_DATA = None


def forced_numpy() -> bool:
    """Whether ``DEEPREDUCE_BACKEND=numpy`` (any case) is set now."""
    if _ENV_DATA is None:
        return os.environ.get(_VARIABLE, "").lower() == "numpy"
    value = _ENV_DATA.get(_ENV_KEY)
    return value is not None and _decode_value(value).lower() == "numpy"


def load(name: str):
    """The extension module ``deepreduce._<name>``, or None (NumPy fallback)."""
    if forced_numpy():
        return None
    module = _cache.get(name, _cache)
    if module is not _cache:
        return module
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
