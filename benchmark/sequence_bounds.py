"""What the order of a user's history is worth on `--signal sequential` data (quality_bounds.py's
sequential rows). Every score knows the world (taste, quality, propensity, each video's cluster, the
sequential rules, the click intercept); they differ in what they know of the sequence:

    oracle                 the true click logit: the affinity plus the sequential part the event
                           was drawn with, which counts the visit's earlier events too
    history in order       the affinity plus the sequential part of the history before the visit,
                           in order, at the visit's start: the most a model that reads the history
                           (and not the visit's other candidates) can know
    history as a bag       the expected click probability when the same history events (videos,
                           clusters, actions) sit in a uniformly random order over the history's
                           time slots: a scorer that sees the multiset of events and when the user
                           was active, but not which event came when
    no sequence            the affinity alone

"History as a bag" averages over `permutations` random orders (Monte Carlo). It is an order-free
scorer, not the best one: given the bag, the true posterior over orders is not quite uniform (clicks
come in runs), but in histories of hundreds of events that leaves little to gain.
"""
from __future__ import annotations

import numpy as np

from data.dataset import InferenceDataset
from data.synthetic_sequence import SequenceWorld, history_traces, replay
from data.synthetic_world import World
from model.metrics import auc
from model.quality import QualitySplit, candidate_events

NEGLIGIBLE_WEIGHT = 1e-6  # history slots weighing less than this in both traces are left out
PERMUTATIONS = 128  # random orders averaged by "history as a bag" (its AUC moves < 0.001 beyond 64)
ORACLE, IN_ORDER = "oracle: affinity + sequence", "history in order"
AS_BAG, NO_SEQUENCE = "history as a bag", "no sequence: affinity alone"
SEQUENCE_ROWS = (ORACLE, IN_ORDER, AS_BAG, NO_SEQUENCE)


def order_bounds(world: World, sequence: SequenceWorld, dataset: InferenceDataset, split: QualitySplit,
                 permutations: int = PERMUTATIONS, seed: int = 0) -> tuple[dict[str, float | None], float | None]:
    """-> (click AUC of each `SEQUENCE_ROWS` score on the evaluated candidates, what the order is worth:
    the AUC of "history in order" less that of "history as a bag")."""
    scores = sequence_scores(world, sequence, dataset, split.eval_requests, permutations, seed)
    clicks = split.eval_pairs.labels[:, 0]
    aucs = {name: auc(score, clicks) for name, score in scores.items()}
    gain = None if aucs[IN_ORDER] is None or aucs[AS_BAG] is None else aucs[IN_ORDER] - aucs[AS_BAG]
    return aucs, gain


def sequence_scores(world: World, sequence: SequenceWorld, dataset: InferenceDataset, requests: np.ndarray,
                    permutations: int = PERMUTATIONS, seed: int = 0) -> dict[str, np.ndarray]:
    """Requests [R] -> each `SEQUENCE_ROWS` score of their candidates ([M], in `candidate_pairs` order)."""
    events = dataset.event_arrays()
    user = np.repeat(events.user_ids, np.diff(events.offsets))
    cluster = world.video_cluster[events.video_ids]
    clicked = (events.action_weights & 1) > 0
    sequential = replay(sequence, user, events.timestamps_ms, cluster, clicked)
    flat = candidate_events(dataset, requests)
    affinity = world.affinity(user[flat], events.video_ids[flat])
    in_order, as_bag = np.empty(len(flat)), np.empty(len(flat))
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
        clusters = cluster[flat[candidates]]
        traces = history_traces(sequence, times, at_ms, cluster[slots][None], clicked[slots][None])
        in_order[candidates] = affinity[candidates] + traces.sequential_affinity(sequence, clusters)[0]
        # A random order of the whole history puts a uniform random sample of its events, in random
        # order, in the slots that count.
        keys = rng.random((permutations, visit - first))
        drawn = first + np.argsort(keys, axis=1)[:, -len(slots):]  # [P, slots]
        traces = history_traces(sequence, times, at_ms, cluster[drawn], clicked[drawn])
        z = affinity[candidates][None] + traces.sequential_affinity(sequence, clusters)  # [P, m]
        as_bag[candidates] = sequence.click_probability(z).mean(axis=0)
        done += m
    return dict(zip(SEQUENCE_ROWS, (affinity + sequential[flat], in_order, as_bag, affinity)))


def _slots_that_count(sequence: SequenceWorld) -> int:
    """How many of the latest history events weigh more than NEGLIGIBLE_WEIGHT in some trace."""
    r = sequence.rules
    return int(np.ceil(max(r.interest_half_life_events, r.fatigue_half_life_events) * np.log2(1 / NEGLIGIBLE_WEIGHT)))
