"""A 350M-parameter decoder-only transformer's parameter shapes, without building the model.

GPT-2 medium's layout (Radford et al., 2019; Hugging Face's parameter names): 24 pre-norm
blocks of d_model 1024 (16 heads), a 4x MLP (4096), learned position embeddings for a 1024-token
context, a vocabulary of 50257 whose token embedding is tied to the output projection (one
parameter, whose gradient is complete only at the end of backward). Linear weights are listed
as PyTorch's ``(out_features, in_features)``. 292 tensors, 354,823,168 parameters. Benchmarks
that simulate a large language model's gradient set (``deepreduce bench-scaling``) use it.
"""
from __future__ import annotations

from typing import List, Tuple

LAYERS = 24
D_MODEL = 1024
MLP_RATIO = 4
VOCAB = 50257
CONTEXT = 1024

Shape = Tuple[int, ...]


def _layer_norm(prefix: str) -> List[Tuple[str, Shape]]:
    return [(f"{prefix}.weight", (D_MODEL,)), (f"{prefix}.bias", (D_MODEL,))]


def _linear(prefix: str, inputs: int, outputs: int) -> List[Tuple[str, Shape]]:
    return [(f"{prefix}.weight", (outputs, inputs)), (f"{prefix}.bias", (outputs,))]


def parameter_shapes() -> List[Tuple[str, Shape]]:
    """(name, shape) of every trainable parameter, in ``named_parameters()`` order."""
    shapes = [("wte.weight", (VOCAB, D_MODEL)), ("wpe.weight", (CONTEXT, D_MODEL))]
    hidden = MLP_RATIO * D_MODEL
    for layer in range(LAYERS):
        prefix = f"h.{layer}"
        shapes += _layer_norm(f"{prefix}.ln_1")
        shapes += _linear(f"{prefix}.attn.c_attn", D_MODEL, 3 * D_MODEL)
        shapes += _linear(f"{prefix}.attn.c_proj", D_MODEL, D_MODEL)
        shapes += _layer_norm(f"{prefix}.ln_2")
        shapes += _linear(f"{prefix}.mlp.c_fc", D_MODEL, hidden)
        shapes += _linear(f"{prefix}.mlp.c_proj", hidden, D_MODEL)
    return shapes + _layer_norm("ln_f")
