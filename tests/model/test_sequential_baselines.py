"""Sequential baselines (model/baselines/markov.py, sasrec.py, affinity.py) and the visits they read (base.Visits)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from data.dataset import EventArrays
from data.requests import RequestTable
from helpers import NUM_TASKS, transition_visits
from model.baselines import (
    AffinityRegression,
    Interactions,
    ItemPopularity,
    LastItemsMarkov,
    MatrixFactorization,
    SASRec,
    Visits,
)
from model.baselines.base import PADDING
from model.baselines.tuning import Baseline, TuningData, grid, tune
from model.metrics import auc
from model.video_tags import VideoTagTable


def _as_pairs(visits: Visits) -> Interactions:
    """The visits' candidates as (user, video) events: what a non-sequential model gets."""
    return Interactions(visits.user_ids[visits.candidate_visit()], visits.candidate_videos, visits.labels)


def _click_auc(scores: np.ndarray, visits: Visits) -> float:
    return auc(scores[:, 0], visits.labels[:, 0])


@pytest.fixture(scope="module")
def planted():
    """Train / holdout / fresh visits where a candidate is clicked when it is the successor of the visit's
    last history video (helpers.transition_visits)."""
    rng = np.random.default_rng(0)
    return transition_visits(rng, 600), transition_visits(rng, 150), transition_visits(rng, 300)


def test_non_sequential_models_cannot_see_the_planted_transition(planted):
    """The control: every video is a successor equally often and the users are random, so (user, video)
    scorers rank fresh candidates no better than chance."""
    train, holdout, fresh = planted
    pairs = _as_pairs(fresh)
    popularity = ItemPopularity().fit(_as_pairs(train)).score(pairs.user_ids, pairs.video_ids)
    mf = MatrixFactorization(seed=0).fit(_as_pairs(train), _as_pairs(holdout)).score(pairs.user_ids, pairs.video_ids)
    assert _click_auc(popularity, fresh) < 0.6 and _click_auc(mf, fresh) < 0.6


def test_markov_model_learns_the_planted_transition(planted):
    train, _, fresh = planted
    scores = LastItemsMarkov(last_events=1).fit(train).score(fresh.unlabelled())
    assert scores.shape == (len(fresh.candidate_videos), NUM_TASKS)
    assert _click_auc(scores, fresh) > 0.8
    # Looking further back dilutes the one transition that matters with four random ones.
    diluted = LastItemsMarkov(last_events=5).fit(train).score(fresh.unlabelled())
    assert _click_auc(diluted, fresh) < _click_auc(scores, fresh)


def test_markov_model_backs_off_to_the_candidates_rate():
    """No transition evidence: a candidate scores its own training rate; an unseen one the global rate."""
    labels = np.zeros((3, NUM_TASKS), np.float32)
    labels[:2, 0] = 1.0  # video 7 clicked twice, video 8 shown once and not clicked
    train = Visits(np.array([0]), np.array([[5]]), np.array([[0]]), np.array([0, 3]), np.array([7, 7, 8]), labels)
    model = LastItemsMarkov(last_events=1, shrinkage=1.0, prior=1.0).fit(train)
    query = Visits(np.array([1]), np.array([[6]]), np.array([[0]]), np.array([0, 3]), np.array([7, 8, 9]), None)
    clicks = model.score(query)[:, 0]
    global_rate = 2 / 3
    assert clicks == pytest.approx([(2 + global_rate) / 3, global_rate / 2, global_rate])
    after_5 = model.score(Visits(np.array([1]), np.array([[5]]), np.array([[0]]), np.array([0, 1]), np.array([7]), None))
    assert after_5[0, 0] == pytest.approx((2 + clicks[0]) / 3)  # the transitions 5 -> 7, shrunk to 7's rate


def test_sasrec_learns_the_planted_transition(planted):
    train, holdout, fresh = planted
    model = SASRec(dim=16, blocks=1, heads=1, history_events=5, dropout=0.0, learning_rate=3e-3, epochs=15, seed=0)
    model.fit(train, holdout)
    assert 1 <= model.picked()["epochs"] <= 15 and len(model.holdout_scores) >= model.picked()["epochs"]
    assert _click_auc(model.score(fresh.unlabelled()), fresh) > 0.8


