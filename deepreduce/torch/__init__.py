"""PyTorch binding: pipelines over torch tensors and a Horovod-compatible DistributedOptimizer."""
from .diloco import DiLoCo
from .gradiveq import GradiVeQ
from .optimizer import DistributedOptimizer
from .pipeline import TorchPipeline, build

__all__ = ["DiLoCo", "DistributedOptimizer", "GradiVeQ", "TorchPipeline", "build"]
