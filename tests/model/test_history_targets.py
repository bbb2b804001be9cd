"""History targets (training): every event of a window scored as a candidate that sees only the events
before it. Each must score exactly as a visit whose history ends right before that event, scored at
its time with that one candidate: same features, same attention, same relative bias, same counters."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.dataset import InferenceDataset
from helpers import build_processed, sensitive_model
from model.config import preset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> InferenceDataset:
    return InferenceDataset(build_processed(tmp_path_factory.mktemp("targets"), scale=0.001, seed=5))


def _model(dataset: InferenceDataset):
    cfg = preset("tiny", user_feature_cardinalities=tuple(dataset.user_feature_cardinalities))
    return sensitive_model(cfg, 0)


def test_each_history_target_scores_as_the_visit_that_ends_before_it(dataset):
    model = _model(dataset)
    req = dataset.requests
    picks = np.flatnonzero(req.end >= 60)
    idx = picks[np.unique(req.user_id[picks], return_index=True)[1][:3]]  # three users, one visit each
    window = req.end[idx] - 40
    targets = 12
    with torch.inference_mode():
        trained = model(dataset.make_batch(idx, window, window, history_targets=targets))
    # The batch's candidates: each visit's 12 targets, then its own candidates.
    per_visit = np.split(trained, np.cumsum(targets + req.num_candidates[idx])[:-1])
    events = dataset.event_arrays()
    for b, i in enumerate(idx):
        row = dataset.user_rows(req.user_id[i : i + 1])
        first = events.offsets[row[0]]
        alone = []
        with torch.inference_mode():
            for end in range(req.end[i] - targets, req.end[i]):  # a batch holds a user once: a forward each
                one = dataset.make_request_batch(
                    req.user_id[i : i + 1], np.array([end]), window[b : b + 1], window[b : b + 1],
                    events.timestamps_ms[first + end : first + end + 1], np.ones(1, dtype=np.int64),
                    events.video_ids[first + end : first + end + 1])
                alone.append(model(one))
        torch.testing.assert_close(per_visit[b][:targets], torch.cat(alone), atol=1e-5, rtol=1e-5)
        with torch.inference_mode():  # and the visit's own candidates score as when served
            served = model(dataset.make_batch(idx[b : b + 1], window[b : b + 1], window[b : b + 1]))
        torch.testing.assert_close(per_visit[b][targets:], served, atol=1e-5, rtol=1e-5)


def test_history_targets_carry_their_events_labels_and_never_see_them(dataset):
    req = dataset.requests
    i = int(np.flatnonzero(req.end >= 30)[0])
    idx = np.array([i])
    window = req.end[idx] - 20
    batch = dataset.make_batch(idx, window, window, history_targets=5)
    plain = dataset.make_batch(idx, window, window)
    assert batch.candidate_lengths.tolist() == [5 + int(req.num_candidates[i])]
    assert np.array_equal(batch.candidate_video_ids[:5], plain.video_ids[-5:])
    assert np.array_equal(batch.labels[5:], plain.labels)
    bits = (plain.action_weights[-5:, None] >> np.arange(8)) & 1
    assert np.array_equal(batch.labels[:5], bits.astype(np.float32))
    assert batch.candidate_history_ends.tolist() == [*range(req.end[i] - 5, req.end[i]), *[req.end[i]] * (len(batch.labels) - 5)]
    # A target's label must not move its own score: it sees only the events before it.
    model = _model(dataset)
    flipped = plain.action_weights.copy()
    flipped[-1] ^= 0xFF  # the last target's own event, with other actions
    edited = type(batch)(**{**batch.__dict__, "action_weights": flipped})
    with torch.inference_mode():
        before, after = model(batch), model(edited)
    torch.testing.assert_close(before[4], after[4])  # the last target is unmoved
    assert not torch.allclose(before[5:], after[5:])  # the visit's candidates see that event


def test_bad_history_targets_are_refused(dataset):
    req = dataset.requests
    idx = np.array([0])
    with pytest.raises(ValueError, match="history_targets"):
        dataset.make_batch(idx, req.start[idx], req.start[idx], history_targets=-1)
    batch = dataset.make_batch(idx, req.start[idx], req.start[idx], history_targets=2)
    ends = batch.candidate_history_ends.copy()
    ends[0] = req.end[0] + 3  # beyond the visit's history
    with pytest.raises(ValueError, match="outside its window"):
        _model(dataset)(type(batch)(**{**batch.__dict__, "candidate_history_ends": ends}))
