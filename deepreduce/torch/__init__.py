"""PyTorch binding: pipelines over torch tensors and a Horovod-compatible DistributedOptimizer."""
from .gradiveq import GradiVeQ
from .optimizer import DistributedOptimizer
from .pipeline import TorchPipeline, build

__all__ = ["DistributedOptimizer", "GradiVeQ", "TorchPipeline", "build"]
