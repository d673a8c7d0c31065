"""Run NumPy-core code with the default floating-point environment inside TensorFlow's threads.

TensorFlow runs graph ops (a ``tf.numpy_function`` included) on threads that flush denormal
floats to zero (the x86 FTZ/DAZ bits). The NumPy core computes on the main thread's default
IEEE environment, so code that meets a denormal (a SIDCo fit on a mostly-zero tensor, for
example) would write other bytes inside ``tf.function`` than eagerly or in the core.
:func:`default_floating_point` switches the calling thread to the C library's default
environment (``fesetenv(FE_DFL_ENV)``) and restores TensorFlow's afterwards.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

_FE_DFL_ENV = ctypes.c_void_p(-1)   # glibc: #define FE_DFL_ENV ((const fenv_t *) -1)
_FENV_BYTES = 64                    # >= sizeof(fenv_t) on every glibc target (32 on x86-64)


def _load_libm():
    name = ctypes.util.find_library("m")
    if name is None:
        return None
    try:
        libm = ctypes.CDLL(name)
        libm.fegetenv.argtypes = libm.fesetenv.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libm


_LIBM = _load_libm()


@contextlib.contextmanager
def default_floating_point():
    """The block runs with the default floating-point environment (denormals kept)."""
    if _LIBM is None:
        yield
        return
    saved = ctypes.create_string_buffer(_FENV_BYTES)
    _LIBM.fegetenv(saved)
    _LIBM.fesetenv(_FE_DFL_ENV)
    try:
        yield
    finally:
        _LIBM.fesetenv(saved)
