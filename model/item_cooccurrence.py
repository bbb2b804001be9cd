"""A fresh model's video-id rows started from the training period's co-occurrence, for training only.

A dense catalogue's id rows must learn which videos go together before the attention can use them:
which ones a candidate's history shares its cluster with, and which follow which. From random rows
the layers and the next-item loss find that slowly, and meanwhile the rows memorise their labels.
The logs already say it: videos that users click close together in time are alike. So the rows
start from a factorisation of that:

    pairs      each clicked event and the clicked events up to `window` after it, same user, in
               the events before `until_ms` (the training period: nothing of the holdout), of the
               videos clicked at least `min_clicks` times there
    C[a, b]    how often videos a and b are such a pair (both directions)
    PPMI[a, b] max(0, log(C[a, b] * total / (rows[a] * rows[b])))
    rows       the top `rank` singular vectors of PPMI, scaled by sqrt(singular value), placed in
               the hidden space by a fixed random orthonormal map and scaled to the table's mean norm

Only videos clicked at least `min_clicks` times are set (a rare video's few pairs are noise, and
placing it would only help its rows memorise); the rest keep their random start, and training moves
every row from there. Where ids do not repeat (a sparse catalogue) few rows qualify and the start
changes little.

    >>> start_from_cooccurrence(model, dataset, until_ms=cut, seed=0)   # a fresh model, before its first step
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as sla
import torch

from data.jagged import row_ids_and_ranks
from data.schema import CLICK_BIT
from data.user_histories import UserHistories
from model.embeddings import VIDEO_ID_TABLE

if TYPE_CHECKING:
    from model.recommender import HSTURecommender

WINDOW = 5  # clicks after an event that count as its neighbours: a visit's worth of recent interest
RANK = 32
MIN_CLICKS = 5  # a video clicked fewer times keeps its random start: too few pairs to place it


@dataclass(frozen=True)
class IdRowStart:
    """Rows to start a video-id table from: `rows[i]` for hashed id `ids[i]` (any norm; scaled on use)."""

    ids: np.ndarray  # [n] int64, ascending hashed ids
    rows: np.ndarray  # [n, hidden_dim] float32

    @property
    def num_ids(self) -> int:
        return len(self.ids)

    @classmethod
    def none(cls, hidden_dim: int) -> IdRowStart:
        return cls(np.zeros(0, np.int64), np.zeros((0, hidden_dim), np.float32))


def clicked_videos(histories: UserHistories, hash_size: int, until_ms: int) -> tuple[np.ndarray, np.ndarray]:
    """(row of the user [C], hashed video id [C]) of every clicked event before `until_ms`, in (user, time)
    order."""
    events = histories.event_arrays()
    users, _ = row_ids_and_ranks(np.diff(events.offsets))  # [E]
    keep = (events.timestamps_ms < until_ms) & ((events.action_weights & CLICK_BIT) != 0)
    return users[keep], np.remainder(events.video_ids[keep], hash_size)


def click_pairs(users: np.ndarray, videos: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Clicked events in (user, time) order -> ids (a [P], b [P]) of each and the next `window` clicked
    events of the same user."""
    firsts, seconds = [], []
    for k in range(1, window + 1):
        same_user = users[:-k] == users[k:]
        firsts.append(videos[:-k][same_user])
        seconds.append(videos[k:][same_user])
    return np.concatenate(firsts), np.concatenate(seconds)


def cooccurrence_rows(histories: UserHistories, hash_size: int, until_ms: int, hidden_dim: int, seed: int,
                      window: int = WINDOW, rank: int = RANK, min_clicks: int = MIN_CLICKS) -> IdRowStart:
    """The start of the ids clicked at least `min_clicks` times before `until_ms` (module docstring); no
    ids when fewer than rank + 2 qualify (too few to factorise)."""
    users, videos = clicked_videos(histories, hash_size, until_ms)
    ids, clicks = np.unique(videos, return_counts=True)
    ids = ids[clicks >= min_clicks]
    if len(ids) < rank + 2:
        return IdRowStart.none(hidden_dim)
    frequent = np.isin(videos, ids)
    first, second = click_pairs(users[frequent], videos[frequent], window)
    a, b, n = np.searchsorted(ids, first), np.searchsorted(ids, second), len(ids)
    counts_ab = sp.coo_matrix((np.ones(len(a)), (a, b)), shape=(n, n)).tocsr()
    counts_ab = (counts_ab + counts_ab.T).tocoo()
    row_sums = np.asarray(counts_ab.sum(axis=1)).ravel()
    pmi = np.log(counts_ab.data * counts_ab.data.sum() / (row_sums[counts_ab.row] * row_sums[counts_ab.col]))
    ppmi = sp.csr_matrix((np.maximum(pmi, 0.0), (counts_ab.row, counts_ab.col)), shape=(n, n))
    k = min(rank, n - 2)
    vectors, singular, _ = sla.svds(ppmi, k=k, v0=np.random.default_rng(seed).standard_normal(n))
    vectors = vectors * np.sqrt(np.maximum(singular, 0.0))  # [n, k]; a video without pairs stays at 0
    basis = np.linalg.qr(np.random.default_rng(seed).standard_normal((hidden_dim, k)))[0]  # [d, k]
    keep = np.linalg.norm(vectors, axis=1) > 0
    return IdRowStart(ids[keep].astype(np.int64), (vectors[keep] @ basis.T).astype(np.float32))


def start_id_rows(table: torch.nn.Embedding, start: IdRowStart) -> None:
    """Overwrite `table`'s rows of `start.ids` with `start.rows`, scaled so that their mean norm is the
    table's (the start keeps the table's scale; only the directions come from the data)."""
    if not start.num_ids:
        return
    with torch.no_grad():
        weight = table.weight
        rows = torch.from_numpy(start.rows).to(weight.device, weight.dtype)
        scale = weight.norm(dim=1).mean() / rows.norm(dim=1).mean().clamp_min(1e-12)
        weight[torch.from_numpy(start.ids).to(weight.device)] = rows * scale


def start_from_cooccurrence(model: HSTURecommender, histories: UserHistories, until_ms: int, seed: int) -> IdRowStart:
    """Start `model`'s video-id rows from the co-occurrence of the clicks before `until_ms`; -> the start
    (none for a model with one video row, which has no per-video row to start)."""
    config = model.config
    if config.video_hash_size <= 1:
        return IdRowStart.none(config.hidden_dim)
    start = cooccurrence_rows(histories, config.video_hash_size, until_ms, config.hidden_dim, seed)
    start_id_rows(model.embedder.collection.embeddings[VIDEO_ID_TABLE], start)
    return start
