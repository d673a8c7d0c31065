"""A small decoder-only transformer over the word-level vocabulary.

Pre-norm blocks (causal self-attention through ``scaled_dot_product_attention``, a GELU MLP),
learned positions, and an output projection that is *not* tied to the input embedding: tying
would add the softmax's gradient, which touches every row, to the table, and the experiment
wants an embedding whose gradient is row-sparse (only the rows of the batch's tokens are
non-zero). The embedding is an ordinary dense ``nn.Embedding`` (not ``sparse=True``): AdamW,
DDP's hooks and deepreduce's sparsifiers all take dense gradients, and a dense gradient whose
rows are mostly zero is exactly what a Top-r sparsifier should find cheap to send.

With the default :class:`LMConfig` (8192 tokens, width 128, 2 layers) the model has about
2.5 M parameters, of which the embedding table and the output projection hold 1 M each.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class LMConfig:
    """The model's shape (``asdict`` of it travels to the ranks as JSON)."""

    vocab_size: int = 8192
    context: int = 128
    width: int = 128
    layers: int = 2
    heads: int = 4

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"LMConfig: width {self.width} is not a multiple of heads {self.heads}")

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, width))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """Token ids ``(batch, time)`` -> next-token logits ``(batch, time, vocab_size)``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.config.context:
            raise ValueError(f"TransformerLM: {ids.shape[1]} tokens exceed the context of {self.config.context}")
        x = self.embed(ids) + self.position.weight[:ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_sum(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy (nats) of ``targets`` given ``ids``."""
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
