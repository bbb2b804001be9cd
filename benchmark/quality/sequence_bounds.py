"""What the order of a user's history is worth on `--signal sequential` data (benchmark/quality/bounds.py's
sequential rows). Every score knows the world (taste, quality, propensity, each video's cluster, the
sequential rules, the click intercept); they differ in what they know of the sequence:

    oracle                 the true click probability: of the affinity plus the sequential part the
                           event was drawn with, which counts the visit's earlier events too
    history in order       of the affinity plus the sequential part of the history before the visit,
                           in order, at the visit's start: the most a model that reads the history
                           (and not the visit's other candidates) can know
    history as a bag       the expected click probability when the same history events (videos,
                           clusters, actions) sit in a uniformly random order over the history's
                           time slots: a scorer that sees the multiset of events and when the user
                           was active, but not which event came when
    no sequence            of the affinity alone

"History as a bag" averages over `permutations` random orders (Monte Carlo). It is an order-free
scorer, not the best one: given the bag, the true posterior over orders is not quite uniform (clicks
come in runs), but in histories of hundreds of events that leaves little to gain.

The model never sees a video's cluster: it sees the video's id, met a few times, and its primary
tag, which names the cluster for `tag_fidelity` (80%) of the videos. So the last three rows are also
scored with each cluster read from the tag (`--video_tags` data): drawn from P(cluster | tag), counted
over the world's videos (`ClusterReading.from_tags`), once per Monte Carlo sample and video (a
video's occurrences in a sample share it), the click probability averaged over the samples. Those
rows show what a scorer that reads order and tags, and knows the world's tastes and rules, can
reach (short of updating a video's cluster on who clicked it); the rows above know every cluster.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.dataset import InferenceDataset
from data.synthetic_sequence import HistoryTraces, SequenceWorld, history_traces, replay
from data.synthetic_world import World
from model.metrics import auc
from model.quality import QualitySplit, candidate_events
from model.video_tags import VideoTagTable

NEGLIGIBLE_WEIGHT = 1e-6  # history slots weighing less than this in both traces are left out
PERMUTATIONS = 128  # random orders (and cluster samples) averaged (the AUC moves < 0.001 beyond 64)
ORACLE, IN_ORDER = "oracle: affinity + sequence", "history in order"
AS_BAG, NO_SEQUENCE = "history as a bag", "no sequence: affinity alone"
SEQUENCE_ROWS = (ORACLE, IN_ORDER, AS_BAG, NO_SEQUENCE)
FROM_TAGS = ", clusters from tags"
TAG_ROWS = tuple(name + FROM_TAGS for name in (IN_ORDER, AS_BAG, NO_SEQUENCE))
TRUE_CLUSTERS, TAG_CLUSTERS = "true clusters", "clusters from tags"


@dataclass(frozen=True)
class ClusterReading:
    """How a score knows each video's cluster: the truth (`flat_cdf` None), or a sample of
    P(cluster | the video's primary tag row), counted over every video of the world."""

    world: World
    tag_rows: np.ndarray | None = None  # [V] each video's tag row
    flat_cdf: np.ndarray | None = None  # [rows * K] row r's cumulative posterior plus r: sorted as a whole

    @classmethod
    def from_tags(cls, world: World, tags: VideoTagTable) -> ClusterReading:
        k = world.taste.shape[1]
        rows = tags.rows(np.arange(len(world.video_cluster)))
        joint = np.bincount(rows * k + world.video_cluster, minlength=tags.num_rows * k).reshape(-1, k).astype(float)
        joint[joint.sum(axis=1) == 0] = np.bincount(world.video_cluster, minlength=k)  # a row no video has: the prior
        cdf = np.cumsum(joint / joint.sum(axis=1, keepdims=True), axis=1)
        cdf[:, -1] = 1.0
        return cls(world, rows, (cdf + np.arange(len(cdf))[:, None]).ravel())

    @property
    def samples(self) -> bool:
        return self.flat_cdf is not None

    def clusters(self, videos: np.ndarray, uniform: np.ndarray) -> np.ndarray:
        """videos (broadcastable to uniform's [P, n]) -> [P, n] clusters: the inverse cdf of each
        video's tag row at its uniform; the truth ignores the uniforms."""
        if self.flat_cdf is None:
            return np.broadcast_to(self.world.video_cluster[videos], uniform.shape)
        k = self.world.taste.shape[1]
        row = np.broadcast_to(self.tag_rows[videos], uniform.shape)
        return np.minimum(np.searchsorted(self.flat_cdf, row + uniform, side="right") - row * k, k - 1)


def order_bounds(world: World, sequence: SequenceWorld, dataset: InferenceDataset, split: QualitySplit,
                 permutations: int = PERMUTATIONS, seed: int = 0, tags: VideoTagTable | None = None
                 ) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """-> (click AUC on the evaluated candidates of each `SEQUENCE_ROWS` score and, given `tags`, of
    each `TAG_ROWS` one; what the order is worth, "history in order" less "history as a bag", with
    TRUE_CLUSTERS and, given tags, TAG_CLUSTERS)."""
    readings = [ClusterReading(world)] + ([ClusterReading.from_tags(world, tags)] if tags is not None else [])
    clicks = split.eval_pairs.labels[:, 0]
    aucs: dict[str, float | None] = {}
    gains: dict[str, float | None] = {}
    for reading in readings:
        scores = sequence_scores(world, sequence, dataset, split.eval_requests, permutations, seed, reading)
        got = {name: auc(score, clicks) for name, score in scores.items()}
        suffix = FROM_TAGS if reading.samples else ""
        in_order, as_bag = got[IN_ORDER + suffix], got[AS_BAG + suffix]
        gains[TAG_CLUSTERS if reading.samples else TRUE_CLUSTERS] = (
            None if in_order is None or as_bag is None else in_order - as_bag)
        aucs.update(got)
    return aucs, gains


def sequence_scores(world: World, sequence: SequenceWorld, dataset: InferenceDataset, requests: np.ndarray,
                    permutations: int = PERMUTATIONS, seed: int = 0, reading: ClusterReading | None = None
                    ) -> dict[str, np.ndarray]:
    """Requests [R] -> each score of their candidates ([M], in `candidate_pairs` order): the
    `SEQUENCE_ROWS` with the true clusters (`reading` None), the `TAG_ROWS` with a reading from tags
    (each the click probability averaged over `permutations` samples of the clusters, one per
    arrangement for the bag)."""
    reading = reading if reading is not None else ClusterReading(world)
    events = dataset.event_arrays()
    user = np.repeat(events.user_ids, np.diff(events.offsets))
    clicked = (events.action_weights & 1) > 0
    flat = candidate_events(dataset, requests)
    taste = world.cluster_taste_affinity()  # [U, K]
    scores = {name: np.empty(len(flat)) for name in (IN_ORDER, AS_BAG, NO_SEQUENCE)}
    rng = np.random.default_rng(seed)
    req = dataset.requests
    rows = np.searchsorted(events.user_ids, req.user_id[requests])
    span = _slots_that_count(sequence)
    done = 0
    for row, end, m in zip(rows, req.end[requests], req.num_candidates[requests]):
        first, visit = events.offsets[row], events.offsets[row] + end
        slots = np.arange(max(first, visit - span), visit)  # the history slots that still weigh
        times, at_ms = events.timestamps_ms[slots], events.timestamps_ms[visit]
        candidates = slice(done, done + m)
        videos, who = events.video_ids[flat[candidates]], user[visit]
        seen = np.unique(np.r_[events.video_ids[first:visit], videos]) if reading.samples else None
        affinity = taste[who] + (world.quality[videos] + world.propensity[who])[:, None]  # [m, K]: in each cluster
        samples = permutations if reading.samples else 1
        read_in_order = _read(reading, rng, seen, np.r_[events.video_ids[slots], videos], samples)
        history, at = read_in_order[:, : len(slots)], read_in_order[:, len(slots):]
        traces = history_traces(sequence, times, at_ms, history, np.broadcast_to(clicked[slots], history.shape))
        scores[IN_ORDER][candidates] = _mean_probability(sequence, affinity, traces, at)
        scores[NO_SEQUENCE][candidates] = _mean_probability(sequence, affinity, None, at)
        # A random order of the whole history puts a uniform random sample of its events, in random
        # order, in the slots that count.
        keys = rng.random((permutations, visit - first))
        drawn = first + np.argsort(keys, axis=1)[:, -len(slots):]  # [P, slots]
        read_bag = _read(reading, rng, seen, np.concatenate(
            [events.video_ids[drawn], np.broadcast_to(videos, (permutations, m))], axis=1), permutations)
        traces = history_traces(sequence, times, at_ms, read_bag[:, : len(slots)], clicked[drawn])
        scores[AS_BAG][candidates] = _mean_probability(sequence, affinity, traces, read_bag[:, len(slots):])
        done += m
    if reading.samples:
        return {name + FROM_TAGS: score for name, score in scores.items()}
    sequential = replay(sequence, user, events.timestamps_ms, world.video_cluster[events.video_ids], clicked)
    oracle = world.affinity(user[flat], events.video_ids[flat]) + sequential[flat]
    return {ORACLE: sequence.click_probability(oracle), **scores}


def _read(reading: ClusterReading, rng: np.random.Generator, seen: np.ndarray | None, videos: np.ndarray,
          samples: int) -> np.ndarray:
    """[n] or [samples, n] videos -> [samples, n] clusters; a reading from tags draws one uniform per
    sample and distinct video of `seen` (the request's sorted videos)."""
    shape = (samples, videos.shape[-1])
    if seen is None:
        return reading.clusters(videos, np.broadcast_to(0.0, shape))
    pos = np.broadcast_to(np.searchsorted(seen, videos), shape)
    return reading.clusters(videos, np.take_along_axis(rng.random((samples, len(seen))), pos, axis=1))


def _mean_probability(sequence: SequenceWorld, affinity: np.ndarray, traces: HistoryTraces | None,
                      clusters: np.ndarray) -> np.ndarray:
    """Candidates' affinity in each cluster [m, K], the traces of P arrangements (or none) and the
    candidates' clusters under each [P, m] -> [m] their click probability averaged over the P."""
    z = np.take_along_axis(affinity, clusters.T, axis=1).T
    if traces is not None:
        z = z + traces.sequential_affinity(sequence, clusters)
    return sequence.click_probability(z).mean(axis=0)


def _slots_that_count(sequence: SequenceWorld) -> int:
    """How many of the latest history events weigh more than NEGLIGIBLE_WEIGHT in some trace."""
    r = sequence.rules
    return int(np.ceil(max(r.interest_half_life_events, r.fatigue_half_life_events) * np.log2(1 / NEGLIGIBLE_WEIGHT)))