def _event_log(rng: np.random.Generator) -> tuple[EventArrays, RequestTable]:
    """Three users with 40 events each; every 8 events one visit of 4 candidates from event 8 on."""
    users, per_user = np.array([3, 5, 9]), 40
    n = len(users) * per_user
    events = EventArrays(users, np.arange(len(users) + 1) * per_user, rng.integers(0, 25, n),
                         rng.integers(0, 256, n), np.arange(n) * 1000, np.zeros((len(users), 1), np.int64))
    ends = np.arange(8, per_user - 4, 8)
    user = np.repeat(users, len(ends))
    end = np.tile(ends, len(users))
    order = np.lexsort((user, end))  # time order: by visit position, then user
    r = len(order)
    requests = RequestTable(np.arange(r), user[order], end[order] * 1000, np.zeros(r, np.int64), end[order],
                            np.full(r, 4))
    return events, requests


def test_visits_carry_each_users_last_events_before_the_visit():
    events, requests = _event_log(np.random.default_rng(1))
    visits = Visits.build(events, requests, np.arange(len(requests)), history_events=10, with_labels=True)
    for b in range(len(requests)):
        row = int(np.searchsorted(events.user_ids, requests.user_id[b]))
        first, end = int(events.offsets[row]), int(requests.end[b])
        expected = events.video_ids[first + max(end - 10, 0) : first + end]
        history = visits.history_videos[b]
        assert history[history != -1].tolist() == expected.tolist() and history[-1] == events.video_ids[first + end - 1]
        candidates = visits.candidate_videos[visits.candidate_offsets[b] : visits.candidate_offsets[b + 1]]
        assert candidates.tolist() == events.video_ids[first + end : first + end + 4].tolist()
    assert visits.unlabelled().labels is None


@pytest.mark.parametrize("make", [lambda: LastItemsMarkov(last_events=3),
                                  lambda: SASRec(dim=8, blocks=1, heads=1, history_events=10, epochs=2, seed=0),
                                  lambda: AffinityRegression(last_events=3)],
                         ids=["markov", "sasrec", "affinity"])
def test_sequential_baselines_never_read_the_scored_visit_or_what_follows(make):
    """Rewriting every event from a visit's first candidate on (videos and actions) leaves its scores as they
    were; rewriting one event before the visit changes them (the history is read)."""
    rng = np.random.default_rng(2)
    events, requests = _event_log(rng)
    everything = np.arange(len(requests))
    model = make().fit(Visits.build(events, requests, everything, 10, with_labels=True))
    scored = everything[-3:]  # the last visit of each user
    scores = model.score(Visits.build(events, requests, scored, 10, with_labels=False))

    rows = np.searchsorted(events.user_ids, requests.user_id[scored])
    starts = events.offsets[rows] + requests.end[scored]  # each scored visit's first candidate
    after = np.concatenate([np.arange(s, e) for s, e in zip(starts + 4, events.offsets[rows + 1])])
    candidates = np.concatenate([np.arange(s, s + 4) for s in starts])
    videos, actions = events.video_ids.copy(), events.action_weights.copy()
    videos[after] = rng.integers(0, 25, len(after))  # the candidates' ids are the query itself: kept
    actions[candidates] = 255 - actions[candidates]
    actions[after] = 255 - actions[after]
    future_rewritten = events._replace(video_ids=videos, action_weights=actions)
    again = model.score(Visits.build(future_rewritten, requests, scored, 10, with_labels=False))
    np.testing.assert_array_equal(again, scores)

    videos = videos.copy()
    latest, first_candidate = videos[starts - 1], videos[starts]
    # the latest event before each visit becomes its first candidate's video (another one if it was already)
    videos[starts - 1] = np.where(latest == first_candidate, (first_candidate + 1) % 25, first_candidate)
    past_rewritten = future_rewritten._replace(video_ids=videos)
    changed = model.score(Visits.build(past_rewritten, requests, scored, 10, with_labels=False))
    assert not np.array_equal(changed, scores)


