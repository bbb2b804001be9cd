"""Retention: a history store that keeps each user's last events and the counters the model reads of the rest.

    store = SQLiteHistoryStore(path, retention=Retention(keep_events=4200, window_events=4097))

The model reads a user's history in two ways (docs/model.md, "Windows"; data/candidate_counters.py):

* the **window**: events [w(E) - 1, E) of the E events before the visit, at their absolute positions
  (w(E) >= E - (max_seq_len - C); the event before the window gives the first time gap), and
* **counters** over the whole history: the user's (events, clicks, long views), the user's per-video
  (shown, clicks, long views), and every user's per-video counts before the visit's time.

So a store may fold a user's older events into those counters and drop them: it keeps the user's
last `keep_events` events, and per user the number folded and the time of the latest, per (user,
video) and per video the folded counts. A read puts the folded events back as *stand-ins*: as many
events as were folded, each of a folded video, carrying the counted action bits so that every
counter above comes out the same, timed at the latest folded time. The model never reads a
stand-in's position, time or other bits as long as the window stays within kept events, which
`window_events` guarantees: a read is answered only when at least `window_events` kept events
precede the visit (or nothing was folded), and `window_events >= max_seq_len - C + 1`
(`Retention.check_model`). `keep_events - window_events` is the slack for events stored ahead of
a visit (a batch's later events, the visit's own inline ones).

What is not kept: the folded events themselves, so an export holds the stand-ins, and a copy of a
folded event sent again cannot be told from a new late event: an event at or before its user's
latest folded time is taken as already stored (a duplicate). A read for a time at or before that
(a visit in the folded past) is refused (`RetentionError`), as is a video count for a time at or
before the video's latest folded event; serving reads the present.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.schema import COUNTED_TASKS, TASKS

COUNTED_BITS = np.array([1 << TASKS.index(t) for t in COUNTED_TASKS], dtype=np.int64)


class RetentionError(ValueError):
    """A read the folded store cannot answer exactly: it names the user or video and the time."""


@dataclass(frozen=True)
class Retention:
    keep_events: int  # N: each user's last N events are kept whole
    window_events: int  # kept events a read needs before the visit: >= what the model's window reads

    def __post_init__(self) -> None:
        if self.window_events < 1:
            raise ValueError(f"window_events must be >= 1, got {self.window_events}")
        if self.keep_events < self.window_events:
            raise ValueError(f"keep_events ({self.keep_events}) must be >= window_events ({self.window_events})")

    @classmethod
    def for_model(cls, config, slack_events: int) -> Retention:
        """The smallest retention that serves `config`'s window, plus `slack_events` for events stored
        ahead of a visit."""
        window = config.max_seq_len - config.num_prefix_tokens + 1
        return cls(keep_events=window + slack_events, window_events=window)

    def check_model(self, config) -> None:
        """ValueError unless every window `config` reads lies within the kept events."""
        needed = config.max_seq_len - config.num_prefix_tokens + 1
        if self.window_events < needed:
            raise ValueError(f"retention keeps a window of {self.window_events} events, the model reads up to "
                             f"{needed} (max_seq_len {config.max_seq_len} - {config.num_prefix_tokens} prefix + 1)")


def fold_counts(video_ids: np.ndarray, action_weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Events -> (distinct videos [V], their counts [V, 1 + len(COUNTED_TASKS)]: shown, then each counted action)."""
    videos, inverse = np.unique(np.asarray(video_ids, dtype=np.int64), return_inverse=True)
    counts = np.zeros((len(videos), 1 + len(COUNTED_BITS)), dtype=np.int64)
    np.add.at(counts[:, 0], inverse, 1)
    for j, bit in enumerate(COUNTED_BITS.tolist()):
        np.add.at(counts[:, 1 + j], inverse, (np.asarray(action_weights) & bit) > 0)
    return videos, counts


def stand_ins(videos: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Folded (videos [V], counts [V, 1 + K]) -> stand-in events (video_ids [S], action_weights [S]),
    S = the folded total: each video `shown` times, the first `counts[k]` of them with action k's bit."""
    shown = counts[:, 0]
    video_ids = np.repeat(np.asarray(videos, dtype=np.int64), shown)
    rank = np.arange(len(video_ids)) - np.repeat(np.cumsum(shown) - shown, shown)  # index within its video
    weights = np.zeros(len(video_ids), dtype=np.int64)
    for j, bit in enumerate(COUNTED_BITS.tolist()):
        weights |= np.where(rank < np.repeat(counts[:, 1 + j], shown), bit, 0)
    return video_ids, weights
