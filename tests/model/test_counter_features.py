"""The counting features (data/candidate_counters.py) and the candidate-only term that reads them
(model/counter_features.py). The counts must equal a plain count over what was logged before the
visit (so no candidate sees its own label), and the term must move only candidate logits, by
exactly its value, leaving cached serving equal to full recompute."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from data.dataset import InferenceDataset
from data.prior_exposures import PriorExposures
from helpers import (
    Visit,
    assert_logits_close,
    build_processed,
    make_batch,
    make_cache,
    plain_action_counts,
    random_histories,
    sensitive_model,
    serve,
    tiny_config,
)
from model.config import HSTUConfig
from model.counter_features import counter_inputs


def _repeating_visits(rng, histories, fraction: float = 1.0, count: int = 8) -> list[Visit]:
    """Visits whose candidates are half videos from the user's history, half fresh ones."""
    visits = []
    for u, h in histories.items():
        end = max(1, int(len(h.video_ids) * fraction))
        seen = rng.choice(h.video_ids[:end], size=count // 2)
        visits.append(Visit(u, end, np.concatenate([seen, rng.integers(60_000, 70_000, size=count - count // 2)])))
    return visits


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    return build_processed(tmp_path_factory.mktemp("counters"), scale=0.002, seed=5)


def _plain(events, rows, ends, times, candidates, until_ms=None):
    """The counters of candidates [b] counted event by event."""
    all_users = np.repeat(np.arange(len(events.offsets) - 1), np.diff(events.offsets))
    cutoff = np.minimum(times, until_ms) if until_ms is not None else times
    out = []
    for row, end, cut, cands in zip(rows, ends, cutoff, candidates):
        own = slice(events.offsets[row], events.offsets[row] + end)
        for v in cands:
            def counts(mask):
                return plain_action_counts(events.action_weights[mask])

            mine = np.zeros(len(events.video_ids), dtype=bool)
            mine[own] = True
            out.append([counts(mine), counts((events.video_ids == v) & (events.timestamps_ms < cut)),
                        counts(mine & (events.video_ids == v))])
        assert (all_users[own] == row).all()
    return np.array(out)


@pytest.mark.parametrize("frozen", [False, True])
def test_counters_equal_a_plain_count(processed, frozen):
    probe = InferenceDataset(processed)
    req = probe.requests
    until = int(np.median(req.time_ms)) if frozen else None
    dataset = InferenceDataset(processed, video_counters_until_ms=until)
    _, first = np.unique(req.user_id, return_index=True)
    idx = np.concatenate([first[:4], np.flatnonzero(req.user_id != req.user_id[first[0]])[-3:]])
    idx = idx[np.unique(req.user_id[idx], return_index=True)[1]]
    batch = dataset.make_batch(idx, req.end[idx], req.end[idx])
    events = dataset.event_arrays()
    rows = np.searchsorted(events.user_ids, req.user_id[idx])
    splits = np.cumsum(batch.candidate_lengths)[:-1]
    expected = _plain(events, rows, req.end[idx], req.time_ms[idx],
                      np.split(batch.candidate_video_ids, splits), until)
    np.testing.assert_array_equal(batch.candidate_counters, expected)
    assert batch.candidate_counters[:, 1, 0].max() >= 1  # other users' exposures were found
    unknown = dataset.counters().for_candidates(rows[:1], req.end[idx[:1]], req.time_ms[idx[:1]], [10**12])
    np.testing.assert_array_equal(unknown[0, 1:], 0)


def test_bad_counter_settings_are_refused(processed):
    for bad in (-5, 10**20, 1.5e12, "2022-04-22"):
        with pytest.raises(ValueError, match="video_counters_until_ms must be epoch milliseconds"):
            InferenceDataset(processed, video_counters_until_ms=bad)
    with pytest.raises(ValueError, match="counter_buckets must be >= 0"):
        HSTUConfig(counter_buckets=-1)

    class Huge:  # one user with 2**60 events: its (user, video, position) keys overflow int64
        offsets = np.array([0, 2**60])
        video_ids = np.arange(3)
        action_weights = np.zeros(3, dtype=np.int64)

    with pytest.raises(ValueError, match="do not fit one int64 key"):
        PriorExposures.build(Huge)


def test_counter_inputs_bucket_and_smooth():
    counts = np.array([[[0, 0, 0], [1, 1, 0], [3, 0, 3]], [[100, 40, 20], [2, 1, 1], [7, 7, 0]]])
    arrays = counter_inputs(counts, 3, buckets=3)
    np.testing.assert_array_equal(arrays["candidate_counter_buckets"], [[0, 1, 2], [2, 1, 2], [0, 0, 0]])
    np.testing.assert_allclose(arrays["candidate_counter_log_odds"][0], np.log([[1, 1], [2, 0.5], [0.25, 4]]), rtol=1e-6)
    np.testing.assert_allclose(arrays["candidate_counter_log_odds"][1, 0], np.log([41 / 61, 21 / 81]), rtol=1e-6)
    assert not arrays["candidate_counter_log_odds"][2].any()  # a padding row
    assert not counter_inputs(None, 2, 3)["candidate_counter_buckets"].any()


def test_counter_term_moves_candidate_logits_by_its_value_only():
    rng = np.random.default_rng(3)
    config = tiny_config()
    histories = random_histories(rng, 3, (12, 30), config)
    batch = make_batch(histories, _repeating_visits(rng, histories))
    assert (batch.candidate_counters[:, 2, 0] > 0).any()
    model = sensitive_model(config)
    blank = replace(batch, candidate_counters=None)
    with torch.no_grad():
        shift = model(batch) - model(blank)
        term = model.counter_features
        expected = term(model.prepare_inputs(batch).device_inputs) - term(model.prepare_inputs(blank).device_inputs)
    torch.testing.assert_close(shift, expected[: len(shift)], rtol=1e-5, atol=1e-5)
    assert shift.abs().max() > 0.1
    # Only the pair family differs between a seen and a fresh candidate of one visit.
    seen = batch.candidate_counters[:, 2, 0] > 0
    np.testing.assert_array_equal(batch.candidate_counters[~seen, 2], 0)


def test_cached_serving_with_counters_matches_full_recompute():
    rng = np.random.default_rng(4)
    config = tiny_config()
    histories = random_histories(rng, 4, (30, 60), config)
    model = sensitive_model(config)
    cache = make_cache(config)
    for fraction in (0.3, 0.6, 1.0):  # three visits per user, each on the previous one's cache
        visits = _repeating_visits(rng, histories, fraction)
        with torch.inference_mode():
            cached = serve(model, cache, histories, visits)
        full = serve(model, None, histories, visits)
        assert_logits_close(cached, full)