def test_sequential_baselines_refuse_bad_input(planted):
    train = planted[0]
    with pytest.raises(ValueError, match="history_events must be >= 1, got 0"):
        Visits.build(*_event_log(np.random.default_rng(0)), np.arange(2), history_events=0, with_labels=True)
    with pytest.raises(ValueError, match="training visits need their candidates' labels"):
        LastItemsMarkov().fit(train.unlabelled())
    with pytest.raises(ValueError, match="last_events=9 but the visits carry 5 history events"):
        LastItemsMarkov(last_events=9).fit(train)
    with pytest.raises(ValueError, match=r"dim \(30\) must be a multiple of heads \(4\)"):
        SASRec(dim=30, heads=4)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        SASRec(dropout=1.0)
    with pytest.raises(ValueError, match="history_events=50 but the visits carry 5"):
        SASRec(history_events=50, epochs=1).fit(train)
    with pytest.raises(ValueError, match=r"labels \(7, 8\) for 8 candidates"):
        Visits(np.array([0, 1]), np.zeros((2, 3), np.int64), np.zeros((2, 3), np.int64), np.array([0, 4, 8]),
               np.zeros(8, np.int64), np.zeros((7, NUM_TASKS), np.float32))


def _as_fresh_videos(visits: Visits, tags: int, first_copy: int, rng: np.random.Generator) -> Visits:
    """`visits` over `tags` kinds of video (transition_visits' videos), each event and candidate renamed to
    a video of that kind drawn from 1,000 copies from `first_copy` on: the planted rule holds between
    kinds, while a video id recurs rarely (and never between two ranges of copies)."""
    def rename(ids):
        return np.where(ids == PADDING, PADDING, ids + tags * (first_copy + rng.integers(0, 1000, ids.shape)))

    every_video = np.arange(tags * 2000 + tags)
    table = VideoTagTable.from_pairs(every_video, every_video % tags)
    return Visits(visits.user_ids, rename(visits.history_videos), visits.history_actions, visits.candidate_offsets,
                  rename(visits.candidate_videos), visits.labels, table)


@pytest.fixture(scope="module")
def planted_between_tags():
    """`planted`'s visits (the same draws), their videos renamed by `_as_fresh_videos`."""
    rng = np.random.default_rng(0)
    train, holdout, fresh = transition_visits(rng, 600), transition_visits(rng, 150), transition_visits(rng, 300)
    return (_as_fresh_videos(train, 30, 0, rng), _as_fresh_videos(holdout, 30, 0, rng),
            _as_fresh_videos(fresh, 30, 1000, rng))


def test_markov_model_over_tags_learns_a_rule_between_kinds_of_video(planted_between_tags):
    """Every scored video is new: transitions between ids carry nothing, transitions between their tags do."""
    train, _, fresh = planted_between_tags
    by_tag = LastItemsMarkov(last_events=1, level="tag").fit(train).score(fresh.unlabelled())
    by_video = LastItemsMarkov(last_events=1).fit(train).score(fresh.unlabelled())
    assert _click_auc(by_tag, fresh) > 0.8 and _click_auc(by_video, fresh) < 0.6
    untagged = dataclasses.replace(train, video_tags=None)
    with pytest.raises(ValueError, match="no video tag table"):
        LastItemsMarkov(level="tag").fit(untagged)


def test_sasrec_over_tags_learns_a_rule_between_kinds_of_video(planted_between_tags):
    """Over ids it memorises the training videos (each seen about once) and learns nothing that carries."""
    train, holdout, fresh = planted_between_tags
    kwargs = dict(dim=16, blocks=1, heads=1, history_events=5, dropout=0.0, learning_rate=3e-3, epochs=15, seed=0)
    by_tag = SASRec(**kwargs, level="tag").fit(train, holdout)
    by_video = SASRec(**kwargs).fit(train, holdout)
    assert _click_auc(by_tag.score(fresh.unlabelled()), fresh) > 0.8
    assert _click_auc(by_video.score(fresh.unlabelled()), fresh) < 0.6


def test_tuning_tries_the_tag_grid_only_on_tagged_visits(planted_between_tags):
    train, holdout, _ = planted_between_tags
    markov = Baseline(LastItemsMarkov, grid(last_events=(1, 5)), tag_grid=grid(last_events=(1, 5), level=("tag",)))
    untagged = [dataclasses.replace(v, video_tags=None) for v in (train, holdout)]
    pairs = _as_pairs(train)
    tagged_data = TuningData(pairs, _as_pairs(holdout), pairs, train, holdout, train)
    plain_data = TuningData(pairs, _as_pairs(holdout), pairs, untagged[0], untagged[1], untagged[0])
    assert markov.points(tagged_data) == markov.grid + markov.tag_grid
    assert markov.points(plain_data) == markov.grid
    assert tune(markov, tagged_data, progress=False).params["level"] == "tag"


