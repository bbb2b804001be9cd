"""The id rows' start from click co-occurrence (model/item_cooccurrence.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.schema import TASKS
from data.user_histories import EventArrays, UserHistories
from model.config import preset
from model.item_cooccurrence import (
    IdRowStart,
    click_pairs,
    clicked_videos,
    cooccurrence_rows,
    start_from_cooccurrence,
    start_id_rows,
)
from model.recommender import HSTURecommender
from model.train_params import TrainParams

CLICK = 1 << TASKS.index("click")


def histories(users: list[list[tuple[int, bool]]], start_ms: int = 1_650_000_000_000) -> UserHistories:
    """One user per list of (video, clicked) events, an hour apart in the order given."""
    lengths = [len(events) for events in users]
    flat = [event for events in users for event in events]
    times = start_ms + 3_600_000 * np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    return UserHistories(EventArrays(
        user_ids=np.arange(1, len(users) + 1, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        video_ids=np.array([v for v, _ in flat], dtype=np.int64),
        action_weights=np.array([CLICK if c else 0 for _, c in flat], dtype=np.int64),
        timestamps_ms=times,
        user_features=np.zeros((len(users), 0), dtype=np.int64),
    ), "test histories")


def test_pairs_are_clicks_of_one_user_before_the_cut_within_the_window():
    h = histories([[(1, True), (2, False), (3, True), (4, True), (5, True)], [(6, True), (7, True)]])
    cut = 1_650_000_000_000 + 3 * 3_600_000 + 1  # user 1's fifth event is after it
    first, second = click_pairs(*clicked_videos(h, hash_size=1000, until_ms=cut), window=2)
    assert sorted(zip(first.tolist(), second.tolist())) == [(1, 3), (1, 4), (3, 4), (6, 7)]


def test_clicked_videos_hash_the_ids():
    h = histories([[(1005, True), (7, True)]])
    users, videos = clicked_videos(h, hash_size=1000, until_ms=2**62)
    assert (users.tolist(), videos.tolist()) == ([0, 0], [5, 7])


def two_groups(seed: int = 0, num_users: int = 60, group_size: int = 20) -> tuple[UserHistories, np.ndarray]:
    """Each user clicks runs of videos from one group at a time: videos 0-19 or 20-39."""
    rng = np.random.default_rng(seed)
    users = []
    for _ in range(num_users):
        events = []
        for _ in range(6):
            group = rng.integers(2)
            events += [(int(group * group_size + rng.integers(group_size)), True) for _ in range(8)]
        users.append(events)
    return histories(users), np.repeat([0, 1], group_size)


def test_videos_clicked_together_start_alike():
    h, group = two_groups()
    start = cooccurrence_rows(h, hash_size=1000, until_ms=2**62, hidden_dim=16, seed=0, rank=4, min_clicks=5)
    assert start.ids.tolist() == list(range(40))
    rows = start.rows / np.linalg.norm(start.rows, axis=1, keepdims=True)
    cosine = rows @ rows.T
    same = group[:, None] == group[None, :]
    off_diagonal = ~np.eye(40, dtype=bool)
    assert cosine[same & off_diagonal].mean() > cosine[~same].mean() + 0.5


def test_videos_clicked_fewer_times_keep_their_random_start_and_too_few_give_none():
    h, _ = two_groups()
    once = histories([[(900, True), (0, True), (901, True), (1, True)] * 1 + [(900, True)] * 0])
    clicks = np.bincount(clicked_videos(h, 1000, 2**62)[1], minlength=40)
    assert clicks.min() >= 5  # every video of the groups qualifies
    start = cooccurrence_rows(h, 1000, 2**62, 16, 0, rank=4, min_clicks=int(clicks.max()))
    assert start.ids.tolist() == [] or set(start.ids.tolist()) <= set(np.flatnonzero(clicks >= clicks.max()).tolist())
    assert 900 not in cooccurrence_rows(h, 1000, 2**62, 16, 0, rank=4).ids
    assert cooccurrence_rows(once, 1000, 2**62, 16, 0, rank=4).num_ids == 0


def test_the_start_sets_only_its_rows_at_the_tables_scale():
    table = torch.nn.Embedding(50, 8)
    before = table.weight.detach().clone()
    rows = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32) * 100
    start_id_rows(table, IdRowStart(np.array([2, 7, 9]), rows))
    after = table.weight.detach()
    untouched = np.setdiff1d(np.arange(50), [2, 7, 9])
    assert torch.equal(after[untouched], before[untouched])
    assert after[[2, 7, 9]].norm(dim=1).mean() == pytest.approx(before.norm(dim=1).mean().item(), rel=1e-5)
    cosine = torch.nn.functional.cosine_similarity(after[[2, 7, 9]], torch.from_numpy(rows), dim=1)
    assert torch.allclose(cosine, torch.ones(3), atol=1e-5)


def test_a_model_without_id_rows_is_left_as_it_is():
    h, _ = two_groups()
    model = HSTURecommender(preset("tiny", video_hash_size=1))
    before = model.embedder.collection.embeddings["table_video_id"].weight.detach().clone()
    assert start_from_cooccurrence(model, h, 2**62, seed=0).num_ids == 0
    assert torch.equal(model.embedder.collection.embeddings["table_video_id"].weight, before)


def test_a_model_with_id_rows_starts_from_the_clicks():
    h, _ = two_groups()
    model = HSTURecommender(preset("tiny"))
    start = start_from_cooccurrence(model, h, 2**62, seed=0)
    assert start.num_ids == 40
    table = model.embedder.collection.embeddings["table_video_id"].weight.detach()
    expected = torch.from_numpy(start.rows)
    assert torch.allclose(torch.nn.functional.cosine_similarity(table[start.ids], expected, dim=1),
                          torch.ones(40), atol=1e-5)


def test_an_unknown_start_is_refused():
    with pytest.raises(ValueError, match="id_start must be one of cooccurrence, random"):
        TrainParams(id_start="svd")
