"""The one exception hierarchy of deepreduce.

Every error the library raises on purpose derives from :class:`DeepReduceError`, so a training
script can catch compression problems without catching unrelated bugs. The subclasses say which
stage failed; their messages name the offending key, id, tensor or byte offset, and quote a
user's value through :func:`quote` (a short prefix, whatever the value).
"""
import reprlib

#: The most characters of a value an error message quotes.
QUOTE_CHARS = 60
_QUOTER = reprlib.Repr()   # attributes, not keywords: Repr takes keywords from Python 3.12 on
_QUOTER.maxlevel = 2
_QUOTER.maxtuple = _QUOTER.maxlist = _QUOTER.maxdict = _QUOTER.maxset = _QUOTER.maxfrozenset = 4
_QUOTER.maxdeque = _QUOTER.maxarray = 4
_QUOTER.maxstring = _QUOTER.maxlong = _QUOTER.maxother = QUOTE_CHARS


def quote(value) -> str:
    """``repr(value)`` cut to at most :data:`QUOTE_CHARS` characters, in bounded work: nested
    containers are shown two levels deep with four items each (``reprlib``), so a config value
    that expands to millions of items (a YAML alias bomb) is never formatted in full."""
    text = _QUOTER.repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS - 3] + "..."


def size_text(nbytes: float) -> str:
    """A byte count for a message: ``94.6 GiB``, ``512 B``."""
    for unit, scale in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20),
                        ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


class DeepReduceError(Exception):
    """Base class of every error deepreduce raises."""


class ConfigError(DeepReduceError, ValueError):
    """A configuration names an unknown component or parameter, or a value out of range."""


class ContainerError(DeepReduceError):
    """A byte buffer is not a valid container: truncated, corrupted or foreign."""


class NonFiniteGradientError(DeepReduceError, FloatingPointError):
    """A gradient holds NaN or Inf and the pipeline was configured to refuse it."""


class CommunicationError(DeepReduceError):
    """Ranks disagree (tensor shapes, sizes) or a collective returned something unusable."""


class BackendUnavailableError(DeepReduceError, ImportError):
    """An optional compiled backend (C++ extension, TF custom ops, Horovod) cannot be loaded."""
