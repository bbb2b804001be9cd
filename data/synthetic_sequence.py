"""The sequential signal: what a user is shown and clicks depends on the order and recency of the
user's earlier events.

`SequentialRules` (data/synthetic_world.py) defines two decaying traces per user over the video
clusters, interest (fed by clicks) and fatigue (fed by exposures), the affinity they add to the next
event and the share of the feed that follows the interest. This module runs them:

    draw_sequential_events   the generator's draw of the standard log's videos and clicks, one event
                             position at a time across all users (a click moves what the user's next
                             event is drawn from)
    replay                   the same walk over logged events, their videos and clicks given: the
                             sequential affinity every event was drawn with
    history_traces           a history's traces at a later time summed at once, for any arrangement
                             of its events over its time slots

Events are walked in (user, time) order, ties in the order given, as preprocessing sorts them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from data.synthetic_world import SequentialRules, SyntheticConfig, World, sigmoid

HOUR_MS = 3_600_000
CALIBRATION_STEPS = 16  # bisection steps for the click intercept (to 3e-4 logits)
CALIBRATION_SPAN = 10.0  # the intercept is searched in [-span, span] logits


@dataclass(frozen=True)
class SequenceWorld:
    """What the sequential events were drawn with, so that any score can be recomputed."""

    rules: SequentialRules
    successor: np.ndarray  # [K] the cluster a click on cluster c also raises interest in
    click_intercept: float  # logit of a click = click_intercept + slope * (affinity + sequential affinity)
    slope: float

    def recent_share(self, interest: np.ndarray, total: np.ndarray) -> np.ndarray:
        """Interest at some clusters [..., n] and its sum over clusters [..., 1] -> each cluster's share
        of the recent clicks, smoothed towards uniform by `interest_prior_clicks`."""
        prior = self.rules.interest_prior_clicks
        return (interest + prior / len(self.successor)) / (total + prior)

    def sequential_affinity(self, interest: np.ndarray, total: np.ndarray, fatigue: np.ndarray) -> np.ndarray:
        """Traces at the clusters scored ([N] each; `total` is interest summed over clusters) -> [N]:
        log(K x recent share) counts like the taste's log(K x taste), less the fatigue."""
        r = self.rules
        share = self.recent_share(interest, total)
        return r.interest_weight * np.log(len(self.successor) * share) - r.fatigue_weight * fatigue

    def click_probability(self, z: np.ndarray) -> np.ndarray:
        """[N] affinities (sequential part included) -> [N] click probability."""
        return sigmoid(self.click_intercept + self.slope * z)


def draw_successors(rng: np.random.Generator, num_clusters: int) -> np.ndarray:
    """[K] one random cycle through every cluster: each has one successor, none its own."""
    order = rng.permutation(num_clusters)
    successor = np.empty(num_clusters, dtype=np.int64)
    successor[order] = np.roll(order, -1)
    return successor


class SequentialEvents(NamedTuple):
    video: np.ndarray  # [N] video ids
    click: np.ndarray  # [N] bool
    z: np.ndarray  # [N] affinity with the sequential part, what the other actions are drawn from
    world: SequenceWorld


