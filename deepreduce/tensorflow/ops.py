"""The TensorFlow custom-op library: loaded once, with an error that says how to rebuild it.

``scripts/build_tf_ops.sh`` compiles every ``csrc/*/tf_*.cpp`` (``REGISTER_OP`` + ``OpKernel``)
together with the pure C++ sources of the same folders (the functions the pybind11 extension
wraps too) into ``deepreduce/tensorflow/_deepreduce_ops.so``, against the installed TensorFlow
with ``tf.sysconfig`` flags. ``make setup`` runs it.

:func:`load` returns the op module (cached); :func:`available` tells whether it loads.
If the library is missing or was built against another TensorFlow (an upgrade changes the
ABI), :func:`load` raises :class:`~deepreduce.BackendUnavailableError` naming the rebuild
command. The TF pipeline itself never needs the ops: without them it runs every codec through
``tf.numpy_function`` over the NumPy core (same bytes, see :mod:`.pipeline`).
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Optional

import tensorflow as tf

from .._native import forced_numpy
from ..errors import BackendUnavailableError

LIBRARY_NAME = "_deepreduce_ops.so"
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)
REBUILD_HINT = (
    "rebuild the TensorFlow custom ops against the installed TensorFlow with "
    "`bash scripts/build_tf_ops.sh` (or `make setup`) from the deepreduce project root"
)

_lock = threading.Lock()
_state = {"module": None, "error": None, "warned": False}


def load():
    """The loaded op module (``tf.load_op_library``), loaded at most once per process."""
    with _lock:
        if _state["module"] is not None:
            return _state["module"]
        if _state["error"] is not None:
            raise BackendUnavailableError(_state["error"])
        if not os.path.isfile(LIBRARY_PATH):
            _state["error"] = f"TensorFlow custom ops {LIBRARY_PATH} are not built; {REBUILD_HINT}"
            raise BackendUnavailableError(_state["error"])
        try:
            _state["module"] = tf.load_op_library(LIBRARY_PATH)
        except (tf.errors.NotFoundError, tf.errors.OpError, OSError) as exc:
            _state["error"] = (
                f"TensorFlow custom ops {LIBRARY_PATH} could not be loaded into TensorFlow "
                f"{tf.__version__} ({str(exc).strip()}); they were probably built against another "
                f"TensorFlow version; {REBUILD_HINT}"
            )
            raise BackendUnavailableError(_state["error"]) from exc
        return _state["module"]


def available() -> bool:
    """Whether the custom ops load (and ``DEEPREDUCE_BACKEND=numpy`` does not force NumPy)."""
    if forced_numpy():
        return False
    try:
        load()
    except BackendUnavailableError:
        return False
    return True


def _warn_once(message: str) -> None:
    if not _state["warned"]:
        _state["warned"] = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def accelerator_for(core) -> Optional[object]:
    """The custom-op encoder for ``core``'s codecs, or None when the numpy_function path is used.

    None when no codec of the config has a TF op, when ``DEEPREDUCE_BACKEND=numpy``, or when the
    library does not load (then a warning says how to rebuild it).
    """
    return None
