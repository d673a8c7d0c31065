"""deepreduce: compressed communication of sparse gradient tensors (DeepReduce and friends).

Quick use::

    import deepreduce
    pipe = deepreduce.build("configs/topk_raw.yaml")
    payload = pipe.encode(grad, name="conv1.weight", step=0)   # 1-D uint8 container
    dense = pipe.decode(payload)                               # float32, grad's shape
"""
from .config import build, load_config
from .errors import (
    BackendUnavailableError,
    CommunicationError,
    ConfigError,
    ContainerError,
    DeepReduceError,
    NonFiniteGradientError,
)
from .pipeline import Pipeline
from .stats import CompressionStats
from .wire.container import inspect

__version__ = "0.1.0"

__all__ = [
    "build", "load_config", "inspect", "Pipeline", "CompressionStats",
    "DeepReduceError", "ConfigError", "ContainerError", "NonFiniteGradientError",
    "CommunicationError", "BackendUnavailableError", "__version__",
]