def draw_sequential_events(
    rng: np.random.Generator, world: World, cfg: SyntheticConfig, user: np.ndarray, time_ms: np.ndarray
) -> SequentialEvents:
    """Videos and clicks of events [N] (any order) under `cfg.sequence`: a share of each exposure's
    cluster follows the user's recent interest, the rest `World.cluster_exposure_probability`. The
    click intercept is set so the click rate of every user's first `calibration_events` events matches
    `cfg.rates`; the rate depends on the clicks drawn, so each bisection step redraws that prefix with
    the same uniforms."""
    rules, slope, target = cfg.sequence, cfg.signal_strength, cfg.rates[0]
    successor = draw_successors(rng, world.taste.shape[1])
    order = np.lexsort((time_ms, user))
    pick_cluster, pick_rank, pick_click = (rng.random(len(user))[order] for _ in range(3))
    user, walk = user[order], _EventWalk(user[order], time_ms[order])
    usual = world.cluster_exposure_probability(cfg.taste_exposure)[walk.user_of_rank]  # [U, K] by rank
    video = np.zeros(len(user), dtype=np.int64)

    def expose(events: np.ndarray, traces: _Traces, active: int) -> np.ndarray:
        mix = rules.feed_follows_interest * traces.recent_share(active) + (1 - rules.feed_follows_interest) * usual[:active]
        cdf = np.cumsum(mix, axis=1)
        cluster = np.minimum((cdf < pick_cluster[events, None] * cdf[:, -1:]).sum(axis=1), cdf.shape[1] - 1)
        video[events] = world.video_in_cluster(cluster, pick_rank[events], cfg.popularity_exponent)
        return cluster

    def walk_with(b: float, max_positions: int | None) -> tuple[np.ndarray, np.ndarray]:
        sequence = SequenceWorld(rules, successor, b, slope)

        def decide(events: np.ndarray, sequential: np.ndarray) -> np.ndarray:
            z = world.affinity(user[events], video[events]) + sequential
            return pick_click[events] < sequence.click_probability(z)

        return walk.run(sequence, expose, decide, max_positions)

    lo, hi = -CALIBRATION_SPAN, CALIBRATION_SPAN
    prefix = walk.position < rules.calibration_events
    for _ in range(CALIBRATION_STEPS):
        mid = (lo + hi) / 2
        clicks = walk_with(mid, rules.calibration_events)[1]
        if clicks[prefix].mean() < target:
            lo = mid
        else:
            hi = mid
    b = (lo + hi) / 2
    sequential, clicks = walk_with(b, None)
    out_video, out_click, z = np.empty_like(video), np.empty(len(user), bool), np.empty(len(user))
    out_video[order], out_click[order] = video, clicks
    z[order] = world.affinity(user, video) + sequential
    return SequentialEvents(out_video, out_click, z, SequenceWorld(rules, successor, b, slope))


def replay(world: SequenceWorld, user: np.ndarray, time_ms: np.ndarray, cluster: np.ndarray,
           clicked: np.ndarray) -> np.ndarray:
    """[N] events sorted by (user, time), their clusters and clicks given -> [N] the sequential
    affinity each one had when it was shown (its own click not yet counted)."""
    same_user = np.diff(user) == 0
    if np.any(np.diff(user) < 0) or np.any(same_user & (np.diff(time_ms) < 0)):
        raise ValueError("replay needs events sorted by (user, time_ms)")
    walk = _EventWalk(user, time_ms)
    sequential, _ = walk.run(world, lambda e, traces, active: cluster[e], lambda e, s: clicked[e], None)
    return sequential


class HistoryTraces(NamedTuple):
    """The traces of P arrangements of a history, just before the event that follows it."""

    interest: np.ndarray  # [P, K]
    total: np.ndarray  # [P] interest summed over clusters
    fatigue: np.ndarray  # [P, K]

    def sequential_affinity(self, world: SequenceWorld, clusters: np.ndarray) -> np.ndarray:
        """[m] clusters of the next event, or [P, m] (one reading per arrangement) -> [P, m] its
        sequential affinity under each arrangement."""
        at = np.broadcast_to(clusters, (len(self.total), clusters.shape[-1]))
        return world.sequential_affinity(np.take_along_axis(self.interest, at, axis=1), self.total[:, None],
                                         np.take_along_axis(self.fatigue, at, axis=1))


