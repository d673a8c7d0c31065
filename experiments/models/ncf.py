"""NCF-style recommender (NeuMF, He et al. 2017): a GMF branch and an MLP branch over embeddings.

The model DeepReduce uses for its inherently sparse experiments (Table 2, Fig. 11). Its
embedding tables are ordinary dense ``nn.Embedding`` weights, so a mini-batch produces a
gradient that is exactly zero on every row whose user or item is absent from the batch:
the gradient is sparse without any sparsifier (about 40% zeros for the batch sizes the
experiments use on the Zipf data of :mod:`experiments.recsys_data`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn


class NCF(nn.Module):
    """NeuMF: ``sigmoid(h . [gmf(u, i), mlp(u, i)])``; returns logits (use BCE-with-logits).

    Args:
        n_users, n_items: table sizes.
        gmf_dim: width of the GMF embeddings (element-wise product branch).
        mlp_dim: width of each MLP embedding; the MLP input is their concatenation.
        hidden: widths of the MLP's hidden layers (ReLU).
    """

    def __init__(self, n_users: int, n_items: int, gmf_dim: int = 16, mlp_dim: int = 32,
                 hidden: Sequence[int] = (64, 32, 16)) -> None:
        super().__init__()
        if min(n_users, n_items, gmf_dim, mlp_dim) < 1 or not hidden:
            raise ValueError("NCF needs positive table sizes and widths and at least one hidden layer")
        self.user_gmf = nn.Embedding(n_users, gmf_dim)
        self.item_gmf = nn.Embedding(n_items, gmf_dim)
        self.user_mlp = nn.Embedding(n_users, mlp_dim)
        self.item_mlp = nn.Embedding(n_items, mlp_dim)
        layers, width = [], 2 * mlp_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers)
        self.head = nn.Linear(gmf_dim + width, 1)
        for emb in (self.user_gmf, self.item_gmf, self.user_mlp, self.item_mlp):
            nn.init.normal_(emb.weight, std=0.01)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        gmf = self.user_gmf(users) * self.item_gmf(items)
        mlp = self.mlp(torch.cat([self.user_mlp(users), self.item_mlp(items)], dim=1))
        return self.head(torch.cat([gmf, mlp], dim=1)).squeeze(1)


def hit_rate(model: NCF, test_items: np.ndarray, test_negatives: np.ndarray, k: int = 10,
             chunk: int = 4096) -> float:
    """HR@k under leave-one-out: share of users whose held-out item ranks in the top ``k``
    among itself and its sampled negatives (ties count against the positive)."""
    model.eval()
    hits = 0
    n_users = test_items.size
    with torch.no_grad():
        for start in range(0, n_users, chunk):
            users = np.arange(start, min(start + chunk, n_users))
            cand = np.concatenate([test_items[users, None], test_negatives[users]], axis=1)
            u = torch.from_numpy(np.repeat(users, cand.shape[1]))
            scores = model(u, torch.from_numpy(cand.ravel())).view(len(users), -1).numpy()
            better = (scores[:, 1:] >= scores[:, :1]).sum(axis=1)
            hits += int((better < k).sum())
    model.train()
    return hits / max(1, n_users)
