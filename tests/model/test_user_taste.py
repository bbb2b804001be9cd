"""The candidate-only user-taste term (model/user_taste.py) and what the trainer does with it.

The term must leave every history token's computation alone (so cached K/V stay valid), move
only the candidates' logits, by exactly its own value, and keep cached serving equal to full
recompute. The trainer's packed batches and its L2 on touched rows are checked beside it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.dataset import InferenceDataset
from helpers import (
    Visit,
    assert_logits_close,
    build_processed,
    make_batch,
    make_cache,
    random_histories,
    sensitive_model,
    serve,
    tiny_config,
)
from model.config import config_for_dataset
from model.recommender import HSTURecommender
from model.train import train
from model.train_params import TrainParams, split_requests
from model.train_schedule import shuffled_batches


def _history_projections(model: HSTURecommender, batch) -> list[torch.Tensor]:
    """Every layer's u, v, q, k of the history rows (what the KV cache stores is k and v of these)."""
    captured = []
    hooks = [layer.uvqk.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
             for layer in model.layers]
    try:
        with torch.no_grad():
            model(batch)
    finally:
        for hook in hooks:
            hook.remove()
    n_hist = int(batch.history_lengths.sum()) + model.layout.num_prefix * batch.batch_size
    return [out[:n_hist] for out in captured]


def _visits(rng, config):
    histories = random_histories(rng, 3, (12, 30), config)
    return histories, [Visit(u, len(h.video_ids), rng.integers(0, 50_000, size=5)) for u, h in histories.items()]


def test_user_taste_moves_candidate_logits_only():
    rng = np.random.default_rng(0)
    config = tiny_config()
    histories, visits = _visits(rng, config)
    batch = make_batch(histories, visits)
    model = sensitive_model(config)
    other = sensitive_model(config)
    with torch.no_grad():
        for table in other.user_taste.tables():
            table.weight.normal_(std=1.0)
        other.user_taste.task_weights.normal_()
        inputs = model.prepare_inputs(batch)
        expected_shift = other.user_taste(inputs.device_inputs) - model.user_taste(inputs.device_inputs)
        shift = other(batch) - model(batch)
    assert expected_shift.abs().max() > 0.1
    torch.testing.assert_close(shift, expected_shift, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(_history_projections(model, batch), _history_projections(other, batch)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_user_taste_follows_the_user():
    rng = np.random.default_rng(1)
    config = tiny_config()
    histories, visits = _visits(rng, config)
    model = sensitive_model(config)
    with torch.no_grad():
        model.user_taste.user_bias.weight.normal_(std=1.0)
    renamed = {u + 7: h for u, h in histories.items()}
    moved = [Visit(v.user_id + 7, v.end, v.candidates) for v in visits]
    with torch.no_grad():
        before, after = model(make_batch(histories, visits)), model(make_batch(renamed, moved))
    # Same events, other user ids: every candidate's logits move, by the two users' bias difference.
    bias = model.user_taste.user_bias.weight
    cands = np.repeat([v.user_id for v in visits], [len(v.candidates) for v in visits])
    factors = model.user_taste.user_factors.weight, model.user_taste.video_factors.weight
    video = torch.from_numpy(np.concatenate([v.candidates for v in visits]) % config.video_hash_size)

    def taste(users):
        u = torch.from_numpy(users % config.user_hash_size)
        return bias[u] + (factors[0][u] * factors[1][video]) @ model.user_taste.task_weights

    with torch.no_grad():
        torch.testing.assert_close(after - before, taste(cands + 7) - taste(cands), rtol=1e-5, atol=1e-5)


def test_cached_serving_with_user_taste_matches_full_recompute():
    rng = np.random.default_rng(2)
    config = tiny_config()
    histories = random_histories(rng, 4, (30, 60), config)
    model = sensitive_model(config)
    with torch.no_grad():
        for table in model.user_taste.tables():
            table.weight.normal_(std=1.0)
    cache = make_cache(config)
    for fraction in (0.3, 0.6, 1.0):  # three visits per user, each on the previous one's cache
        visits = [Visit(u, max(1, int(len(h.video_ids) * fraction)), rng.integers(0, 50_000, size=6))
                  for u, h in histories.items()]
        with torch.inference_mode():
            cached = serve(model, cache, histories, visits)
        full = serve(model, None, histories, visits)
        assert_logits_close(cached, full)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> InferenceDataset:
    return InferenceDataset(build_processed(tmp_path_factory.mktemp("taste"), scale=0.002, seed=5))


def test_shuffled_batches_pack_distinct_users(dataset):
    train_idx, _ = split_requests(dataset, TrainParams())
    batches = shuffled_batches(dataset, train_idx, 8, np.random.default_rng(0))
    np.testing.assert_array_equal(np.sort(np.concatenate(batches)), np.sort(train_idx))
    users = dataset.requests.user_id
    for batch in batches:
        assert 1 <= len(batch) <= 8
        assert len(np.unique(users[batch])) == len(batch)
    # Never more batches than the busiest user has visits or the batch size forces, plus the few a
    # first-fit packing can leave behind; cutting the shuffled list where a user repeats needs more.
    busiest = int(np.unique(users[train_idx], return_counts=True)[1].max())
    cut = list(dataset.batches(train_idx[np.random.default_rng(0).permutation(len(train_idx))], 8))
    assert len(batches) < len(cut)
    assert len(batches) <= max(busiest, -(-len(train_idx) // 8)) + 2


def test_training_moves_taste_rows_of_seen_users_only(dataset):
    params = TrainParams(preset="tiny", epochs=1, batch_size=8, seed=0, taste_l2=0.1, video_l2=0.1)
    torch.manual_seed(1)
    model = HSTURecommender(config_for_dataset("tiny", dataset))
    initial = model.user_taste.user_factors.weight.detach().clone()
    train_idx, _ = split_requests(dataset, params)
    trained, report = train(dataset, params, model=model)
    rows = trained.user_taste.user_factors.weight.detach()
    seen = np.unique(dataset.requests.user_id[train_idx] % model.config.user_hash_size)
    unseen = np.setdiff1d(np.arange(model.config.user_hash_size), seen)
    assert ((rows[seen] - initial[seen]).abs().amax(dim=1) > 1e-4).all()
    torch.testing.assert_close(rows[unseen], initial[unseen], rtol=0, atol=0)
    assert np.isfinite(report.final_loss)

