"""The auxiliary next-clicked-item loss (model/next_item_loss.py): which pairs it trains, that it
leaves the candidate logits alone, and that its gradient reaches the layers through the history."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from data.dataset import InferenceDataset
from helpers import (
    Visit,
    build_processed,
    make_batch,
    random_histories,
    random_tag_table,
    sensitive_model,
    tagged_model,
    tiny_config,
)
from model.config import config_for_dataset
from model.next_item_loss import NextItemLoss, NextItemTargets
from model.recommender import HSTURecommender
from model.train import train
from model.train_params import TrainParams


def _batch(rng, config, lengths=(12, 20)):
    histories = random_histories(rng, 3, lengths, config)
    visits = [Visit(u, len(h.video_ids), rng.integers(0, 50_000, size=4)) for u, h in histories.items()]
    return histories, make_batch(histories, visits)


def test_pairs_are_each_event_and_the_clicked_event_after_it_within_one_user():
    rng = np.random.default_rng(0)
    table = random_tag_table(rng)
    model = tagged_model(0, table)
    histories, batch = _batch(rng, model.config)
    inputs = model.prepare_inputs(batch)
    targets = NextItemTargets.of(batch, inputs.features)

    expected_sources, expected_items = [], []
    row = 0
    for history in histories.values():
        row += model.layout.num_prefix  # each visit opens its window: the prefix rows come first
        for i in range(len(history.video_ids) - 1):
            if history.action_weights[i + 1] & 1:
                video = int(history.video_ids[i + 1])
                expected_sources.append(row + i)
                expected_items.append((video % model.config.video_hash_size, int(table.rows(np.array([video]))[0])))
        row += len(history.video_ids)
    np.testing.assert_array_equal(targets.source_rows, expected_sources)
    video_rows, tag_rows = targets.item_rows["video_id"], targets.item_rows["video_tag"]
    items = list(zip(video_rows[targets.target_index].tolist(), tag_rows[targets.target_index].tolist()))
    assert items == expected_items
    assert len(set(zip(video_rows.tolist(), tag_rows.tolist()))) == video_rows.size


def test_no_pairs_without_clicks():
    rng = np.random.default_rng(1)
    config = tiny_config()
    model = sensitive_model(config)
    _, batch = _batch(rng, config)
    batch = replace(batch, action_weights=batch.action_weights & ~1)
    inputs = model.prepare_inputs(batch)
    targets = NextItemTargets.of(batch, inputs.features)
    assert targets.num_pairs == 0 and "video_tag" not in targets.item_rows
    states = model.encode(inputs, history_rows=True)
    loss = NextItemLoss(config.hidden_dim)(model, states, targets)
    assert loss.item() == 0.0 and loss.requires_grad


def test_history_outputs_leave_the_candidate_logits_unchanged():
    rng = np.random.default_rng(2)
    config = tiny_config()
    model = sensitive_model(config)
    _, batch = _batch(rng, config)
    inputs = model.prepare_inputs(batch)
    with torch.no_grad():
        served = model.run(inputs)
        states = model.encode(inputs, history_rows=True)
        n_hist = inputs.attention.plan.num_history_rows
        assert states.shape[0] == n_hist + inputs.features.shape.candidate_rows
        scored = model.score(states[n_hist:], inputs)[: inputs.num_candidates]
    torch.testing.assert_close(scored, served, rtol=0, atol=0)


def test_the_loss_trains_the_layers_through_the_history():
    """Its gradient alone reaches the first layer and the video rows of the target items."""
    rng = np.random.default_rng(3)
    table = random_tag_table(rng)
    model = tagged_model(0, table)
    _, batch = _batch(rng, model.config, lengths=(30, 40))
    inputs = model.prepare_inputs(batch)
    targets = NextItemTargets.of(batch, inputs.features)
    assert targets.num_pairs > 10
    loss = NextItemLoss(model.config.hidden_dim)(model, model.encode(inputs, history_rows=True), targets)
    assert 0 < loss.item() < 2 * np.log(targets.item_rows["video_id"].size) + 1
    loss.backward()
    assert model.layers[0].uvqk.weight.grad.abs().sum() > 0
    assert model.head[0].weight.grad is None  # the ranking head is not on its path
    video_grad = model.embedder.collection.embeddings["table_video_id"].weight.grad
    touched = video_grad.abs().sum(-1).nonzero().reshape(-1)
    assert set(targets.item_rows["video_id"].tolist()) <= set(touched.tolist())


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> InferenceDataset:
    return InferenceDataset(build_processed(tmp_path_factory.mktemp("next_item"), scale=0.002, seed=3))


def test_training_with_the_loss_moves_only_the_model_and_keeps_its_state_dict(dataset):
    params = TrainParams(preset="tiny", epochs=1, patience=1, batch_size=8, seed=0, max_train_requests=32,
                         next_item_loss_weight=0.5, max_train_seconds=1e-9)
    model = HSTURecommender(config_for_dataset("tiny", dataset), device="cpu")
    keys = set(model.state_dict())
    first_layer = model.layers[0].uvqk.weight.detach().clone()
    model, report = train(dataset, params, model=model)
    assert report.steps == 1 and np.isfinite(report.final_loss)
    assert not torch.equal(model.layers[0].uvqk.weight, first_layer)
    assert set(model.state_dict()) == keys  # the loss's projection is the trainer's, never saved


@pytest.mark.parametrize("weight", [-0.1, float("nan")])
def test_the_weight_must_be_non_negative(weight):
    with pytest.raises(ValueError, match="next_item_loss_weight must be >= 0"):
        TrainParams(next_item_loss_weight=weight)
