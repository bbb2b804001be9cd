"""Why a model can learn which items a user likes: the checks behind docs/model.md "Learning".

Candidate logits follow the candidate's own video; labels line up with candidates; embedding
rows of videos seen once in training move; the trainer keeps its best holdout epoch; and
training's smaller attention blocks compute the same function as serving's.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from data.dataset import InferenceDataset
from data.schema import action_labels
from helpers import Visit, build_processed, make_batch, random_histories, sensitive_model, tiny_config
from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import config_for_dataset
from model.evaluation import EarlyStopping, score_requests, window_batch
from model.recommender import HSTURecommender
from model.train import TRAINING_ATTENTION, train
from model.train_params import TrainParams, split_requests


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> InferenceDataset:
    return InferenceDataset(build_processed(tmp_path_factory.mktemp("signal"), scale=0.002, seed=3))


def _window_batches(model, dataset, indices, max_history_events=None):
    return [window_batch(model, dataset, idx, max_history_events) for idx in dataset.batches(indices, 8)]


def _visits(rng):
    config = tiny_config()
    histories = random_histories(rng, 3, (20, 40), config)
    visits = [Visit(u, len(h.video_ids), rng.integers(0, 50_000, size=6)) for u, h in histories.items()]
    return config, histories, visits


def test_candidate_logits_move_with_their_candidates():
    rng = np.random.default_rng(0)
    config, histories, visits = _visits(rng)
    model = sensitive_model(config)
    with torch.no_grad():
        logits = model(make_batch(histories, visits))
        permutations = [rng.permutation(len(v.candidates)) for v in visits]
        permuted = [replace(v, candidates=v.candidates[p]) for v, p in zip(visits, permutations)]
        permuted_logits = model(make_batch(histories, permuted))
    offsets = np.cumsum([0] + [len(v.candidates) for v in visits])
    order = np.concatenate([o + p for o, p in zip(offsets, permutations)])
    torch.testing.assert_close(permuted_logits, logits[order], rtol=1e-5, atol=1e-5)
    # ...and they depend on the video: candidates of one visit do not all score alike.
    for a, b in itertools.pairwise(offsets):
        assert logits[a:b, 0].std() > 1e-3


def test_changing_one_candidate_changes_only_its_logits():
    rng = np.random.default_rng(1)
    config, histories, visits = _visits(rng)
    model = sensitive_model(config)
    changed = [replace(visits[0], candidates=np.r_[visits[0].candidates[:-1], 123_457])] + visits[1:]
    with torch.no_grad():
        before, after = model(make_batch(histories, visits)), model(make_batch(histories, changed))
    moved = (before - after).abs().amax(dim=1) > 1e-6
    assert moved.tolist() == [i == len(visits[0].candidates) - 1 for i in range(len(moved))]


def test_labels_line_up_with_candidates(dataset):
    indices = dataset.request_indices()[:40]
    model = HSTURecommender(config_for_dataset("tiny", dataset))
    req = dataset.requests
    for idx in dataset.batches(indices, 8):
        batch = window_batch(model, dataset, idx)
        row = 0
        for i in idx:
            end = int(req.end[i])
            events = dataset.user_events(int(req.user_id[i]), end, end + int(req.num_candidates[i]))
            m = len(events.video_ids)
            np.testing.assert_array_equal(batch.candidate_video_ids[row:row + m], events.video_ids)
            np.testing.assert_array_equal(batch.labels[row:row + m], action_labels(events.action_weights))
            row += m
        assert row == len(batch.labels)


def test_training_blocks_compute_the_serving_function(dataset):
    indices = dataset.request_indices()[:24]
    torch.manual_seed(0)
    model = HSTURecommender(config_for_dataset("tiny", dataset)).eval()
    batch = window_batch(model, dataset, next(dataset.batches(indices, 8)))
    with torch.no_grad():
        serving = model(batch)
        model.attention_backend = TRAINING_ATTENTION
        training = model(batch)
    torch.testing.assert_close(training, serving, rtol=1e-5, atol=1e-5)


def test_rare_video_embeddings_move_in_training(dataset):
    params = TrainParams(preset="tiny", epochs=1, batch_size=8, seed=0)
    torch.manual_seed(1)
    model = HSTURecommender(config_for_dataset("tiny", dataset).replace(dropout=0.1))
    initial_rows = model.embedder.collection.embeddings["table_video_id"].weight.detach().clone()
    train_idx, _ = split_requests(dataset, params)
    batches = _window_batches(model, dataset, train_idx, params.max_history_events)
    candidates = np.concatenate([b.candidate_video_ids for b in batches]) % model.config.video_hash_size
    ids, counts = np.unique(candidates, return_counts=True)
    once = ids[counts == 1]
    assert len(once) > 10
    trained, _ = train(dataset, params, model=model)
    rows = trained.embedder.collection.embeddings["table_video_id"].weight.detach()
    moved = (rows[once] - initial_rows[once]).abs().amax(dim=1) > 1e-4
    assert moved.all(), f"{int((~moved).sum())} of {len(once)} videos seen once did not move"
    assert (trained.embedder.video_bias.weight.detach()[once].abs().amax(dim=1) > 1e-6).all()  # zero at the start
    # Rows that no training visit reads (as a candidate or in its cropped history) stay put.
    history = np.concatenate([b.video_ids for b in batches]) % model.config.video_hash_size
    unread = np.setdiff1d(np.arange(model.config.video_hash_size), np.concatenate([candidates, history]))
    torch.testing.assert_close(rows[unread], initial_rows[unread])


def test_early_stopping_keeps_the_best_epoch():
    model = torch.nn.Linear(2, 1)
    stopper = EarlyStopping(patience=2)
    losses = [0.9, 0.7, 0.8, 0.75, 0.6]
    stops, states = [], []
    for epoch, loss in enumerate(losses, 1):
        with torch.no_grad():
            model.weight.fill_(float(epoch))
        states.append(epoch)
        stops.append(stopper.update(epoch, loss, model))
    assert stops == [False, False, False, True, False][: len(stops)]
    assert stopper.best_epoch == 5 and stopper.best_score == 0.6
    stopper = EarlyStopping(patience=2)
    for epoch, loss in enumerate([0.5, 0.7, 0.8], 1):
        with torch.no_grad():
            model.weight.fill_(float(epoch))
        stop = stopper.update(epoch, loss, model)
    assert stop and stopper.best_epoch == 1
    stopper.restore_best(model)
    assert torch.all(model.weight == 1.0)
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=0)
    with pytest.raises(ValueError, match="select_on must be one of click_auc, loss"):
        TrainParams(select_on="auc")


@pytest.mark.parametrize("select_on", ["loss", "click_auc"])
def test_trainer_reports_epochs_throughput_and_keeps_the_best(dataset, select_on):
    params = TrainParams(preset="tiny", epochs=3, patience=1, batch_size=8, seed=0, select_on=select_on)
    model, report = train(dataset, params)
    assert 1 <= len(report.epochs) <= 3 and report.steps > 0
    assert report.candidates_per_second > 0 and report.requests_per_second > 0
    if select_on == "loss":
        best = min(report.epochs, key=lambda e: e.holdout_loss)
    else:
        best = max(report.epochs, key=lambda e: e.holdout_auc["click"])
    assert report.best_epoch == best.epoch and report.holdout_auc == best.holdout_auc
    assert report.stopped_early == (len(report.epochs) < 3)
    _, holdout = split_requests(dataset, params)
    again = score_requests(model, dataset, holdout, params.batch_size, progress=False)
    assert again.mean_bce() == pytest.approx(best.holdout_loss, rel=1e-5)
    assert model.attention_backend == "auto" and not model.training


def test_trainer_position_table_override_reaches_the_checkpoint(dataset, tmp_path):
    params = TrainParams(preset="tiny", epochs=1, batch_size=8, seed=0, max_train_requests=16, position_table_size=1)
    model, _ = train(dataset, params)
    assert model.config.position_table_size == 1
    assert model.embedder.collection.embeddings["table_position"].weight.shape[0] == 1
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path).model.eval()
    assert loaded.config == model.config
    _, holdout = split_requests(dataset, params)
    torch.testing.assert_close(score_requests(loaded, dataset, holdout, 8, progress=False).logits,
                               score_requests(model, dataset, holdout, 8, progress=False).logits)
    default, _ = train(dataset, replace(params, position_table_size=None))
    assert default.config.position_table_size == config_for_dataset("tiny", dataset).position_table_size


def test_trainer_embeds_the_datasets_video_tags(dataset, tmp_path):
    from model.video_tags import VideoTagTable

    table = VideoTagTable.from_dataset_dir(dataset.root)
    params = TrainParams(preset="tiny", epochs=1, batch_size=8, seed=0, max_train_requests=16, video_tags=True)
    model, _ = train(dataset, params)
    assert model.config.num_video_tags == table.num_rows
    assert np.array_equal(model.video_tags.tag_rows, table.tag_rows)
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path).model.eval()
    _, holdout = split_requests(dataset, params)
    torch.testing.assert_close(score_requests(loaded, dataset, holdout, 8, progress=False).logits,
                               score_requests(model, dataset, holdout, 8, progress=False).logits)
    without, _ = train(dataset, replace(params, video_tags=False))
    assert without.config.num_video_tags == 0 and without.video_tags is None


def test_the_tag_matching_start_ties_keys_to_queries_and_widens_the_tag_table(dataset, monkeypatch):
    """`initialise`: the key rows of every layer's projection become its query rows (so q.k starts as a
    similarity of the two tokens) and the tag table is drawn at the std asked; the trainer applies it to a
    fresh model, before the first step."""
    from model.features import VIDEO_TAG
    from model.fresh_model import initialise
    from model.video_tags import VideoTagTable

    params = TrainParams(preset="tiny", video_tags=True, tag_embedding_std=0.5, tied_query_key_init=True,
                         id_embedding_std=None)
    tags = VideoTagTable.from_dataset_dir(dataset.root)
    config = config_for_dataset("tiny", dataset).replace(num_video_tags=tags.num_rows)
    torch.manual_seed(0)
    model = HSTURecommender(config, video_tags=tags)
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    initialise(model, params)
    for layer in model.layers:
        for tensor in (layer.uvqk.weight, layer.uvqk.bias):
            u, v, q, k = tensor.chunk(4, dim=0)
            torch.testing.assert_close(k, q, rtol=0, atol=0)
            assert not torch.equal(q, u) and not torch.equal(q, v)
    table = f"embedder.collection.embeddings.table_{VIDEO_TAG}.weight"
    assert 0.4 < model.state_dict()[table].std() < 0.6 and before[table].std() < 0.05
    unchanged = [n for n in before if "uvqk" not in n and n != table]
    assert all(torch.equal(before[n], model.state_dict()[n]) for n in unchanged)  # nothing else moves

    plain = HSTURecommender(config, video_tags=tags)
    plain_state = {name: t.detach().clone() for name, t in plain.state_dict().items()}
    initialise(plain, TrainParams(preset="tiny", tag_embedding_std=None, id_embedding_std=None,
                                  tied_query_key_init=False))  # no option: the model as built
    assert all(torch.equal(plain_state[n], plain.state_dict()[n]) for n in plain_state)
    initialise(plain, TrainParams(preset="tiny", tag_embedding_std=None, id_embedding_std=0.5,
                                  tied_query_key_init=False))  # the id table alone is drawn wide
    ids = "embedder.collection.embeddings.table_video_id.weight"
    assert 0.4 < plain.state_dict()[ids].std() < 0.6
    assert all(torch.equal(plain_state[n], plain.state_dict()[n]) for n in plain_state if n != ids)

    seen = []
    monkeypatch.setattr("model.fresh_model.initialise", lambda m, p: seen.append(p))
    train(dataset, replace(params, epochs=1, batch_size=8, max_train_requests=8))
    assert seen and seen[0].tied_query_key_init


def test_table_stds_must_be_positive():
    for name in ("tag_embedding_std", "id_embedding_std"):
        with pytest.raises(ValueError, match=rf"{name} must be > 0 \(or None: the tables' default\), got 0\.0"):
            TrainParams(**{name: 0.0})
    with pytest.raises(ValueError, match=r"id_dropout must be in \[0, 1\), got 1\.0"):
        TrainParams(id_dropout=1.0)


def test_the_tag_match_bias_trains_and_survives_its_checkpoint(dataset, tmp_path):
    """`tag_match_bias`: every layer gets the per-head offset, training moves it off its prior, and a
    loaded checkpoint scores as the trained model; without tags it is refused before training."""
    from model.attention.relative_bias import TAG_MATCH_PRIOR

    params = TrainParams(preset="tiny", epochs=1, batch_size=8, seed=0, max_train_requests=32, video_tags=True,
                         tag_match_bias=True)
    model, _ = train(dataset, params)
    assert model.config.tag_match_bias
    offsets = torch.stack([layer.relative_bias.tag_match.detach() for layer in model.layers])
    assert not torch.allclose(offsets, torch.full_like(offsets, TAG_MATCH_PRIOR))
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path).model.eval()
    assert loaded.config.tag_match_bias
    _, holdout = split_requests(dataset, params)
    torch.testing.assert_close(score_requests(loaded, dataset, holdout, 8, progress=False).logits,
                               score_requests(model, dataset, holdout, 8, progress=False).logits)
    with pytest.raises(ValueError, match=r"tag_match_prior .* needs tag_match_bias"):
        TrainParams(tag_match_prior=4.0, tag_match_bias=False)
    with pytest.raises(ValueError, match=r"bias_learning_rate must be > 0 \(or None: the layers' rate\), got 0\.0"):
        TrainParams(bias_learning_rate=0.0)


def test_the_bias_tables_start_at_the_prior_asked_and_learn_at_their_own_rate(dataset):
    """`tag_match_prior` is where every head's offset starts; `bias_learning_rate` gives the position,
    time and tag tables (and nothing else) their own optimiser group."""
    from model.fresh_model import initialise
    from model.train import _optimizers
    from model.video_tags import VideoTagTable

    tags = VideoTagTable.from_dataset_dir(dataset.root)
    config = config_for_dataset("tiny", dataset).replace(num_video_tags=tags.num_rows, tag_match_bias=True)
    model = HSTURecommender(config, video_tags=tags)
    params = TrainParams(preset="tiny", video_tags=True, tag_match_bias=True, tag_match_prior=4.0,
                         bias_learning_rate=0.01)
    initialise(model, params)
    assert all(torch.equal(layer.relative_bias.tag_match, torch.full((config.num_heads,), 4.0))
               for layer in model.layers)
    bias = {id(p) for layer in model.layers for p in layer.relative_bias.parameters()}
    dense = _optimizers(model, params)[0][1].param_groups
    own = [g for g in dense if g["lr"] == 0.01]
    assert len(own) == 1 and {id(p) for p in own[0]["params"]} == bias
    shared = _optimizers(model, replace(params, bias_learning_rate=None))[0][1].param_groups
    assert len(shared) == len(dense) - 1 and bias <= {id(p) for p in shared[0]["params"]}  # else: the layers' rate


def test_trainer_id_row_overrides_reach_the_model(dataset):
    params = TrainParams(preset="tiny", epochs=1, batch_size=8, seed=0, max_train_requests=16,
                         video_hash_size=1, user_hash_size=0)
    model, _ = train(dataset, params)
    assert (model.config.video_hash_size, model.config.user_hash_size) == (1, 0)
    assert model.user_taste is None and model.embedder.video_bias.weight.shape[0] == 1


def _candidate_terms(model: HSTURecommender) -> list[torch.Tensor]:
    return [model.embedder.video_bias.weight, *model.counter_features.parameters(),
            *(table.weight for table in model.user_taste.tables())]


@pytest.mark.parametrize("delay_epochs", [0, 1])
def test_candidate_terms_wait_their_delay_while_the_layers_train(dataset, delay_epochs):
    """One step of the first epoch: the layers move either way; the candidate-only terms move only
    without a delay."""
    params = TrainParams(preset="tiny", epochs=2, patience=2, batch_size=8, seed=0, max_train_requests=32,
                         candidate_terms_delay_epochs=delay_epochs, max_train_seconds=1e-9)
    model = HSTURecommender(config_for_dataset("tiny", dataset), device="cpu")
    terms_before = [t.detach().clone() for t in _candidate_terms(model)]
    head_before = torch.nn.utils.parameters_to_vector(model.head.parameters()).detach().clone()
    model, report = train(dataset, params, model=model)
    assert report.steps == 1
    assert not torch.equal(torch.nn.utils.parameters_to_vector(model.head.parameters()), head_before)
    moved = [not torch.equal(after, before) for after, before in zip(_candidate_terms(model), terms_before)]
    assert moved == [delay_epochs == 0] * len(moved)


def test_candidate_terms_train_after_their_delay(dataset, monkeypatch):
    """Past the delay the terms train (the last epoch's weights kept, whichever epoch the holdout prefers)."""
    monkeypatch.setattr(EarlyStopping, "restore_best", lambda self, model: None)
    params = TrainParams(preset="tiny", epochs=2, patience=2, batch_size=8, seed=0, max_train_requests=32,
                         candidate_terms_delay_epochs=1)
    model = HSTURecommender(config_for_dataset("tiny", dataset), device="cpu")
    terms_before = [t.detach().clone() for t in _candidate_terms(model)]
    model, _ = train(dataset, params, model=model)
    assert all(not torch.equal(after, before) for after, before in zip(_candidate_terms(model), terms_before))


@pytest.mark.parametrize("delay_epochs", [3, -1])
def test_candidate_terms_delay_must_leave_epochs_to_train(delay_epochs):
    with pytest.raises(ValueError, match=r"candidate_terms_delay_epochs must be in \[0, epochs = 3\)"):
        TrainParams(epochs=3, candidate_terms_delay_epochs=delay_epochs)
