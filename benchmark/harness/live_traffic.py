"""A dataset's later period as live traffic: its events and its visits, interleaved in time order.

    for step in live_steps(dataset, from_ms=split, batch_size=8):
        store.append(step.events)                  # everything logged before the step's last visit
        session.score(visits_of(dataset, step.requests))

Each step is one batch of visits (distinct users, consecutive in time) and the events that precede
its last visit and were not sent before. A visit reads only events strictly before its own time
(its history, and the video counters of its candidates), so events sent ahead of an earlier visit
of the same step change nothing it sees: scored this way, every visit sees exactly what the offline
replay of the same visits over the whole dataset sees. The benchmark (benchmark/history/live_replay.py)
and the tests send the same stream.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data.dataset import InferenceDataset
from history.bootstrap import dataset_events
from history.events import EventBatch
from model.visit import Visit


@dataclass(frozen=True)
class LiveStep:
    events: EventBatch  # to store before the visits: time order, each user's events in history order
    requests: np.ndarray  # [B] the dataset's request indices of the step's visits (distinct users)


def live_steps(dataset: InferenceDataset, from_ms: int, batch_size: int, max_requests: int | None = None,
               ) -> Iterator[LiveStep]:
    """The events at or after `from_ms` and the visits at or after it (the first `max_requests`)."""
    events = dataset_events(dataset)
    later = np.flatnonzero(events.time_ms >= from_ms)
    later = later[np.argsort(events.time_ms[later], kind="stable")]  # stable: a user's ties keep their order
    times = events.time_ms[later]
    sent = 0
    requests = dataset.requests
    for batch in dataset.batches(dataset.request_indices(from_time_ms=from_ms, max_requests=max_requests), batch_size):
        until = int(np.searchsorted(times, int(requests.time_ms[batch].max()), side="left"))
        yield LiveStep(events.take(later[sent:max(sent, until)]), batch)
        sent = max(sent, until)


def visits_of(dataset: InferenceDataset, indices: np.ndarray) -> list[Visit]:
    """The dataset's visits as the library takes them: the user, the time and the videos shown."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    req = dataset.requests
    return [Visit(int(req.user_id[i]), int(req.time_ms[i]), videos.copy())
            for i, videos in zip(idx.tolist(), dataset.candidate_video_ids(idx))]
