"""PyTorch binding: pipelines over torch tensors and a Horovod-compatible DistributedOptimizer."""
from .optimizer import DistributedOptimizer
from .pipeline import TorchPipeline, build

__all__ = ["DistributedOptimizer", "TorchPipeline", "build"]
