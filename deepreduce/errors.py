"""The one exception hierarchy of deepreduce.

Every error the library raises on purpose derives from :class:`DeepReduceError`, so a training
script can catch compression problems without catching unrelated bugs. The subclasses say which
stage failed; their messages name the offending key, id, tensor or byte offset.
"""


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
