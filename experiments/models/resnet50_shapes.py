"""ResNet-50's parameter shapes (He et al., 2016, ImageNet variant), without building the model.

Benchmarks that need a whole large model's gradient set (``deepreduce bench-step``) take the
layer list from here: torchvision's layout and parameter names (bottleneck blocks with the
stride on the 3x3 convolution, a projection shortcut in the first block of every stage,
biases only in the classifier), 161 tensors and 25,557,032 parameters. Batch-norm running
statistics are buffers, not parameters, so they carry no gradient and are not listed.
"""
from __future__ import annotations

from typing import List, Tuple

BLOCKS_PER_STAGE = (3, 4, 6, 3)
STAGE_WIDTHS = (64, 128, 256, 512)
EXPANSION = 4
STEM_CHANNELS = 64
CLASSES = 1000

Shape = Tuple[int, ...]


def _batch_norm(prefix: str, channels: int) -> List[Tuple[str, Shape]]:
    return [(f"{prefix}.weight", (channels,)), (f"{prefix}.bias", (channels,))]


def _bottleneck(prefix: str, in_channels: int, width: int, projection: bool) -> List[Tuple[str, Shape]]:
    out_channels = width * EXPANSION
    shapes = [(f"{prefix}.conv1.weight", (width, in_channels, 1, 1))] + _batch_norm(f"{prefix}.bn1", width)
    shapes += [(f"{prefix}.conv2.weight", (width, width, 3, 3))] + _batch_norm(f"{prefix}.bn2", width)
    shapes += [(f"{prefix}.conv3.weight", (out_channels, width, 1, 1))] + _batch_norm(f"{prefix}.bn3", out_channels)
    if projection:
        shapes += [(f"{prefix}.downsample.0.weight", (out_channels, in_channels, 1, 1))]
        shapes += _batch_norm(f"{prefix}.downsample.1", out_channels)
    return shapes


def parameter_shapes() -> List[Tuple[str, Shape]]:
    """(name, shape) of every trainable parameter, in ``named_parameters()`` order."""
    shapes = [("conv1.weight", (STEM_CHANNELS, 3, 7, 7))] + _batch_norm("bn1", STEM_CHANNELS)
    channels = STEM_CHANNELS
    for stage, (blocks, width) in enumerate(zip(BLOCKS_PER_STAGE, STAGE_WIDTHS), start=1):
        for block in range(blocks):
            shapes += _bottleneck(f"layer{stage}.{block}", channels, width, projection=block == 0)
            channels = width * EXPANSION
    return shapes + [("fc.weight", (CLASSES, channels)), ("fc.bias", (CLASSES,))]
