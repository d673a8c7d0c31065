"""Horovod-style summable compressors in the torch bindings.

Such a compressor maps a gradient to codes that can be summed across ranks (``compress(tensor)``
-> (codes, context)) and a sum of codes back to a gradient (``decompress(codes, context)``): the
codes travel by all-reduce, not as containers. :class:`FP16Compressor` is the simplest;
``deepreduce.torch.GradiVeQ`` takes each tensor's name (``accepts_name``). :func:`compress` and
:func:`decompress_into` apply one to tensors that one all-reduce reduces together (a DDP bucket).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..errors import ConfigError


class FP16Compressor:
    """Summable half precision: gradients travel as float16 through ``all_reduce``.

    The contract of Horovod's ``Compression.fp16`` (``compress`` -> (tensor, context),
    ``decompress``), so a ``DeepReduceState`` accepts either.
    """

    @staticmethod
    def compress(tensor: torch.Tensor):
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        return tensor.to(ctx)

    def __repr__(self) -> str:
        return "FP16Compressor()"


def compress(compressor, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> Tuple[List, List]:
    """(codes, contexts) of each tensor (the compressor gets its name where it ``accepts_name``);
    a ConfigError when the codes are not of one dtype (one all-reduce sums them)."""
    named = getattr(compressor, "accepts_name", False)
    pairs = [compressor.compress(t, name=n) if named else compressor.compress(t) for t, n in zip(tensors, names)]
    dtypes = {code.dtype for code, _ in pairs}
    if len(dtypes) != 1:
        raise ConfigError(f"{compressor!r} returned codes of several dtypes ({sorted(map(str, dtypes))}) "
                          "for one bucket; a summable compressor must use one dtype")
    return [code for code, _ in pairs], [ctx for _, ctx in pairs]


def decompress_into(compressor, summed: torch.Tensor, codes: Sequence[torch.Tensor], contexts: Sequence,
                    tensors: Sequence[torch.Tensor], ranks: int) -> None:
    """Each tensor's part of ``summed`` (the sum of the codes, concatenated flat in order)
    decompressed and divided by ``ranks`` into the tensor."""
    offset = 0
    for code, ctx, tensor in zip(codes, contexts, tensors):
        part = summed[offset:offset + code.numel()].view(code.shape)
        offset += code.numel()
        tensor.copy_(compressor.decompress(part, ctx).view(tensor.shape) / ranks)
