"""Synthetic implicit-feedback data for the NCF-style recommender: a documented Zipf model.

DeepReduce evaluates its inherently sparse case on NCF trained on MovieLens-20M, which this
project cannot download. This module generates a stand-in with the two properties that matter
for gradient compression: a long-tailed item popularity (so an embedding gradient touches the
popular rows every batch and the tail rarely, leaving many all-zero rows), and a learnable
user-item affinity (so a hit rate can be measured and compression effects on quality show).

The generative model, fully determined by :class:`ZipfConfig` (same seed => same bytes):

1. Item popularity is Zipf: item ``i`` (in a seeded random order of popularity ranks
   ``rank_i = 1..n_items``) has prior weight ``pi_i = rank_i ** -item_exponent``.
2. Users and items have latent factors ``p_u, q_i ~ N(0, I_k)`` (``k = factors``).
3. User activity is Zipf too: user ``u`` with activity rank ``a_u`` has
   ``n_u = clip(round(mean_interactions * w_u / mean(w)), min_interactions, n_items // 2)``
   interactions, with ``w_u = a_u ** -user_exponent``.
4. User ``u`` picks ``n_u`` distinct items with probability proportional to
   ``pi_i * exp(affinity * <p_u, q_i> / sqrt(k))`` (sampling without replacement via the
   Gumbel top-k trick).
5. Leave-one-out split as in NCF (He et al., 2017): one random interaction per user is held
   out for testing and ranked against ``test_negatives`` (99) items the user never picked;
   the quality metric is the hit rate at 10 (HR@10).

Training instances are the remaining (user, item) positives plus ``negatives`` uniformly
drawn items per positive, labelled 0, redrawn every epoch from a seed (a drawn negative that
happens to be a positive of that user is kept as noise, as in most NCF re-implementations).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator, Tuple

import numpy as np


@dataclass(frozen=True)
class ZipfConfig:
    """Parameters of the generator (see the module docstring for the model)."""

    n_users: int = 6000
    n_items: int = 4000
    factors: int = 8
    item_exponent: float = 1.0
    user_exponent: float = 0.5
    mean_interactions: float = 40.0
    min_interactions: int = 5
    affinity: float = 2.0
    test_negatives: int = 99
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_users < 1 or self.n_items < self.test_negatives + 2:
            raise ValueError(f"ZipfConfig needs n_users >= 1 and n_items >= test_negatives + 2, got {self}")
        if self.min_interactions < 2:
            raise ValueError("ZipfConfig.min_interactions must be >= 2 (one is held out for testing)")
        if self.min_interactions > self.n_items // 2:
            raise ValueError("ZipfConfig.min_interactions must be <= n_items // 2")


QUICK = ZipfConfig(n_users=300, n_items=400, mean_interactions=15.0)


@dataclass
class ImplicitFeedback:
    """A generated data set: training positives, held-out test items and their negatives."""

    config: ZipfConfig
    train_users: np.ndarray      # int64 (P,)
    train_items: np.ndarray      # int64 (P,)
    test_items: np.ndarray       # int64 (n_users,): the held-out positive of each user
    test_negatives: np.ndarray   # int64 (n_users, test_negatives)

    @property
    def n_users(self) -> int:
        return self.config.n_users

    @property
    def n_items(self) -> int:
        return self.config.n_items

    def summary(self) -> dict:
        counts = np.bincount(self.train_items, minlength=self.n_items)
        top = np.sort(counts)[::-1]
        return dict(asdict(self.config), train_positives=int(self.train_users.size),
                    items_never_seen=int((counts == 0).sum()),
                    top1pct_item_share=float(top[: max(1, self.n_items // 100)].sum() / max(1, counts.sum())))

    def epoch(self, epoch: int, batch_size: int, negatives: int = 4, rank: int = 0, size: int = 1,
              seed: int = 0) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Yield ``(users, items, labels)`` mini-batches of this rank's shard of one epoch.

        Positives and ``negatives`` fresh negatives per positive are shuffled with a seed of
        (seed, epoch); every rank draws the same permutation and takes an equal, disjoint share,
        so all ranks run the same number of steps.
        """
        rng = np.random.default_rng([seed, epoch, 7])
        n_pos = self.train_users.size
        users = np.concatenate([self.train_users, np.repeat(self.train_users, negatives)])
        items = np.concatenate([self.train_items, rng.integers(0, self.n_items, size=n_pos * negatives)])
        labels = np.concatenate([np.ones(n_pos, np.float32), np.zeros(n_pos * negatives, np.float32)])
        order = rng.permutation(users.size)
        per_rank = users.size // size
        mine = order[rank * per_rank:(rank + 1) * per_rank]
        for start in range(0, per_rank - batch_size + 1, batch_size):
            sel = mine[start:start + batch_size]
            yield users[sel], items[sel], labels[sel]


def generate(config: ZipfConfig = ZipfConfig()) -> ImplicitFeedback:
    """Generate the data set ``config`` describes (deterministic in ``config.seed``)."""
    rng = np.random.default_rng([config.seed, 20_000])
    n_users, n_items, k = config.n_users, config.n_items, config.factors
    item_rank = rng.permutation(n_items) + 1
    log_prior = -config.item_exponent * np.log(item_rank)
    p = rng.standard_normal((n_users, k))
    q = rng.standard_normal((n_items, k))
    user_rank = rng.permutation(n_users) + 1
    w = user_rank ** -config.user_exponent
    n_u = np.clip(np.round(config.mean_interactions * w / w.mean()), config.min_interactions, n_items // 2)
    n_u = n_u.astype(np.int64)

    train_u, train_i, test_items = [], [], np.empty(n_users, np.int64)
    test_neg = np.empty((n_users, config.test_negatives), np.int64)
    scale = config.affinity / np.sqrt(k)
    for u in range(n_users):
        logits = log_prior + scale * (q @ p[u])
        keys = logits + rng.gumbel(size=n_items)
        picked = np.argpartition(keys, n_items - n_u[u])[n_items - n_u[u]:]
        picked = rng.permutation(picked)
        test_items[u] = picked[0]
        train_u.append(np.full(picked.size - 1, u, np.int64))
        train_i.append(picked[1:].astype(np.int64))
        # Negatives: items this user never picked, drawn uniformly without replacement.
        mask = np.ones(n_items, bool)
        mask[picked] = False
        test_neg[u] = rng.choice(np.flatnonzero(mask), size=config.test_negatives, replace=False)
    return ImplicitFeedback(config, np.concatenate(train_u), np.concatenate(train_i), test_items, test_neg)
