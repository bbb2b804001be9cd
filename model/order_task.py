"""OrderTask: a sequential task with a known answer, to tell whether a model shape and a learning
rate can learn to read the order of a history at all.

Every user has `history` events of videos drawn from a large catalogue (an id is seen about once,
so it says nothing by itself), each video has one of `num_tags` tags (model/video_tags.py), and
each event is a click with probability `click_rate`. A candidate is clicked iff

    rule "last_event"     its tag is the tag of the user's last event;
    rule "recent_clicks"  its tag is among the tags of the clicked events of the last `recent` events.

Both depend on order: shuffling a history (events permuted, timestamps kept, as the order ablation
of model/order_ablation.py does) keeps every tag of the window but moves the recent ones, so a
model that reads order loses its AUC and one that only counts tags keeps it.
A unit test trains the tiny preset on it (the presets' runs: docs/notebook/2026-11-27-video-tags.md).

    >>> task = OrderTask(history=16, candidates=4)
    >>> batch = task.batch(np.random.default_rng(0), num_users=2)
    >>> batch.history_lengths.tolist(), batch.labels.shape
    ([16, 16], (8, 8))
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from data.batch import VisitBatch
from data.schema import TASKS
from model.config import HSTUConfig
from model.metrics import auc
from model.recommender import HSTURecommender
from model.video_tags import VideoTagTable

RULES = ("last_event", "recent_clicks")
T0_MS = 1_650_000_000_000


@dataclass(frozen=True)
class OrderTask:
    num_tags: int = 8
    history: int = 64  # events per user, all in the window
    candidates: int = 8  # per user
    num_videos: int = 100_000
    rule: str = "last_event"
    recent: int = 8  # events the "recent_clicks" rule looks back
    click_rate: float = 0.3
    seed: int = 0  # draws the catalogue's tags

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"OrderTask.rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not (self.num_tags >= 2 and self.history >= 1 and self.candidates >= 1 and self.recent >= 1):
            raise ValueError("OrderTask needs num_tags >= 2, history, candidates and recent >= 1")

    @cached_property
    def tag_table(self) -> VideoTagTable:
        tags = np.random.default_rng(self.seed).integers(1, self.num_tags + 1, self.num_videos)
        return VideoTagTable.from_pairs(np.arange(self.num_videos), tags)

    def model_config(self, base: HSTUConfig) -> HSTUConfig:
        """`base` reading nothing but the tokens: tags on, no contextual prefix, no candidate-only
        user or counter terms (their inputs are not part of the task)."""
        return base.replace(num_video_tags=self.num_tags + 1, use_contextual_prefix=False, user_feature_cardinalities=(),
                            user_hash_size=0, counter_buckets=0)

    def batch(self, rng: np.random.Generator, num_users: int, shuffled: bool = False) -> VisitBatch:
        """`num_users` fresh users, one visit each; `shuffled` permutes each history after labelling."""
        n, L, C = num_users, self.history, self.candidates
        tag_of = self.tag_table
        videos = rng.integers(0, self.num_videos, (n, L))
        clicks = rng.random((n, L)) < self.click_rate
        candidates = rng.integers(0, self.num_videos, (n, C))
        history_tags = tag_of.rows(videos.reshape(-1)).reshape(n, L)
        candidate_tags = tag_of.rows(candidates.reshape(-1)).reshape(n, C)
        if self.rule == "last_event":
            clicked = candidate_tags == history_tags[:, -1:]
        else:
            recent_tags = np.where(clicks[:, -self.recent:], history_tags[:, -self.recent:], -1)  # [n, recent]
            clicked = (candidate_tags[:, :, None] == recent_tags[:, None, :]).any(-1)
        times = T0_MS + np.cumsum(rng.integers(1_000, 60_000, (n, L)), axis=1)  # drawn before any shuffle: kept
        if shuffled:
            order = np.argsort(rng.random((n, L)), axis=1)
            videos, clicks = np.take_along_axis(videos, order, 1), np.take_along_axis(clicks, order, 1)
        labels = np.zeros((n * C, len(TASKS)), np.float32)
        labels[:, 0] = clicked.reshape(-1)
        return VisitBatch(
            request_ids=np.arange(n), user_ids=np.arange(n), request_times_ms=times[:, -1] + 1_000,
            window_starts=np.zeros(n, np.int64), starts=np.zeros(n, np.int64), history_lengths=np.full(n, L),
            prev_timestamps_ms=times[:, 0], user_features=np.zeros((n, 0), np.int64),
            video_ids=videos.reshape(-1), action_weights=clicks.reshape(-1).astype(np.int64),
            timestamps_ms=times.reshape(-1), candidate_lengths=np.full(n, C),
            candidate_video_ids=candidates.reshape(-1), labels=labels,
        )


@dataclass(frozen=True)
class OrderProgress:
    """Click AUC on a fixed set of held-out users after `step` steps, as logged and shuffled."""

    step: int
    train_loss: float  # the step's click BCE
    auc: float
    shuffled_auc: float
    shuffled_change: float  # mean |logit(logged) - logit(shuffled)| / std of the logged logits


def learn_order(task: OrderTask, base: HSTUConfig, steps: int, learning_rate: float, batch_users: int = 16,
                eval_every: int = 50, eval_users: int = 200, seed: int = 0,
                attention_backend: str = "blocked") -> list[OrderProgress]:
    """Train a fresh model of `task.model_config(base)` on fresh users each step (AdamW on the click
    BCE, every parameter at `learning_rate`), scoring the held-out users every `eval_every` steps."""
    torch.manual_seed(seed)
    model = HSTURecommender(task.model_config(base), video_tags=task.tag_table)
    model.attention_backend = attention_backend
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    logged = task.batch(np.random.default_rng([seed, 1]), eval_users)
    shuffled = task.batch(np.random.default_rng([seed, 1]), eval_users, shuffled=True)  # the same users
    labels = logged.labels[:, 0]
    progress = []
    for step in range(1, steps + 1):
        model.train()
        batch = task.batch(rng, batch_users)
        loss = F.binary_cross_entropy_with_logits(model(batch)[:, 0], torch.from_numpy(batch.labels[:, 0]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % eval_every == 0 or step == steps:
            model.eval()
            with torch.inference_mode():
                as_logged, as_shuffled = (model(b)[:, 0].numpy() for b in (logged, shuffled))
            change = float(np.abs(as_logged - as_shuffled).mean() / max(as_logged.std(), 1e-12))
            progress.append(OrderProgress(step, loss.item(), auc(as_logged, labels), auc(as_shuffled, labels), change))
    return progress