def test_an_unknown_level_is_refused_by_name():
    with pytest.raises(ValueError, match="level must be one of 'video', 'tag', got 'cluster'"):
        LastItemsMarkov(level="cluster")
    with pytest.raises(ValueError, match="level must be one of 'video', 'tag', got 'both'"):
        LastItemsMarkov(level="both")  # a count is over one kind of item
    with pytest.raises(ValueError, match="level must be one of 'video', 'tag', 'both', got 'cluster'"):
        SASRec(level="cluster")


def _taste_visits(rng: np.random.Generator, num_visits: int, users: int = 60, kinds: int = 12) -> Visits:
    """Each user likes 3 of `kinds` kinds of video; the feed shows liked kinds 60% of the time; a candidate
    of a liked kind is clicked 60% of the time, another 15%. A video is its kind (ids are kinds)."""
    liked = np.stack([rng.choice(kinds, 3, replace=False) for _ in range(users)])  # [U, 3]
    user = rng.integers(0, users, num_visits)

    def shown(shape):
        own = liked[user][:, rng.integers(0, 3, shape[1])] if len(shape) == 2 else None
        return np.where(rng.random(shape) < 0.6, own, rng.integers(0, kinds, shape))

    history = shown((num_visits, 20))
    candidates = shown((num_visits, 6)).ravel()
    visit = np.repeat(np.arange(num_visits), 6)
    likes = (candidates[:, None] == liked[user][visit]).any(1)
    labels = np.zeros((len(candidates), NUM_TASKS), np.float32)
    labels[:, 0] = rng.random(len(candidates)) < np.where(likes, 0.6, 0.15)
    return Visits(user, history, np.zeros_like(history), np.arange(num_visits + 1) * 6, candidates, labels)


def test_affinity_regression_reads_what_kinds_the_user_is_shown():
    rng = np.random.default_rng(3)
    train, fresh = _taste_visits(rng, 800), _taste_visits(rng, 300)
    scores = AffinityRegression(last_events=20).fit(train).score(fresh.unlabelled())
    assert scores.shape == (len(fresh.candidate_videos), NUM_TASKS)
    pairs = _as_pairs(fresh)
    popularity = ItemPopularity().fit(_as_pairs(train)).score(pairs.user_ids, pairs.video_ids)
    # Knowing which kinds each user likes ranks at most 0.69 here (clicks 60% against 15%; 70% of the
    # candidates are liked): the model comes near that from what each user was shown.
    assert _click_auc(scores, fresh) > 0.65 and _click_auc(popularity, fresh) < 0.6


def test_affinity_regression_leaves_a_candidates_own_label_out_of_its_item_rate():
    """Fitted on a candidate, its video's rate counts the video's other exposures only: a video shown once
    gets the overall rate, whatever its label."""
    labels = np.zeros((4, NUM_TASKS), np.float32)
    labels[[0, 1], 0] = 1.0  # video 7 shown twice and clicked twice; video 8 clicked once; video 9 not
    labels[2, 0] = 1.0
    train = Visits(np.array([0]), np.array([[5]]), np.array([[0]]), np.array([0, 4]), np.array([7, 7, 8, 9]), labels)
    model = AffinityRegression(last_events=1, item_prior=1.0).fit(train)
    item_rate = model._features(train, own_labels=labels.astype(np.float64))[:, 0, 3]  # click log-odds
    overall = 3 / 4
    expected = [(1 + overall) / 2, (1 + overall) / 2, overall, overall]  # the other exposure of 7; none of 8, 9
    np.testing.assert_allclose(item_rate, np.log(np.array(expected) / (1 - np.array(expected))))
    served = model._features(train.unlabelled())[:, 0, 3]  # scoring: every training exposure counts
    assert served[2] > served[3]


def test_affinity_regression_refuses_bad_parameters(planted):
    with pytest.raises(ValueError, match="last_events must be >= 1, got 0"):
        AffinityRegression(last_events=0)
    with pytest.raises(ValueError, match="item_prior must be > 0, got 0"):
        AffinityRegression(item_prior=0)
    with pytest.raises(ValueError, match="level must be one of"):
        AffinityRegression(level="author")
    with pytest.raises(ValueError, match="last_events=9 but the visits carry 5 history events"):
        AffinityRegression(last_events=9).fit(planted[0])
