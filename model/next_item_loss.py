"""An auxiliary next-clicked-item loss on the history tokens, for training only.

The ranking loss reaches the layers only through the visits' candidates, which read the history
through a plateau the attention has to leave first (docs/model.md, "Learning order"). Generative
recommenders train the sequence itself: every history position predicts what comes next. Here the
last layer's output at event i predicts the item of event i + 1 of the same user's window when that
event was clicked:

    q_i  = normalize(W h_i)                                   h_i: the last layer's row of event i
    e_v  = normalize(E_video[v] + E_tag[tag(v)] + side rows)  the item part of a token's embedding
    loss = cross_entropy(q_i · e_v / τ over the batch's distinct clicked items, the item of i + 1)

The items scored against are the distinct items (their rows of every item feature) that are targets in the batch,
so a popular item is never its own negative. The projection W belongs to the loss (the trainer's),
not to the model: nothing of it is saved or served, and serving computes no history outputs in the
last layer. The candidate logits are the same with or without it (`HSTURecommender.encode`).

    >>> loss_fn = NextItemLoss(model.config.hidden_dim)
    >>> targets = NextItemTargets.of(batch, inputs.features)
    >>> states = model.encode(inputs, history_rows=True)        # [T, d]
    >>> loss = loss_fn(model, states, targets)                  # scalar; 0 without targets
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data.batch import VisitBatch
from data.jagged import row_ids_and_ranks
from data.schema import CLICK_BIT
from model.features import VIDEO_TAG, TokenFeatures
from model.video_side_features import SIDE_FEATURES

if TYPE_CHECKING:
    from model.recommender import HSTURecommender

ITEM_FEATURES = ("video_id", VIDEO_TAG, *SIDE_FEATURES)  # what a token embeds of its video
# The softmax temperature of the cosine scores: 1/τ = 20 lets a cosine margin of ~0.2 reach the
# probabilities' full range, where τ = 1 would leave every item near uniform.
TEMPERATURE = 0.05


@dataclass(frozen=True)
class NextItemTargets:
    """A batch's next-clicked-item pairs, built on the host. P pairs, U distinct target items."""

    source_rows: np.ndarray  # [P] row in x of the event that predicts
    target_index: np.ndarray  # [P] index into the distinct items of the clicked event after it
    item_rows: dict[str, np.ndarray]  # item feature (video id, tag, side features) -> [U] rows of the distinct items

    @property
    def num_pairs(self) -> int:
        return len(self.source_rows)

    @classmethod
    def of(cls, batch: VisitBatch, features: TokenFeatures) -> NextItemTargets:
        """Each carried event followed, in the same user's carried events, by a clicked event."""
        users, _ = row_ids_and_ranks(batch.history_lengths)  # [N] user of each carried event
        n = len(users)
        follows = (users[1:] == users[:-1]) & ((batch.action_weights[1:] & CLICK_BIT) != 0)  # [N - 1]
        source = np.flatnonzero(follows)
        target = source + 1
        names = [name for name in ITEM_FEATURES if name in features.token_ids]
        keys = np.stack([features.token_ids[name][:n][target] for name in names], axis=1)  # [P, F]
        items, inverse = np.unique(keys, axis=0, return_inverse=True)
        return cls(
            source_rows=features.token_rows[source],
            target_index=inverse.reshape(-1).astype(np.int64),
            item_rows={name: items[:, j].astype(np.int64) for j, name in enumerate(names)},
        )


class NextItemLoss(nn.Module):
    def __init__(self, hidden_dim: int):
        super().__init__()
        self.projection = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, model: HSTURecommender, states: Tensor, targets: NextItemTargets) -> Tensor:
        """`states` [T, d]: every row of the layers' output (`model.encode(..., history_rows=True)`).
        -> the mean cross-entropy over the batch's pairs (a zero that keeps the graph when it has none)."""
        if targets.num_pairs == 0:
            return states.sum() * 0.0
        device = states.device
        items = model.embedder.item_embeddings({name: torch.from_numpy(rows).to(device)
                                                for name, rows in targets.item_rows.items()})
        sources = states[torch.from_numpy(targets.source_rows).to(device)]  # [P, d]
        queries = F.normalize(self.projection(sources), dim=-1)
        scores = queries @ F.normalize(items, dim=-1).T / TEMPERATURE  # [P, U]
        return F.cross_entropy(scores, torch.from_numpy(targets.target_index).to(device))