def history_traces(world: SequenceWorld, time_ms: np.ndarray, at_ms: int, cluster: np.ndarray,
                   clicked: np.ndarray) -> HistoryTraces:
    """A history's n time slots [n] (in order) and P arrangements of events over them ([P, n] clusters
    and clicks) -> the traces just before an event at `at_ms`. What `replay` accumulates event by
    event, summed at once: slot j's event weighs 0.5 ** ((n - j) / half-life in events + its age in
    hours / half-life in hours), whichever event sits there."""
    r, k = world.rules, len(world.successor)
    back, hours = len(time_ms) - np.arange(len(time_ms)), (at_ms - np.asarray(time_ms)) / HOUR_MS
    interest_weight = 0.5 ** (back / r.interest_half_life_events + hours / r.interest_half_life_hours)
    fatigue_weight = 0.5 ** (back / r.fatigue_half_life_events + hours / r.fatigue_half_life_hours)
    p = cluster.shape[0]
    row = np.arange(p)[:, None] * k  # each arrangement's block in the flattened [P, K] sums
    fed = clicked * interest_weight[None]

    def per_cluster(index: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return np.bincount((row + index).ravel(), np.broadcast_to(weight, index.shape).ravel(), p * k).reshape(p, k)

    interest = per_cluster(cluster, fed) + per_cluster(world.successor[cluster], r.successor_share * fed)
    return HistoryTraces(interest, (1 + r.successor_share) * fed.sum(axis=1), per_cluster(cluster, fatigue_weight))


class _Traces:
    """Every user's interest, its total and fatigue, rows in walk rank order (the users at a step are
    the first `active` rows)."""

    def __init__(self, world: SequenceWorld, num_users: int, first_ms: np.ndarray):
        self.world, k = world, len(world.successor)
        self.interest, self.fatigue = np.zeros((num_users, k)), np.zeros((num_users, k))
        self.total, self.last_ms = np.zeros(num_users), first_ms.copy()

    def decay_to(self, active: int, time_ms: np.ndarray) -> None:
        """The active users' next events are at `time_ms` [active]: decay by one event and by the time since."""
        r, hours = self.world.rules, (time_ms - self.last_ms[:active]) / HOUR_MS
        keep = 0.5 ** (1 / r.interest_half_life_events + hours / r.interest_half_life_hours)
        self.interest[:active] *= keep[:, None]
        self.total[:active] *= keep
        self.fatigue[:active] *= (0.5 ** (1 / r.fatigue_half_life_events + hours / r.fatigue_half_life_hours))[:, None]
        self.last_ms[:active] = time_ms

    def recent_share(self, active: int) -> np.ndarray:
        return self.world.recent_share(self.interest[:active], self.total[:active, None])

    def sequential_affinity(self, cluster: np.ndarray) -> np.ndarray:
        rows = np.arange(len(cluster))
        return self.world.sequential_affinity(self.interest[rows, cluster], self.total[rows], self.fatigue[rows, cluster])

    def record(self, cluster: np.ndarray, clicked: np.ndarray) -> None:
        rows, share = np.arange(len(cluster)), self.world.rules.successor_share
        self.interest[rows, cluster] += clicked
        self.interest[rows, self.world.successor[cluster]] += share * clicked
        self.total[rows] += (1 + share) * clicked
        self.fatigue[rows, cluster] += 1.0


Expose = Callable[[np.ndarray, _Traces, int], np.ndarray]  # (events, traces, active users) -> clusters
Decide = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (events, sequential affinity) -> clicked


class _EventWalk:
    """Events sorted by (user, time), visited by position: step p holds event p of every user that
    has one. Users are ranked by event count, so the users at step p are the first ranks."""

    def __init__(self, user: np.ndarray, time_ms: np.ndarray):
        first = np.flatnonzero(np.r_[True, user[1:] != user[:-1]]) if len(user) else np.zeros(0, np.int64)
        count = np.diff(np.r_[first, len(user)])
        rank = np.argsort(-count, kind="stable")
        self.first, self.count, self.user_of_rank = first[rank], count[rank], user[first[rank]]
        self.position = np.arange(len(user)) - np.repeat(first, count)
        self.time_ms = time_ms

    def run(self, world: SequenceWorld, expose: Expose, decide: Decide,
            max_positions: int | None) -> tuple[np.ndarray, np.ndarray]:
        """-> ([N] sequential affinity, [N] clicks) of the events at positions below `max_positions`
        (zeros elsewhere)."""
        traces = _Traces(world, len(self.first), self.time_ms[self.first])
        sequential_out, clicked_out = np.zeros(len(self.time_ms)), np.zeros(len(self.time_ms), bool)
        steps = int(self.count.max(initial=0))
        active = len(self.first)
        for p in range(steps if max_positions is None else min(steps, max_positions)):
            while self.count[active - 1] <= p:
                active -= 1
            events = self.first[:active] + p
            traces.decay_to(active, self.time_ms[events])
            cluster = expose(events, traces, active)
            sequential = traces.sequential_affinity(cluster)
            clicked = decide(events, sequential)
            traces.record(cluster, clicked)
            sequential_out[events], clicked_out[events] = sequential, clicked
        return sequential_out, clicked_out
